"""The CUDA driver calls of the vmm half, on one device's primary context.

Every call goes through :meth:`CudaDevice.call`, which makes the device's
primary context current for the call and checks the ``CUresult`` (through
:func:`hal.backends.cuda.errors.check`). The primary context is the one
torch's runtime uses; this module never creates a context of its own.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from typing import Any

from hal.backends.cuda.errors import NAME, check
from hal.errors import InvalidArgumentError
from hal.types import MemInfo

log = logging.getLogger("hal.cuda")


def driver_module() -> Any:
    """``cuda.bindings.driver``, imported on first use."""
    from cuda.bindings import driver

    return driver


def device_count() -> int:
    """Number of CUDA devices the driver sees (initialises the driver)."""
    d = driver_module()
    check(d.cuInit(0), "cuInit", "device_count")
    return int(check(d.cuDeviceGetCount(), "cuDeviceGetCount", "device_count"))


class CudaDevice:
    """One device: its retained primary context and the vmm driver calls on it."""

    def __init__(self, index: int, shareable: bool = False) -> None:
        d = self._d = driver_module()
        check(d.cuInit(0), "cuInit", "get_backend")
        count = int(check(d.cuDeviceGetCount(), "cuDeviceGetCount", "get_backend"))
        if not 0 <= index < count:
            raise InvalidArgumentError(f"device={index} is out of range: the driver sees {count} GPU(s)",
                                       backend=NAME, call="get_backend")
        self.index = index
        self.count = count
        self.cu_device = check(d.cuDeviceGet(index), "cuDeviceGet", "get_backend")
        self.context = check(d.cuDevicePrimaryCtxRetain(self.cu_device), "cuDevicePrimaryCtxRetain",
                             "get_backend")
        self._ctx_id = int(self.context)
        self._released = False
        self._lock = threading.Lock()
        current = check(d.cuCtxGetCurrent(), "cuCtxGetCurrent", "get_backend")
        if int(current) == 0:
            check(d.cuCtxSetCurrent(self.context), "cuCtxSetCurrent", "get_backend")

        prop = d.CUmemAllocationProp()
        prop.type = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = index
        #: why chunks cannot be exported (None: they are created with a POSIX file descriptor handle type)
        self.unshareable_reason = self._unshareable_reason(shareable)
        if self.unshareable_reason is None:
            prop.requestedHandleTypes = self._posix_fd
        self.prop = prop
        desc = d.CUmemAccessDesc()
        desc.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        desc.location.id = index
        desc.flags = d.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self.access = [desc]

    @property
    def _posix_fd(self) -> Any:
        return self._d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR

    def _unshareable_reason(self, shareable: bool) -> str | None:
        """Why chunks will not carry a POSIX file descriptor handle type, or None when they will."""
        if not shareable:
            return "the backend was made without shareable=True (hal.get_backend('cuda', shareable=True))"
        attribute = self._d.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED
        supported = check(self._d.cuDeviceGetAttribute(attribute, self.cu_device), "cuDeviceGetAttribute",
                          "get_backend")
        if not supported:
            return (f"device {self.index} does not support POSIX file descriptor handles "
                    "(CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED is 0)")
        return None

    # -- the one entry point -------------------------------------------------------

    @contextlib.contextmanager
    def current(self) -> Iterator[None]:
        """Make this device's primary context current for the block.

        Already current: nothing to do. No context current on this thread:
        make ours current and leave it (as the runtime would). Another
        device's context current: push ours and pop it afterwards.
        """
        d = self._d
        cur = check(d.cuCtxGetCurrent(), "cuCtxGetCurrent", None)
        cur_id = int(cur)
        if cur_id == self._ctx_id:
            yield
        elif cur_id == 0:
            check(d.cuCtxSetCurrent(self.context), "cuCtxSetCurrent", None)
            yield
        else:
            check(d.cuCtxPushCurrent(self.context), "cuCtxPushCurrent", None)
            try:
                yield
            finally:
                check(d.cuCtxPopCurrent(), "cuCtxPopCurrent", None)

    def call(self, hook: str | None, native: str, *args: Any, detail: str = "") -> Any:
        """Call ``cuda.bindings.driver.<native>(*args)`` on this device's context; check the result."""
        fn = getattr(self._d, native)
        with self.current():
            return check(fn(*args), native, hook, detail)

    # -- queries -----------------------------------------------------------------

    def granularity(self, recommended: bool) -> int:
        flags = self._d.CUmemAllocationGranularity_flags
        option = (flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED if recommended
                  else flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM)
        return int(self.call("granularity", "cuMemGetAllocationGranularity", self.prop, option))

    def mem_info(self) -> MemInfo:
        free, total = self.call("mem_info", "cuMemGetInfo")
        return MemInfo(free=int(free), total=int(total))

    # -- vmm ---------------------------------------------------------------------

    def reserve(self, size: int, alignment: int) -> int:
        ptr = self.call("create_vir_ptr", "cuMemAddressReserve", size, alignment, 0, 0,
                        detail=f"size={size}")
        return int(ptr)

    def address_free(self, ptr: int, size: int) -> None:
        self.call("release_vir_ptr", "cuMemAddressFree", ptr, size, detail=f"ptr={ptr:#x}, size={size}")

    def create(self, size: int) -> Any:
        return self.call("create_phy_mem_handle", "cuMemCreate", size, self.prop, 0, detail=f"size={size}")

    def release(self, handle: Any, hook: str = "release_phy_mem_handle") -> None:
        self.call(hook, "cuMemRelease", handle)

    def export(self, handle: Any) -> int:
        """A new POSIX file descriptor for the chunk ``handle`` (created shareable)."""
        return int(self.call("export_phy_mem_handle", "cuMemExportToShareableHandle", handle, self._posix_fd, 0))

    def import_fd(self, fd: int) -> Any:
        """The handle of the chunk another process exported as the POSIX file descriptor ``fd``."""
        return self.call("import_phy_mem_handle", "cuMemImportFromShareableHandle", fd, self._posix_fd,
                         detail=f"fd={fd}")

    def map(self, ptr: int, size: int, handle: Any) -> None:
        self.call("map", "cuMemMap", ptr, size, 0, handle, 0, detail=f"ptr={ptr:#x}, size={size}")

    def set_access(self, ptr: int, size: int, hook: str = "map") -> None:
        """Make ``[ptr, ptr + size)`` (one or more contiguous mappings) read-write for the device."""
        self.call(hook, "cuMemSetAccess", ptr, size, self.access, 1, detail=f"ptr={ptr:#x}, size={size}")

    def unmap(self, ptr: int, size: int) -> None:
        self.call("unmap", "cuMemUnmap", ptr, size, detail=f"ptr={ptr:#x}, size={size}")

    # -- copies (tests and diagnostics) ----------------------------------------------

    def copy_to_device(self, ptr: int, data: bytes) -> None:
        """Synchronous host-to-device copy of ``data`` to ``ptr``."""
        import ctypes

        buf = ctypes.create_string_buffer(data, len(data))
        self.call(None, "cuMemcpyHtoD", ptr, ctypes.addressof(buf), len(data), detail=f"ptr={ptr:#x}")

    def copy_from_device(self, ptr: int, nbytes: int) -> bytes:
        """Synchronous device-to-host copy of ``nbytes`` at ``ptr``."""
        import ctypes

        buf = ctypes.create_string_buffer(nbytes)
        self.call(None, "cuMemcpyDtoH", ctypes.addressof(buf), ptr, nbytes, detail=f"ptr={ptr:#x}")
        return buf.raw

    # -- lifetime ----------------------------------------------------------------

    def release_context(self) -> None:
        """Drop the retain on the primary context taken at construction; idempotent."""
        with self._lock:
            if self._released:
                return
            self._released = True
        check(self._d.cuDevicePrimaryCtxRelease(self.cu_device), "cuDevicePrimaryCtxRelease", "shutdown")
