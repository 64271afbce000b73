"""Where libcndrv is, and whether the mlu backend can run here (the cheap probe).

:data:`LIBRARY` names what to look for (``$HAL_MLU_LIBRARY``,
``$NEUWARE_HOME``, torch_mlu); the search order and when the library alone is
enough are :class:`~hal.backends._native.locate.LibrarySpec`'s. The backend's own
part is the device question: ``cnInit`` then ``cnDeviceGetCount``, and a
driver that fails either is reported as unusable.
"""

from __future__ import annotations

import ctypes

from hal.backends._native.locate import LibrarySpec
from hal.backends.mlu import lib
from hal.errors import HalError

LIBRARY = LibrarySpec(backend=lib.NAME, soname="libcndrv.so", env_library="HAL_MLU_LIBRARY",
                      env_home="NEUWARE_HOME", home_hint="Neuware's env.sh", extension="torch_mlu")
ENV_LIBRARY = LIBRARY.env_library
ENV_HOME = LIBRARY.env_home
EXTENSION = LIBRARY.extension

#: whether the torch extension can be imported (without importing it)
extension_installed = LIBRARY.extension_installed


def open_library(explicit: str | None = None) -> lib.CndrvLibrary:
    """The first libcndrv that loads, in :meth:`~LibrarySpec.open`'s order."""
    return LIBRARY.open(lib.load, explicit)


def probe_reason() -> str | None:
    """Why the mlu backend cannot run here, or None."""
    cndrv, reason = LIBRARY.probe_library(open_library, extension_installed())
    if cndrv is None:
        return reason
    count = ctypes.c_int(0)
    try:
        cndrv.init_once()
        cndrv.call("probe", "cnDeviceGetCount", ctypes.byref(count))
    except HalError as exc:
        return f"{cndrv.path} cannot be used: {exc}"
    if count.value == 0:
        return f"{cndrv.path} sees no MLU (cnDeviceGetCount returned 0)"
    return None
