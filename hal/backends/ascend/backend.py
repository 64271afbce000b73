"""The ``ascend`` backend plugin: ACL VMM through ctypes, graphs through torch_npu."""

from __future__ import annotations

import ctypes
import functools
import logging
import threading
from typing import Any, ClassVar

from hal.api import hookimpl
from hal.backends._native.hooks import TorchHooks
from hal.backends._native.torch_glue import TorchGlue
from hal.backends._native.vmm import map_with_access
from hal.backends.ascend import lib, locate
from hal.types import MemInfo

log = logging.getLogger("hal.ascend")
NAME = lib.NAME


def _npu_glue(device: int) -> TorchGlue:
    from hal.backends.ascend.torch_glue import NpuGlue

    return NpuGlue(device)  # torch_npu runs aclInit and sets the device


class AscendBackend(TorchHooks):
    """Huawei Ascend NPUs through libascendcl (VMM) and torch_npu (graphs, streams, pools).

    Options:

    * ``library`` -- path of libascendcl.so (a runtime or a simulator); default
      ``$HAL_ASCEND_LIBRARY``, else ``$ASCEND_HOME_PATH/lib64/libascendcl.so``,
      else the soname on the loader path;
    * ``use_torch`` -- ``None`` (default): use torch_npu when it is installed;
      ``False``: VMM hooks only, torch_npu is never imported; ``True``: require it.

    Without torch_npu the ``"graphs"`` capability is absent and the graph hooks
    raise :class:`hal.UnsupportedError`; the runtime is then initialised with
    ``aclInit`` here instead of by torch_npu.
    """

    #: device memory is not host-accessible; the conformance suite over a
    #: simulator overrides this with ``--hal-option host_accessible=true``
    hal_requirements: ClassVar[dict[str, Any]] = {"host_accessible": False}
    backend_name = NAME
    torch_extension = locate.EXTENSION

    def __init__(self, device: int = 0, *, library: str | None = None, use_torch: bool | None = None) -> None:
        self.device = device
        self.library = locate.open_library(library)
        self.glue = self._open_glue(use_torch, locate.extension_installed, lambda: _npu_glue(device))
        if self.glue is None:
            self.library.init_once()  # otherwise torch_npu ran aclInit
        self._thread = threading.local()  # ACL binds a device per thread: aclrtSetDevice once in each
        self._prop = lib.physical_prop(device)
        self._access = lib.access_desc(device) if self.library.has("aclrtMemSetAccess") else None
        self._granularity = {rec: self._query_granularity(rec) for rec in (False, True)}
        log.debug("%s: device %d over %s (set access: %s, torch_npu: %s)", NAME, device, self.library.path,
                  self._access is not None, self.glue is not None)

    @classmethod
    def probe(cls) -> str | None:
        return locate.probe_reason()

    def _call(self, call: str, native: str, *args: Any) -> None:
        if not getattr(self._thread, "device_set", False):
            self.library.call(call, "aclrtSetDevice", self.device)
            self._thread.device_set = True
        self.library.call(call, native, *args)

    def _query_granularity(self, recommended: bool) -> int:
        gran = ctypes.c_size_t(0)
        option = (lib.ACL_RT_MEM_ALLOC_GRANULARITY_RECOMMENDED if recommended
                  else lib.ACL_RT_MEM_ALLOC_GRANULARITY_MINIMUM)
        self._call("granularity", "aclrtMemGetAllocationGranularity", ctypes.byref(self._prop), option,
                   ctypes.byref(gran))
        return gran.value

    # -- queries ---------------------------------------------------------------------

    @hookimpl
    def device_count(self) -> int:
        count = ctypes.c_uint32(0)
        self._call("device_count", "aclrtGetDeviceCount", ctypes.byref(count))
        return count.value

    @hookimpl
    def granularity(self, recommended: bool) -> int:
        return self._granularity[bool(recommended)]

    @hookimpl
    def mem_info(self) -> MemInfo:
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        self._call("mem_info", "aclrtGetMemInfo", lib.ACL_HBM_MEM, ctypes.byref(free), ctypes.byref(total))
        return MemInfo(free=free.value, total=total.value)

    # -- vmm -------------------------------------------------------------------------

    @hookimpl
    def create_vir_ptr(self, size: int) -> int:
        ptr = ctypes.c_void_p()
        self._call("create_vir_ptr", "aclrtReserveMemAddress", ctypes.byref(ptr), size, 0, None, 0)
        return int(ptr.value or 0)

    @hookimpl
    def release_vir_ptr(self, ptr: int, size: int) -> bool:
        self._call("release_vir_ptr", "aclrtReleaseMemAddress", ptr)
        return True

    @hookimpl
    def create_phy_mem_handle(self, size: int) -> int:
        handle = ctypes.c_void_p()
        self._call("create_phy_mem_handle", "aclrtMallocPhysical", ctypes.byref(handle), size,
                   ctypes.byref(self._prop), 0)
        return int(handle.value or 0)

    @hookimpl
    def release_phy_mem_handle(self, handle: int) -> bool:
        self._call("release_phy_mem_handle", "aclrtFreePhysical", handle)
        return True

    @hookimpl
    def map(self, ptr: int, size: int, handle: int) -> bool:
        call = functools.partial(self._call, "map")
        access = self._access
        set_access = None if access is None else lambda: call("aclrtMemSetAccess", ptr, size, ctypes.byref(access), 1)
        map_with_access(lambda: call("aclrtMapMem", ptr, size, 0, handle, 0), set_access,
                        lambda: call("aclrtUnmapMem", ptr), backend=NAME, ptr=ptr, access_call="aclrtMemSetAccess")
        return True

    @hookimpl
    def unmap(self, ptr: int, size: int) -> bool:
        self._call("unmap", "aclrtUnmapMem", ptr)  # ACL unmaps one whole mapping by its address
        return True

    # -- graphs, streams, pools: inherited from TorchHooks, over torch_npu when it is there

    @hookimpl
    def shutdown(self) -> bool:
        return True  # the library stays loaded for the process; the facade released everything else
