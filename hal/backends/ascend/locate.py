"""Where libascendcl is, and whether the ascend backend can run here (the cheap probe).

Search order: the ``library=`` option, then ``$HAL_ASCEND_LIBRARY``, then
``$ASCEND_HOME_PATH/lib64/libascendcl.so``, then the plain soname through the
loader path. The probe never imports torch_npu (``importlib.util.find_spec``).

Availability: at the default location the backend needs both the library and
torch_npu. With ``$HAL_ASCEND_LIBRARY`` (a runtime or a simulator named on
purpose) the library alone is enough: the VMM hooks work and the ``"graphs"``
capability is absent while torch_npu is missing.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import sys

from hal.backends.ascend import lib
from hal.errors import BackendUnavailableError, HalError

ENV_LIBRARY = "HAL_ASCEND_LIBRARY"
ENV_HOME = "ASCEND_HOME_PATH"
SONAME = "libascendcl.so"
EXTENSION = "torch_npu"


def extension_installed() -> bool:
    """Whether torch_npu can be imported (without importing it)."""
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


def open_library(explicit: str | None = None) -> lib.AclLibrary:
    """Load the first candidate that loads.

    :raises BackendUnavailableError: none loads (the message says where it looked and how to
        point at a runtime), or the one found lacks the VMM API.
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
        hint = f"; set ${ENV_HOME} (CANN's set_env.sh does) or ${ENV_LIBRARY}"
    raise BackendUnavailableError(f"{SONAME} not found: {'; '.join(problems)}{hint}", backend=lib.NAME)


def probe_reason() -> str | None:
    """Why the ascend backend cannot run here, or None."""
    override = bool(os.environ.get(ENV_LIBRARY))
    has_extension = extension_installed()
    try:
        acl = open_library()
    except BackendUnavailableError as exc:
        reason = str(exc).removeprefix(f"{lib.NAME}: ")
        if not override and not has_extension:
            reason += f"; and {EXTENSION} is not installed"
        return reason
    if not has_extension and not override:
        return (f"{EXTENSION} is not installed (found {acl.path}; set ${ENV_LIBRARY}={acl.path} "
                "to use the VMM hooks without it)")
    count = ctypes.c_uint32(0)
    try:
        acl.call("probe", "aclrtGetDeviceCount", ctypes.byref(count))
    except HalError:  # some runtimes answer only after aclInit: let opening the backend tell
        return None
    if count.value == 0:
        return f"{acl.path} sees no NPU (aclrtGetDeviceCount returned 0)"
    return None
