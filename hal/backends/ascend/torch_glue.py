"""torch_npu behind the graph, stream and pool hooks of the ascend backend.

Imported only when an ascend backend is opened with torch_npu installed
(``torch.npu`` is ``torch_npu.npu``). Pools over hal allocator callbacks go
through ``torch_npu._C._npu_customAllocator`` and ``torch.npu.MemPool``. Which
allocator a capture's segments come from depends on the release:

* up to 2.12, a segment goes to a custom allocator only while ``use_mem_pool``
  is active, and is freed with ``aclrtFree`` whatever allocated it; a capture
  with ``pool=MemPool.id`` alone takes torch_npu's own memory. hal's callbacks
  would never back a graph there, so the routed capabilities are off;
* from 2.13, a pool's segments come from the pool's allocator and go back to it;
* in every release, expandable segments (``PYTORCH_NPU_ALLOC_CONF``) are tried
  before a pool's allocator: the routed capabilities are off under them.

The plumbing shared with torch.cuda and torch_mlu is in
:mod:`hal.backends._native.torch_glue`; what is ascend's own is here: the
names, the version rule, the ``"global"`` capture mode, and turning exhausted
NPU streams into advice.
"""

from __future__ import annotations

import re

from hal.backends._native import torch_compat as compat
from hal.backends._native.capture import Phase
from hal.backends._native.torch_glue import ExtensionGlue, TorchExtension
from hal.backends.ascend.lib import ACL_ERROR_RT_NO_STREAM_RESOURCE, ACL_ERROR_RT_RESOURCE_ALLOC_FAIL, NAME
from hal.errors import CaptureError

EXTENSION = TorchExtension(module="torch_npu", device_type="npu", graph_class="NPUGraph")

#: the first torch_npu whose graph pools take segments from (and give them back to) the pool's allocator
MIN_TORCH_NPU_FOR_ROUTING = (2, 13)

_STREAMS_EXHAUSTED = re.compile(
    rf"\b{ACL_ERROR_RT_NO_STREAM_RESOURCE}\b|ACL_ERROR_RT_NO_STREAM_RESOURCE|"
    rf"\b{ACL_ERROR_RT_RESOURCE_ALLOC_FAIL}\b|ACL_ERROR_RT_RESOURCE_ALLOC_FAIL|resource alloc fail|"
    r"alloc sq ?cq fail|stream resources? (are|is) insufficient|no stream resource", re.IGNORECASE)


def stream_exhaustion(exc: BaseException) -> CaptureError | None:
    """A :class:`hal.CaptureError` with advice when ``exc`` says the NPU ran out of streams.

    A capture that runs out fails with 207008 ("stream resources are
    insufficient"), and has also been seen as 207005 ("resource alloc fail")
    and, on old HDK, "alloc sq cq fail".
    """
    match = _STREAMS_EXHAUSTED.search(str(exc))
    if match is None:
        return None
    return CaptureError(
        f"graph capture ran out of NPU stream resources ({match.group(0)}): every captured graph holds "
        "streams until it is released, and piecewise graphs cost num_layers + 1 graphs per captured size. "
        "Capture fewer sizes, full graphs instead of piecewise ones, or release graphs you no longer "
        f"replay. How many fit depends on the HDK and CANN versions. [{type(exc).__name__}: {exc}]",
        backend=NAME, call="capture")


class NpuGlue(ExtensionGlue):
    """The torch side of one ascend device."""

    backend = NAME
    extension = EXTENSION
    default_capture_mode = "global"
    no_custom_pool = ("this torch_npu has no MemPool or _npu_customAllocator "
                      "(it arrived with the builds for torch 2.5.1 alpha002 / 7.0.0)")
    alloc_conf_vars = ("PYTORCH_NPU_ALLOC_CONF", "PYTORCH_ALLOC_CONF")

    def routing_problem(self) -> str | None:
        """torch_npu before 2.13 never gives a graph pool's segments to the pool's allocator; expandable
        segments bypass it in every release."""
        version = compat.version_tuple(str(getattr(self.ext, "__version__", "")))
        if version[:2] < MIN_TORCH_NPU_FOR_ROUTING:
            return (f"{self.extension_version} gives a capture's segments to a custom allocator only inside "
                    "use_mem_pool and frees them with aclrtFree; a pool's own allocator backs graph memory "
                    "from torch_npu 2.13 on: upgrade torch_npu for vmm graph memory")
        return super().routing_problem()

    def capture_error(self, exc: BaseException, phase: Phase) -> CaptureError | None:
        """Exhausted streams become a :class:`hal.CaptureError` with advice."""
        return stream_exhaustion(exc)
