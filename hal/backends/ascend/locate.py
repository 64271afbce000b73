"""Where libascendcl is, and whether the ascend backend can run here (the cheap probe).

:data:`LIBRARY` names what to look for (``$HAL_ASCEND_LIBRARY``,
``$ASCEND_HOME_PATH``, torch_npu); the search order and when the library alone
is enough are :class:`~hal.backends._native.locate.LibrarySpec`'s. Ascend's own
part is the device question: a runtime that answers ``aclrtGetDeviceCount``
only after ``aclInit`` is left for opening the backend to judge.
"""

from __future__ import annotations

import ctypes

from hal.backends._native.locate import LibrarySpec
from hal.backends.ascend import lib
from hal.errors import HalError

LIBRARY = LibrarySpec(backend=lib.NAME, soname="libascendcl.so", env_library="HAL_ASCEND_LIBRARY",
                      env_home="ASCEND_HOME_PATH", home_hint="CANN's set_env.sh", extension="torch_npu")
ENV_LIBRARY = LIBRARY.env_library
ENV_HOME = LIBRARY.env_home
EXTENSION = LIBRARY.extension

#: whether the torch extension can be imported (without importing it)
extension_installed = LIBRARY.extension_installed


def open_library(explicit: str | None = None) -> lib.AclLibrary:
    """The first libascendcl that loads, in :meth:`~LibrarySpec.open`'s order."""
    return LIBRARY.open(lib.load, explicit)


def probe_reason() -> str | None:
    """Why the ascend backend cannot run here, or None."""
    acl, reason = LIBRARY.probe_library(open_library, extension_installed())
    if acl is None:
        return reason
    count = ctypes.c_uint32(0)
    try:
        acl.call("probe", "aclrtGetDeviceCount", ctypes.byref(count))
    except HalError:  # some runtimes answer only after aclInit: let opening the backend tell
        return None
    if count.value == 0:
        return f"{acl.path} sees no NPU (aclrtGetDeviceCount returned 0)"
    return None
