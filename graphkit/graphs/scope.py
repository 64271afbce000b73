"""The process router of a :func:`graphkit.graph_memory` block: what it does with the captures that no
router of a backend object takes (see :class:`ScopeRouter`)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import hal
from hal.types import Route

if TYPE_CHECKING:
    from graphkit.graphs.pools import GraphPools

log = logging.getLogger(__name__)


class ScopeRouter:
    """The process router of a :func:`graph_memory` block: the captures no backend object's router takes.

    * a capture of the block's backend on its device through another :class:`hal.Backend` object (an engine
      that calls ``hal.get_backend(...)`` itself) is routed to the block's pools, as the switch routes it;
    * one of that backend on another device, that no block of that device takes, is refused (its memory would
      silently come from the framework's own allocator);
    * one of another backend is left alone, with one warning per block naming the backend and the fix.
    """

    def __init__(self, pools: GraphPools) -> None:
        self.pools = pools
        self.unrouted: set[tuple[str, int]] = set()  # where the captures left alone ran (warned once each)

    def __call__(self, backend: str, device: int, graph: Any, requested_pool: Any) -> Route | None:
        be = self.pools.backend
        if backend == be.name and device == be.device:
            return self.pools.route(graph, requested_pool)
        if backend == be.name:
            raise hal.CaptureError(
                f"graph_memory() serves the captures on {be.name}:{be.device}, and this one starts on device "
                f"{device}: its memory would not come from graphkit. Enter graph_memory() with device {device} "
                "current (it takes the current device), or pass backend=hal.get_backend(device=...) for the "
                "device that captures; GRAPHKIT_GRAPH_MEMORY=1 serves every device of every process",
                backend=backend, call="graph_memory")
        if (backend, device) not in self.unrouted:
            self.unrouted.add((backend, device))
            log.warning("graph_memory() on %r saw a capture on %s:%d and does not route it: its memory comes from "
                        "that backend's own allocator, not from graphkit. Enter graph_memory(hal.get_backend(%r, "
                        "device=%d)) around it, or set GRAPHKIT_GRAPH_MEMORY=1 to serve every backend and device",
                        be, backend, device, backend, device)
        return None


__all__ = ["ScopeRouter"]
