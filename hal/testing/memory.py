"""Reading and writing bytes at mapped device addresses, for the aliasing tests.

Two ways in: :class:`HostAccess` (``ctypes`` on the address, for backends whose
mappings the host can touch) and :class:`TorchAccess` (a ``uint8`` tensor at
the address on the backend's ``torch_device()``: CPU tensors through
``torch.frombuffer``, CUDA tensors through ``__cuda_array_interface__``).
"""

from __future__ import annotations

import ctypes
from typing import Any, Protocol

from hal.facade import Backend
from hal.testing.requirements import Requirements


class MemoryAccess(Protocol):
    """Bytes in and out of mapped memory."""

    how: str

    def write(self, address: int, data: bytes) -> None: ...

    def read(self, address: int, size: int) -> bytes: ...


class HostAccess:
    """The host reads and writes the mapping directly."""

    how = "ctypes"

    def write(self, address: int, data: bytes) -> None:
        ctypes.memmove(address, data, len(data))

    def read(self, address: int, size: int) -> bytes:
        return ctypes.string_at(address, size)


class _CudaArray:
    """The minimal ``__cuda_array_interface__`` torch needs to wrap a raw device address."""

    def __init__(self, address: int, size: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (size,), "typestr": "|u1", "data": (address, False), "version": 3, "strides": None,
        }


class TorchAccess:
    """Tensors at the address on ``device`` do the reading and writing."""

    how = "torch"

    def __init__(self, device: Any) -> None:
        self.device = device

    def tensor_at(self, address: int, size: int) -> Any:
        """A ``uint8`` tensor of ``size`` bytes that lives at ``address``."""
        import torch

        if self.device.type == "cpu":
            return torch.frombuffer((ctypes.c_uint8 * size).from_address(address), dtype=torch.uint8)
        if self.device.type == "cuda":
            return torch.as_tensor(_CudaArray(address, size), device=self.device)
        raise NotImplementedError(f"no generic way to build a {self.device.type} tensor at a raw address")

    def write(self, address: int, data: bytes) -> None:
        import torch

        src = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        self.tensor_at(address, len(data)).copy_(src)

    def read(self, address: int, size: int) -> bytes:
        return bytes(self.tensor_at(address, size).cpu().tolist())


def torch_access(be: Backend) -> tuple[TorchAccess | None, str]:
    """A :class:`TorchAccess` for ``be``, or ``None`` and the reason there is none."""
    try:
        import torch  # noqa: F401
    except ImportError as exc:
        return None, f"torch is not importable: {exc}"
    try:
        device = be.torch_device()
    except Exception as exc:  # noqa: BLE001 - UnsupportedError, or the vendor's torch extension is missing
        return None, f"the backend has no torch device: {type(exc).__name__}: {exc}"
    if device is None or getattr(device, "type", None) not in ("cpu", "cuda"):
        return None, f"no generic way to build a tensor at a raw address on torch device {device!r}"
    return TorchAccess(device), ""


def memory_access(be: Backend, requirements: Requirements) -> tuple[MemoryAccess | None, str]:
    """How the suite touches mapped bytes on ``be``: ctypes when host-accessible, else torch."""
    if requirements.host_accessible:
        return HostAccess(), ""
    access, reason = torch_access(be)
    if access is None:
        return None, f"mapped memory is not host-accessible (host_accessible=False) and {reason}"
    return access, ""
