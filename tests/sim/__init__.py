"""Driver simulators for the ascend and mlu backends, and hal facades over them.

``acl_sim.c`` and ``cndrv_sim.c`` export the vendors' documented VMM symbols
over host memory (see each file's header for the rules they enforce); they are
compiled with gcc on first use and cached by source hash.

In a test::

    from tests.sim import simulated_backend

    be = simulated_backend("mlu", capacity=64 << 20, granularity=64 << 10)
    ...                                   # an ordinary hal.Backend; host-visible memory
    be.close()

Every call loads a private copy of the simulator, so each backend is an
independent device with its own capacity. For a child process (the
conformance suite, ``python -m hal``) use :func:`sim_env`.
"""

from __future__ import annotations

import atexit
import ctypes
import itertools
import shutil
import tempfile
from pathlib import Path
from typing import Any

import hal
from tests.sim.build import built, compiler_reason, home

__all__ = ["NAMES", "Simulator", "built", "compiler_reason", "home", "private_copy", "sim_env", "simulated_backend",
           "simulator"]

NAMES = ("ascend", "mlu")
DEFAULT_CAPACITY = 16 << 30
DEFAULT_GRANULARITY = 2 << 20

#: backend -> (library override variable, prefix of the simulator's variables and functions)
_ENV = {"ascend": ("HAL_ASCEND_LIBRARY", "ACL_SIM"), "mlu": ("HAL_MLU_LIBRARY", "CNDRV_SIM")}
_copies = itertools.count()
_copy_dir: Path | None = None


def sim_env(name: str, *, capacity: int = DEFAULT_CAPACITY, granularity: int = DEFAULT_GRANULARITY,
            set_access: bool = True, cann_version: str | None = None) -> dict[str, str]:
    """Environment variables that point backend ``name`` of a child process at its simulator.

    :param cann_version: ascend only: the CANN version the runtime reports (default ``"8.3.RC1"``).
    """
    library_var, prefix = _ENV[name]
    env = {
        library_var: str(built(name, set_access=set_access)),
        f"{prefix}_CAPACITY": str(capacity),
        f"{prefix}_GRANULARITY": str(granularity),
    }
    if cann_version is not None:
        env[f"{prefix}_CANN_VERSION"] = cann_version
    return env


class Simulator:
    """The simulator library behind one backend: its counters and its last complaint."""

    def __init__(self, cdll: ctypes.CDLL, name: str) -> None:
        self.cdll = cdll
        self.prefix = _ENV[name][1].lower()
        self._count = getattr(cdll, f"{self.prefix}_count")
        self._count.argtypes, self._count.restype = [ctypes.c_char_p], ctypes.c_uint64
        last = getattr(cdll, "aclGetRecentErrMsg" if name == "ascend" else "cndrv_sim_last_error")
        last.argtypes, last.restype = [], ctypes.c_char_p
        self._last = last

    def count(self, what: str) -> int:
        """``"ranges"``, ``"chunks"``, ``"mappings"``, ``"used"`` (bytes), ``"set_access"``, ``"init"``;
        ascend: ``"reserve_flags"`` (of the last reservation); mlu: ``"contexts"`` (created)."""
        return int(self._count(what.encode()))

    def last_error(self) -> str:
        """Why the simulator last refused a call on this thread."""
        raw = self._last()
        return raw.decode() if raw else ""

    def set_cann_version(self, version: str) -> None:
        """ascend only: the CANN version ``aclsysGetCANNVersion`` reports (``""``: it fails)."""
        fn = self.cdll.acl_sim_set_cann_version
        fn.argtypes, fn.restype = [ctypes.c_char_p], ctypes.c_int
        fn(version.encode())

    def configure(self, capacity: int, granularity: int, devices: int = 1) -> None:
        fn = getattr(self.cdll, f"{self.prefix}_configure")
        fn.argtypes, fn.restype = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint32], ctypes.c_int
        if fn(capacity, granularity, devices) != 0:
            raise ValueError(f"simulator refused capacity={capacity} granularity={granularity} devices={devices}")


def private_copy(name: str, set_access: bool = True) -> Path:
    """A private copy of the simulator library: loaded on its own, it has its own state."""
    global _copy_dir
    if _copy_dir is None:
        _copy_dir = Path(tempfile.mkdtemp(prefix="hal-sim-copies-"))
        atexit.register(shutil.rmtree, _copy_dir, True)
    source = built(name, set_access=set_access)
    target = _copy_dir / f"{source.stem}-{next(_copies)}.so"
    shutil.copyfile(source, target)
    return target


def simulated_backend(name: str, *, capacity: int = DEFAULT_CAPACITY, granularity: int = DEFAULT_GRANULARITY,
                      devices: int = 1, device: int = 0, set_access: bool = True, use_torch: bool = False,
                      cann_version: str | None = None, **options: Any) -> hal.Backend:
    """A :class:`hal.Backend` of ``name`` ("ascend" or "mlu") over a fresh simulated device.

    :param capacity: physical bytes; creating past it raises :class:`hal.DeviceOutOfMemoryError`.
    :param granularity: bytes (a multiple of the page size), 2 MiB like the devices by default.
    :param set_access: ascend only: ``False`` builds a runtime without ``aclrtMemSetAccess``.
    :param use_torch: passed to the backend: ``False`` keeps torch_npu / torch_mlu out (VMM only).
    :param cann_version: ascend only: the CANN version the runtime reports (default ``"8.3.RC1"``;
        ``""``: ``aclsysGetCANNVersion`` fails).
    :param options: further backend options.
    """
    from hal.backends.ascend import AscendBackend
    from hal.backends.mlu import MluBackend

    cls = {"ascend": AscendBackend, "mlu": MluBackend}[name]
    path = private_copy(name, set_access)
    try:
        sim = Simulator(ctypes.CDLL(str(path)), name)
        sim.configure(capacity, granularity, devices)
        if cann_version is not None:
            sim.set_cann_version(cann_version)
        plugin = cls(device=device, library=str(path), use_torch=use_torch, **options)
    finally:
        path.unlink()  # the loaded copy stays mapped; nothing else may load it again
    return hal.Backend(name, plugin, device=device, origin="simulator")


def simulator(be: hal.Backend) -> Simulator:
    """The simulator under a backend made by :func:`simulated_backend` (or over ``sim_env``)."""
    return Simulator(be.plugin.library.cdll, be.name)
