"""Whether pausing graph memory is safe for NCCL collectives captured in graphs.

With ``NCCL_GRAPH_REGISTER`` on (NCCL's default), a collective captured in a
graph registers its buffers by virtual address and keeps the physical pages
they had at capture; a resume maps other pages at that address.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)


def graph_register_hazard() -> str | None:
    """Why sleeping graph memory may break NCCL collectives captured in graphs, or None."""
    if os.environ.get("NCCL_GRAPH_REGISTER", "1") == "0":
        return None
    try:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return None
        uses_nccl = "nccl" in str(dist.get_backend()).lower()
    except (ImportError, RuntimeError, ValueError):
        return None
    if not uses_nccl:
        return None
    return ("pausing graph memory while torch.distributed uses NCCL with NCCL_GRAPH_REGISTER on: collectives "
            "captured in these graphs may keep moving data through the pages released now; set "
            "NCCL_GRAPH_REGISTER=0 before the graphs are captured (as vLLM does for its sleep mode)")


_warned = False


def warn_graph_register() -> None:
    """Log the NCCL graph-registration hazard once per process, where it applies."""
    global _warned
    why = None if _warned else graph_register_hazard()
    if why is not None:
        _warned = True
        log.warning("%s", why)
