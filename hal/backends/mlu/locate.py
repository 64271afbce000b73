"""Where libcndrv is, and whether the mlu backend can run here (the cheap probe).

:data:`LIBRARY` names what to look for (``$HAL_MLU_LIBRARY``,
``$NEUWARE_HOME``, torch_mlu); the search order and when the library alone is
enough are :class:`~hal.backends._native.locate.LibrarySpec`'s. The backend's own
part is the device question, ``cnInit`` then ``cnDeviceGetCount``. CNDrv forbids
``fork()`` after ``cnInit``, and a process that only lists backends (a server
that forks workers later, a test runner) must stay free to fork: so the probe
asks in a short-lived child process (the same Python, ``ctypes`` only), and the
calling process loads the library but never initialises it. Opening the backend
initialises it.
"""

from __future__ import annotations

import subprocess
import sys

from hal.backends._native.locate import LibrarySpec
from hal.backends.mlu import lib

LIBRARY = LibrarySpec(backend=lib.NAME, soname="libcndrv.so", env_library="HAL_MLU_LIBRARY",
                      env_home="NEUWARE_HOME", home_hint="Neuware's env.sh", extension="torch_mlu")
ENV_LIBRARY = LIBRARY.env_library
ENV_HOME = LIBRARY.env_home
EXTENSION = LIBRARY.extension

#: how long the child process of the probe may take, in seconds
PROBE_TIMEOUT = 60.0

#: run by the child: prints "<native function> <code> <devices>"
_CHILD = """
import ctypes, sys
cndrv = ctypes.CDLL(sys.argv[1])
count = ctypes.c_int(0)
code = cndrv.cnInit(ctypes.c_uint(0))
if code:
    print("cnInit", code, 0)
else:
    code = cndrv.cnDeviceGetCount(ctypes.byref(count))
    print("cnDeviceGetCount", code, count.value)
"""

#: whether the torch extension can be imported (without importing it)
extension_installed = LIBRARY.extension_installed


def open_library(explicit: str | None = None) -> lib.CndrvLibrary:
    """The first libcndrv that loads, in :meth:`~LibrarySpec.open`'s order."""
    return LIBRARY.open(lib.load, explicit)


def count_devices(path: str) -> tuple[str, int, int]:
    """``(native function, code, devices)`` of ``cnInit`` + ``cnDeviceGetCount``, asked in a child process.

    :raises OSError: the child could not run or said nothing readable (the message has its stderr).
    """
    try:
        proc = subprocess.run([sys.executable, "-I", "-c", _CHILD, path], capture_output=True, text=True,
                              timeout=PROBE_TIMEOUT, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise OSError(f"the probe's child process failed: {exc}") from exc
    try:
        native, code, devices = proc.stdout.split()
        return native, int(code), int(devices)
    except ValueError:
        tail = " ".join(proc.stderr.split()[-30:]) or f"exit code {proc.returncode}, no output"
        raise OSError(f"the probe's child process failed: {tail}") from None


def probe_reason() -> str | None:
    """Why the mlu backend cannot run here, or None. Leaves this process without ``cnInit``."""
    cndrv, reason = LIBRARY.probe_library(open_library, extension_installed())
    if cndrv is None:
        return reason
    try:
        native, code, devices = count_devices(cndrv.path)
    except OSError as exc:
        return f"{cndrv.path} cannot be probed: {exc}"
    if code != lib.CN_SUCCESS:
        return f"{cndrv.path} cannot be used: {lib.error_for(code, 'probe', native)}"
    if devices == 0:
        return f"{cndrv.path} sees no MLU (cnDeviceGetCount returned 0)"
    return None
