"""What the vendor backends (``cuda``, ``ascend``, ``mlu``) have in common.

* :mod:`~hal.backends._native.locate` -- finding a ctypes vendor library and the shape of the cheap probe;
* :mod:`~hal.backends._native.library` -- a loaded library whose calls are checked in one place;
* :mod:`~hal.backends._native.vmm` -- ``map`` then set access, undone when the access call fails;
* :mod:`~hal.backends._native.callbacks` -- the C allocator callbacks behind a torch pool, kept alive;
* :mod:`~hal.backends._native.torch_compat` -- every private torch / extension API, with its versions;
* :mod:`~hal.backends._native.torch_glue` -- graphs, streams and pools through ``torch.<device>`` (the routing of
  the captures its graph class starts is :mod:`hal.routing`'s, given the class);
* :mod:`~hal.backends._native.hooks` -- the backend hooks that delegate to that glue.

Only vendor-neutral plumbing lives here: structs, enum values, return-code
tables and prototypes stay in each vendor's package, because the stacks differ
(field order, flag values, argument order). Importing this package imports
neither torch nor any torch extension.
"""
