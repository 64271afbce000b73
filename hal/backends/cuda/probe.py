"""A cheap probe for the cuda backend: the driver through ctypes, packages through their metadata.

Neither cuda-python nor torch is imported here.
"""

from __future__ import annotations

import ctypes
import importlib.util
from importlib import metadata

INSTALL_HINT = "pip install 'hal-graphkit[cuda]'"


def driver_cuda_major(lib: ctypes.CDLL) -> int | None:
    """The CUDA major version the driver supports (13 for "CUDA Version: 13.0"), or None."""
    version = ctypes.c_int(0)
    if lib.cuDriverGetVersion(ctypes.byref(version)) != 0 or version.value <= 0:
        return None
    return version.value // 1000


def bindings_major() -> int | None:
    """The major version of the installed cuda-bindings (cuda-python) distribution, or None."""
    for dist in ("cuda-bindings", "cuda-python"):
        try:
            return int(metadata.version(dist).split(".")[0])
        except (metadata.PackageNotFoundError, ValueError):
            continue
    return None


def probe_reason() -> str | None:
    """Why the cuda backend cannot run here (None when it can)."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return "libcuda.so.1 (the NVIDIA driver) was not found"
    if lib.cuInit(0) != 0:
        return "cuInit failed: no usable NVIDIA GPU"
    count = ctypes.c_int(0)
    if lib.cuDeviceGetCount(ctypes.byref(count)) != 0 or count.value == 0:
        return "the NVIDIA driver sees no GPU"
    if importlib.util.find_spec("cuda") is None or importlib.util.find_spec("cuda.bindings") is None:
        return f"cuda-python is not installed ({INSTALL_HINT})"
    driver_major, bind_major = driver_cuda_major(lib), bindings_major()
    if driver_major is not None and bind_major is not None and bind_major > driver_major:
        return (f"cuda-python {bind_major}.x needs a CUDA {bind_major} driver, but the driver supports "
                f"CUDA {driver_major} (nvidia-smi 'CUDA Version'): install cuda-python {driver_major}.x "
                "or a newer driver")
    if importlib.util.find_spec("torch") is None:
        return "torch is not installed"
    return None

