"""Placeholder until the cuda backend lands: a real, cheap probe and nothing else."""

from __future__ import annotations

import ctypes
import importlib.util

from hal.api import hookimpl
from hal.errors import BackendUnavailableError


def probe_reason() -> str | None:
    """Why the cuda backend cannot run here (None when it can), without importing torch."""
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
        return "cuda-python is not installed (pip install 'hal-graphkit[cuda]')"
    if importlib.util.find_spec("torch") is None:
        return "torch is not installed"
    return None


class CudaBackend:
    """Not implemented yet: every call raises BackendUnavailableError."""

    def __init__(self, device: int = 0) -> None:
        raise BackendUnavailableError("the cuda backend is not implemented yet", backend="cuda")

    @classmethod
    def probe(cls) -> str | None:
        return probe_reason()

    @hookimpl
    def device_count(self) -> int: ...
    @hookimpl
    def granularity(self, recommended: bool) -> int: ...
    @hookimpl
    def mem_info(self) -> None: ...
    @hookimpl
    def create_vir_ptr(self, size: int) -> int: ...
    @hookimpl
    def release_vir_ptr(self, ptr: int, size: int) -> None: ...
    @hookimpl
    def create_phy_mem_handle(self, size: int) -> None: ...
    @hookimpl
    def release_phy_mem_handle(self, handle: object) -> None: ...
    @hookimpl
    def map(self, ptr: int, size: int, handle: object) -> None: ...
    @hookimpl
    def unmap(self, ptr: int, size: int) -> None: ...
