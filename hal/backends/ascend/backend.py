"""The ``ascend`` backend plugin: ACL VMM through ctypes, graphs through torch_npu."""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from typing import Any, ClassVar

from hal.api import hookimpl
from hal.backends._native import torch_compat as compat
from hal.backends._native.hooks import ExtensionHooks
from hal.backends._native.torch_glue import TorchGlue
from hal.backends.ascend import lib, locate
from hal.errors import InvalidArgumentError

log = logging.getLogger("hal.ascend")
NAME = lib.NAME
#: overrides the aclrtReserveMemAddress flags chosen from the CANN version: "0" or "1"
ENV_RESERVE_FLAGS = "HAL_ASCEND_RESERVE_FLAGS"


def _npu_glue(device: int) -> TorchGlue:
    from hal.backends.ascend.torch_glue import NpuGlue

    return NpuGlue(device)  # torch_npu runs aclInit and sets the device


class AscendBackend(ExtensionHooks):
    """Huawei Ascend NPUs through libascendcl (VMM) and torch_npu (graphs, streams, pools).

    Options:

    * ``library`` -- path of libascendcl.so (a runtime or a simulator); default
      ``$HAL_ASCEND_LIBRARY``, else ``$ASCEND_HOME_PATH/lib64/libascendcl.so``,
      else the soname on the loader path;
    * ``use_torch`` -- ``None`` (default): use torch_npu when it is installed;
      ``False``: VMM hooks only, torch_npu is never imported; ``True``: require it;
    * ``reserve_flags`` -- the ``flags`` of ``aclrtReserveMemAddress``, 0 or 1;
      default ``$HAL_ASCEND_RESERVE_FLAGS``, else chosen from the CANN version
      the runtime reports (:func:`~hal.backends.ascend.lib.reserve_flags_for`:
      1, the huge-page type, up to CANN 8; 0 from CANN 9).

    Without torch_npu the ``"graphs"`` capability is absent and the graph hooks
    raise :class:`hal.UnsupportedError`; the runtime is then initialised with
    ``aclInit`` here instead of by torch_npu. Maps are ``aclrtMapMem`` alone:
    the owning device may use the memory at once, and ``aclrtMemSetAccess`` is
    for other devices.
    """

    #: device memory is not host-accessible; the conformance suite over a
    #: simulator overrides this with ``--hal-option host_accessible=true``
    hal_requirements: ClassVar[dict[str, Any]] = {"host_accessible": False}
    backend_name = NAME
    torch_extension = locate.EXTENSION
    torch_device_type = "npu"
    count_devices = ("aclrtGetDeviceCount", ctypes.c_uint32)
    read_mem_info = ("aclrtGetMemInfo", (lib.ACL_HBM_MEM,), ctypes.c_size_t)

    def __init__(self, device: int = 0, *, library: str | None = None, use_torch: bool | None = None,
                 reserve_flags: int | None = None) -> None:
        self.device = device
        override = self._reserve_flags_override(reserve_flags)  # a bad value fails before anything is opened
        self.library = locate.open_library(library)
        self.glue = self._open_glue(use_torch, locate.extension_installed, lambda: _npu_glue(device))
        if self.glue is None:
            self.library.init_once()  # otherwise torch_npu ran aclInit
        self._thread = threading.local()  # ACL binds a device per thread: aclrtSetDevice once in each
        self._prop = lib.physical_prop(device)
        self.cann_version = self.library.cann_version()
        cann = compat.version_tuple(self.cann_version) if self.cann_version else None
        self.reserve_flags, self.reserve_flags_from = override or (
            lib.reserve_flags_for(cann),
            f"CANN {self.cann_version}" if self.cann_version else "an unknown CANN version (before CANN 9)")
        self._granularity = {rec: self._query_granularity(rec) for rec in (False, True)}
        log.debug("%s: device %d over %s (CANN %s, reserve flags %d from %s, torch_npu: %s)", NAME, device,
                  self.library.path, self.cann_version or "unknown", self.reserve_flags, self.reserve_flags_from,
                  self.glue is not None)

    @classmethod
    def probe(cls) -> str | None:
        return locate.probe_reason()

    @staticmethod
    def _reserve_flags_override(option: int | None) -> tuple[int, str] | None:
        """``(flags, where they come from)`` from the option, else the variable; None when neither is set."""
        if option is not None:
            source, raw = "the reserve_flags option", str(option)
        elif os.environ.get(ENV_RESERVE_FLAGS, "").strip():
            source, raw = f"${ENV_RESERVE_FLAGS}", os.environ[ENV_RESERVE_FLAGS].strip()
        else:
            return None
        if raw not in ("0", "1"):
            raise InvalidArgumentError(f"reserve_flags: {source} is {raw!r}; aclrtReserveMemAddress takes 0 "
                                       "(normal pages, or reserved on CANN 9) or 1 (huge pages)",
                                       backend=NAME, call="open")
        return int(raw), source

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

    # -- queries: device_count, mem_info and granularity are ExtensionHooks' over the two names above

    # -- vmm -------------------------------------------------------------------------

    @hookimpl
    def create_vir_ptr(self, size: int) -> int:
        ptr = ctypes.c_void_p()
        self._call("create_vir_ptr", "aclrtReserveMemAddress", ctypes.byref(ptr), size, 0, None, self.reserve_flags)
        return int(ptr.value or 0)

    @hookimpl
    def release_vir_ptr(self, ptr: int, size: int) -> None:
        self._call("release_vir_ptr", "aclrtReleaseMemAddress", ptr)

    @hookimpl
    def create_phy_mem_handle(self, size: int) -> int:
        handle = ctypes.c_void_p()
        self._call("create_phy_mem_handle", "aclrtMallocPhysical", ctypes.byref(handle), size,
                   ctypes.byref(self._prop), 0)
        return int(handle.value or 0)

    @hookimpl
    def release_phy_mem_handle(self, handle: int) -> None:
        self._call("release_phy_mem_handle", "aclrtFreePhysical", handle)

    @hookimpl
    def map(self, ptr: int, size: int, handle: int) -> None:
        self._call("map", "aclrtMapMem", ptr, size, 0, handle, 0)  # usable by the owning device at once

    @hookimpl
    def unmap(self, ptr: int, size: int) -> None:
        self._call("unmap", "aclrtUnmapMem", ptr)  # ACL unmaps one whole mapping by its address

    # -- graphs, streams, pools, use_pool, shutdown: inherited from ExtensionHooks, over torch_npu when it is there
