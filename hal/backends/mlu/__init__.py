"""``mlu``: Cambricon MLUs through libcndrv (ctypes) and torch_mlu.

* :mod:`~hal.backends.mlu.lib` -- prototypes, structs, enums, the return-code check;
* :mod:`~hal.backends.mlu.locate` -- where the library is, and the probe;
* :mod:`~hal.backends.mlu.backend` -- the plugin class;
* :mod:`~hal.backends.mlu.torch_glue` -- graphs, streams and pools through torch_mlu.

What it shares with ``ascend`` (never a struct, an enum value or a code table) is in
:mod:`hal.backends._native`.

Importing this package imports neither torch nor torch_mlu.
"""

from hal.backends.mlu.backend import MluBackend

__all__ = ["MluBackend"]
