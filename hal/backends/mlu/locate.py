"""Where libcndrv is, and whether the mlu backend can run here (the cheap probe).

Search order: the ``library=`` option, then ``$HAL_MLU_LIBRARY``, then
``$NEUWARE_HOME/lib64/libcndrv.so``, then the plain soname through the loader
path. The probe never imports torch_mlu (``importlib.util.find_spec``).

Availability: at the default location the backend needs both the library and
torch_mlu. With ``$HAL_MLU_LIBRARY`` (a driver or a simulator named on
purpose) the library alone is enough: the VMM hooks work and the ``"graphs"``
capability is absent while torch_mlu is missing.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import sys

from hal.backends.mlu import lib
from hal.errors import BackendUnavailableError, HalError

ENV_LIBRARY = "HAL_MLU_LIBRARY"
ENV_HOME = "NEUWARE_HOME"
SONAME = "libcndrv.so"
EXTENSION = "torch_mlu"


def extension_installed() -> bool:
    """Whether torch_mlu can be imported (without importing it)."""
    if EXTENSION in sys.modules:
        return sys.modules[EXTENSION] is not None
    try:
        return importlib.util.find_spec(EXTENSION) is not None
    except (ImportError, ValueError):
        return False


def candidates(explicit: str | None = None) -> list[str]:
    """Paths (or sonames) to try, in order."""
    if explicit:
        return [explicit]
    override = os.environ.get(ENV_LIBRARY)
    if override:
        return [override]
    home = os.environ.get(ENV_HOME)
    return ([os.path.join(home, "lib64", SONAME)] if home else []) + [SONAME]


def open_library(explicit: str | None = None) -> lib.CndrvLibrary:
    """Load the first candidate that loads.

    :raises BackendUnavailableError: none loads (the message says where it looked and how to
        point at a driver), or the one found lacks the VMM API.
    """
    problems = []
    for path in candidates(explicit):
        try:
            return lib.load(path)
        except OSError as exc:
            if os.sep not in path:
                problems.append(f"the loader finds no {SONAME}")
            elif os.path.exists(path):
                problems.append(f"{path} does not load ({exc})")
            else:
                problems.append(f"{path} does not exist")
    if explicit:
        hint = ""
    elif os.environ.get(ENV_LIBRARY):
        hint = f" (from ${ENV_LIBRARY})"
    else:
        unset = "" if os.environ.get(ENV_HOME) else f"${ENV_HOME} is unset and "
        problems = [unset + "; ".join(problems)]
        hint = f"; set ${ENV_HOME} (Neuware's env.sh does) or ${ENV_LIBRARY}"
    raise BackendUnavailableError(f"{SONAME} not found: {'; '.join(problems)}{hint}", backend=lib.NAME)


def probe_reason() -> str | None:
    """Why the mlu backend cannot run here, or None."""
    override = bool(os.environ.get(ENV_LIBRARY))
    has_extension = extension_installed()
    try:
        cndrv = open_library()
    except BackendUnavailableError as exc:
        reason = str(exc).removeprefix(f"{lib.NAME}: ")
        if not override and not has_extension:
            reason += f"; and {EXTENSION} is not installed"
        return reason
    if not has_extension and not override:
        return (f"{EXTENSION} is not installed (found {cndrv.path}; set ${ENV_LIBRARY}={cndrv.path} "
                "to use the VMM hooks without it)")
    count = ctypes.c_int(0)
    try:
        cndrv.init_once()
        cndrv.call("probe", "cnDeviceGetCount", ctypes.byref(count))
    except HalError as exc:
        return f"{cndrv.path} cannot be used: {exc}"
    if count.value == 0:
        return f"{cndrv.path} sees no MLU (cnDeviceGetCount returned 0)"
    return None
