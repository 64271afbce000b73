"""torch_mlu behind the graph, stream and pool hooks of the mlu backend.

Imported only when an mlu backend is opened with torch_mlu installed. Every
torch_mlu has ``torch.mlu.MLUGraph`` and ``torch_mlu._MLUC._mlu_customAllocator``;
``MemPool`` depends on the generation: the public branches (up to early 2025)
have none, newer builds (torch-mlu 1.27 and later) have
``torch.mlu.memory.MemPool`` and ``use_mem_pool``. Where it is missing, a pool
over hal allocator callbacks is not possible and graphkit falls back to a
shared pool. Expandable segments (``PYTORCH_MLU_ALLOC_CONF``) bypass a pool's
allocator, as on Ascend: the routed capabilities are off under them.

Capture mode: torch_mlu's own default is ``"relaxed"``; this glue passes on
the mode the caller asks for and uses ``"relaxed"`` when none is given.

Capture failures arrive as torch_mlu writes them, ``"CNRT error: "`` followed
by ``cnrtGetErrorStr`` of the code (a description, not the name).

The plumbing shared with torch.cuda and torch_npu is in :mod:`hal.backends._native.torch_glue`;
what is mlu's own is here: the names, the capture mode, and CNRT's queue-capture errors.
"""

from __future__ import annotations

import re

from hal.backends._native.capture import Phase
from hal.backends._native.torch_glue import ExtensionGlue, TorchExtension
from hal.backends.mlu.lib import CAPTURE_CODES, CNRT_CAPTURE_NAMES, CODE_NAMES, NAME
from hal.errors import CaptureError

DEFAULT_CAPTURE_MODE = "relaxed"

EXTENSION = TorchExtension(module="torch_mlu", device_type="mlu", graph_class="MLUGraph")

#: torch_mlu's text for a failed CNRT call: ``"CNRT error: " + cnrtGetErrorStr(code)``; a queue-capture
#: error's description speaks of the capture ("... when the queue is capturing", "capture sequence ...")
_CNRT_CAPTURE_TEXT = re.compile(r"CNRT error: [^\n]*?\bcaptur", re.IGNORECASE)
_CAPTURE_FAILURE = re.compile("|".join(
    [rf"\b{c}\b" for c in sorted(CAPTURE_CODES)]
    + [CODE_NAMES[c] for c in sorted(CAPTURE_CODES)]
    + [CNRT_CAPTURE_NAMES[c] for c in sorted(CAPTURE_CODES)]))


def capture_failure(exc: BaseException) -> CaptureError | None:
    """A :class:`hal.CaptureError` when ``exc`` carries one of CNRT's queue-capture errors.

    Recognised: torch_mlu's ``"CNRT error: <description>"`` whose description speaks
    of a capture, and the codes 100360-100366 or their CNRT / CNDrv names.
    """
    text = str(exc)
    match = _CNRT_CAPTURE_TEXT.search(text) or _CAPTURE_FAILURE.search(text)
    if match is None:
        return None
    what = text[match.start():].splitlines()[0] if match.re is _CNRT_CAPTURE_TEXT else match.group(0)
    return CaptureError(
        f"the MLU refused the capture ({what}): a host synchronisation, a foreign queue or "
        "another thread touched the capturing queue; move that work out of the captured region "
        f"[{type(exc).__name__}: {exc}]", backend=NAME, call="capture")


class MluGlue(ExtensionGlue):
    """The torch side of one MLU device."""

    backend = NAME
    extension = EXTENSION
    default_capture_mode = DEFAULT_CAPTURE_MODE
    no_custom_pool = ("this torch_mlu has no MemPool (the public torch_mlu branches have none; "
                      "torch-mlu 1.27 and later do): pools over allocator callbacks are not possible; "
                      "use a shared pool")
    alloc_conf_vars = ("PYTORCH_MLU_ALLOC_CONF",)
    routed_note = (" (the sources of the builds with MemPool are not public: that a capture with "
                   "pool=MemPool.id takes the pool's allocator is not confirmed)")

    def capture_error(self, exc: BaseException, phase: Phase) -> CaptureError | None:
        """CNRT's queue-capture errors become a :class:`hal.CaptureError`."""
        return capture_failure(exc)
