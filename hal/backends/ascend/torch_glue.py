"""torch_npu behind the graph, stream and pool hooks of the ascend backend.

Imported only when an ascend backend is opened with torch_npu installed
(``torch.npu`` is ``torch_npu.npu``). Pools over hal allocator callbacks go
through ``torch_npu._C._npu_customAllocator`` and ``torch.npu.MemPool``, which
older torch_npu builds lack: the ``"custom_pool"`` capability says whether this
build has them. The plumbing shared with torch.cuda and torch_mlu is in
:mod:`hal.backends._native.torch_glue`; what is ascend's own is here: the
names, the ``"global"`` capture mode, and turning exhausted NPU streams into
advice.
"""

from __future__ import annotations

import re

from hal.backends._native.torch_glue import TorchExtension, TorchGlue
from hal.backends.ascend.lib import ACL_ERROR_RT_NO_STREAM_RESOURCE, NAME
from hal.errors import CaptureError

EXTENSION = TorchExtension(module="torch_npu", device_type="npu", graph_class="NPUGraph")

_STREAMS_EXHAUSTED = re.compile(
    rf"\b{ACL_ERROR_RT_NO_STREAM_RESOURCE}\b|ACL_ERROR_RT_NO_STREAM_RESOURCE|"
    r"stream resources? (are|is) insufficient|no stream resource", re.IGNORECASE)


def stream_exhaustion(exc: BaseException) -> CaptureError | None:
    """A :class:`hal.CaptureError` with advice when ``exc`` says the NPU ran out of streams."""
    if not _STREAMS_EXHAUSTED.search(str(exc)):
        return None
    return CaptureError(
        f"graph capture ran out of NPU streams (ACL_ERROR_RT_NO_STREAM_RESOURCE = "
        f"{ACL_ERROR_RT_NO_STREAM_RESOURCE}): a device has about 2048 streams, roughly 1800 graphs, and "
        "piecewise graphs cost num_layers + 1 graphs per captured size. Capture fewer sizes, or full graphs "
        f"instead of piecewise ones. [{type(exc).__name__}: {exc}]",
        backend=NAME, call="capture")


class NpuGlue(TorchGlue):
    """The torch side of one ascend device."""

    backend = NAME
    extension = EXTENSION
    default_capture_mode = "global"
    no_custom_pool = ("this torch_npu has no MemPool or _npu_customAllocator "
                      "(it arrived with the builds for torch 2.5.1 alpha002 / 7.0.0)")

    def capture_error(self, exc: BaseException) -> CaptureError | None:
        """Exhausted streams become a :class:`hal.CaptureError` with advice."""
        return stream_exhaustion(exc)
