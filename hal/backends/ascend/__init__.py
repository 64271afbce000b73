"""``ascend``: Huawei Ascend NPUs through libascendcl (ctypes) and torch_npu.

* :mod:`~hal.backends.ascend.lib` -- prototypes, structs, enums, the return-code check;
* :mod:`~hal.backends.ascend.locate` -- where the library is, and the probe;
* :mod:`~hal.backends.ascend.backend` -- the plugin class;
* :mod:`~hal.backends.ascend.torch_glue` -- graphs, streams and pools through torch_npu.

What it shares with ``mlu`` (never a struct, an enum value or a code table) is in
:mod:`hal.backends._native`.

Importing this package imports neither torch nor torch_npu.
"""

from hal.backends.ascend.backend import AscendBackend

__all__ = ["AscendBackend"]
