"""torch_mlu behind the graph, stream and pool hooks of the mlu backend.

Imported only when an mlu backend is opened with torch_mlu installed. torch_mlu
has ``torch.mlu.MLUGraph`` and ``torch_mlu._MLUC._mlu_customAllocator`` but no
public ``MemPool``, so a pool over hal allocator callbacks is not possible
there: the ``"custom_pool"`` capability is reported only for a build that has
both, and graphkit falls back to a shared pool otherwise.

Capture mode: torch_mlu's own default is ``"relaxed"``; this glue passes on
the mode the caller asks for and uses ``"relaxed"`` when none is given.

The plumbing shared with torch.cuda and torch_npu is in :mod:`hal.backends._native.torch_glue`;
what is mlu's own is here: the names, the capture mode, and CNDrv's queue-capture errors.
"""

from __future__ import annotations

import re

from hal.backends._native.torch_glue import TorchExtension, TorchGlue
from hal.backends.mlu.lib import CAPTURE_CODES, CODE_NAMES, NAME
from hal.errors import CaptureError

DEFAULT_CAPTURE_MODE = "relaxed"

EXTENSION = TorchExtension(module="torch_mlu", device_type="mlu", graph_class="MLUGraph")

_CAPTURE_FAILURE = re.compile(
    "|".join([rf"\b{c}\b" for c in sorted(CAPTURE_CODES)] + [CODE_NAMES[c] for c in sorted(CAPTURE_CODES)]))


def capture_failure(exc: BaseException) -> CaptureError | None:
    """A :class:`hal.CaptureError` when ``exc`` carries one of CNDrv's queue-capture errors."""
    match = _CAPTURE_FAILURE.search(str(exc))
    if match is None:
        return None
    return CaptureError(
        f"the MLU refused the capture ({match.group(0)}): a host synchronisation, a foreign queue or "
        "another thread touched the capturing queue; move that work out of the captured region "
        f"[{type(exc).__name__}: {exc}]", backend=NAME, call="capture")


class MluGlue(TorchGlue):
    """The torch side of one MLU device."""

    backend = NAME
    extension = EXTENSION
    default_capture_mode = DEFAULT_CAPTURE_MODE
    no_custom_pool = ("torch_mlu has no public MemPool: pools over allocator callbacks are "
                      "not possible; use a shared pool")

    def capture_error(self, exc: BaseException) -> CaptureError | None:
        """CNDrv's queue-capture errors become a :class:`hal.CaptureError`."""
        return capture_failure(exc)
