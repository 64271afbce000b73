"""What the ctypes vendor backends (``ascend``, ``mlu``) have in common.

* :mod:`~hal.backends._native.locate` -- finding a vendor library and the shape of the cheap probe;
* :mod:`~hal.backends._native.library` -- a loaded library whose calls are checked in one place;
* :mod:`~hal.backends._native.callbacks` -- C allocator callbacks for a torch extension;
* :mod:`~hal.backends._native.torch_glue` -- graphs, streams and pools through a torch extension;
* :mod:`~hal.backends._native.hooks` -- the backend hooks that delegate to that glue.

Only vendor-neutral plumbing lives here: structs, enum values, return-code
tables and prototypes stay in each vendor's package, because the stacks differ
(field order, flag values, argument order). Importing this package imports
neither torch nor any torch extension.
"""
