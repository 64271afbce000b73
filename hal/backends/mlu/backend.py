"""The ``mlu`` backend plugin: CNDrv VMM through ctypes, graphs through torch_mlu."""

from __future__ import annotations

import ctypes
import logging
from typing import Any, ContextManager

from hal.api import AllocFn, FreeFn, hookimpl
from hal.backends.mlu import lib, locate
from hal.errors import BackendUnavailableError, UnsupportedError
from hal.types import MemInfo

log = logging.getLogger("hal.mlu")
NAME = lib.NAME


class MluBackend:
    """Cambricon MLUs through libcndrv (VMM) and torch_mlu (graphs, streams).

    Options:

    * ``library`` -- path of libcndrv.so (a driver or a simulator); default
      ``$HAL_MLU_LIBRARY``, else ``$NEUWARE_HOME/lib64/libcndrv.so``, else the
      soname on the loader path;
    * ``use_torch`` -- ``None`` (default): use torch_mlu when it is installed;
      ``False``: VMM hooks only, torch_mlu is never imported; ``True``: require it.

    ``cnInit(0)`` runs once per library and process. Every map is followed by
    ``cnMemSetAccess`` (read-write is flag 0); a failed SetAccess unmaps again.
    Captures use the mode the caller passes, ``"relaxed"`` (torch_mlu's
    default) when it passes none. The ``"custom_pool"`` capability is absent
    with today's torch_mlu (no public MemPool).
    """

    #: device memory is not host-accessible; the conformance suite over a
    #: simulator overrides this with ``--hal-option host_accessible=true``
    hal_requirements = {"host_accessible": False}

    def __init__(self, device: int = 0, *, library: str | None = None, use_torch: bool | None = None) -> None:
        self.device = device
        self.library = locate.open_library(library)
        if use_torch is None:
            use_torch = locate.extension_installed()
        elif use_torch and not locate.extension_installed():
            raise BackendUnavailableError("use_torch=True but torch_mlu is not installed", backend=NAME)
        self.glue: Any = None
        if use_torch:
            from hal.backends.mlu.torch_glue import MluGlue

            try:
                self.glue = MluGlue(device)  # torch_mlu makes the device's context current
            except ImportError as exc:
                raise BackendUnavailableError(f"torch_mlu is installed but does not import: {exc}",
                                              backend=NAME) from exc
        self.library.init_once()
        self._prop = lib.allocation_prop(device)
        self._access = lib.access_desc(device)
        self._granularity = {rec: self._query_granularity(rec) for rec in (False, True)}
        log.debug("%s: device %d over %s (torch_mlu: %s)", NAME, device, self.library.path,
                  self.glue is not None)

    @classmethod
    def probe(cls) -> str | None:
        return locate.probe_reason()

    def _call(self, call: str, native: str, *args: Any) -> None:
        self.library.call(call, native, *args)

    def _query_granularity(self, recommended: bool) -> int:
        gran = ctypes.c_uint64(0)
        option = lib.CN_MEM_ALLOC_GRANULARITY_RECOMMENDED if recommended else lib.CN_MEM_ALLOC_GRANULARITY_MINIMUM
        # CNDrv puts the output first: (&granularity, prop, option)
        self._call("granularity", "cnMemGetAllocationGranularity", ctypes.byref(gran), ctypes.byref(self._prop),
                   option)
        return gran.value

    def _torch(self, call: str) -> Any:
        if self.glue is None:
            raise UnsupportedError("needs torch_mlu, which this backend runs without", backend=NAME, call=call)
        return self.glue

    # -- queries ---------------------------------------------------------------------

    @hookimpl
    def device_count(self) -> int:
        count = ctypes.c_int(0)
        self._call("device_count", "cnDeviceGetCount", ctypes.byref(count))
        return count.value

    @hookimpl
    def granularity(self, recommended: bool) -> int:
        return self._granularity[bool(recommended)]

    @hookimpl
    def mem_info(self) -> MemInfo:
        free, total = ctypes.c_uint64(0), ctypes.c_uint64(0)
        self._call("mem_info", "cnMemGetInfo", ctypes.byref(free), ctypes.byref(total))
        return MemInfo(free=free.value, total=total.value)

    # -- vmm -------------------------------------------------------------------------

    @hookimpl
    def create_vir_ptr(self, size: int) -> int:
        ptr = ctypes.c_uint64(0)
        self._call("create_vir_ptr", "cnMemAddressReserve", ctypes.byref(ptr), size, 0, 0, 0)
        return ptr.value

    @hookimpl
    def release_vir_ptr(self, ptr: int, size: int) -> bool:
        self._call("release_vir_ptr", "cnMemAddressFree", ptr, size)
        return True

    @hookimpl
    def create_phy_mem_handle(self, size: int) -> int:
        handle = ctypes.c_uint64(0)
        self._call("create_phy_mem_handle", "cnMemCreate", ctypes.byref(handle), size, ctypes.byref(self._prop), 0)
        return handle.value

    @hookimpl
    def release_phy_mem_handle(self, handle: int) -> bool:
        self._call("release_phy_mem_handle", "cnMemRelease", handle)
        return True

    @hookimpl
    def map(self, ptr: int, size: int, handle: int) -> bool:
        self._call("map", "cnMemMap", ptr, size, 0, handle, 0)
        try:
            self._call("map", "cnMemSetAccess", ptr, size, ctypes.byref(self._access), 1)
        except Exception:
            self._call("map", "cnMemUnmap", ptr, size)  # leave nothing half-mapped
            raise
        return True

    @hookimpl
    def unmap(self, ptr: int, size: int) -> bool:
        self._call("unmap", "cnMemUnmap", ptr, size)
        return True

    # -- graphs, streams, pools (torch_mlu) ------------------------------------------

    @hookimpl
    def capabilities(self) -> frozenset[str]:
        return self.glue.capabilities if self.glue is not None else frozenset()

    @hookimpl
    def torch_device(self) -> Any:
        return self._torch("torch_device").torch_device()

    @hookimpl
    def create_stream(self) -> Any:
        return self._torch("create_stream").create_stream()

    @hookimpl
    def current_stream(self) -> Any:
        return self._torch("current_stream").current_stream()

    @hookimpl
    def use_stream(self, stream: Any) -> ContextManager[Any]:
        return self._torch("use_stream").use_stream(stream)

    @hookimpl
    def synchronize(self, stream: Any) -> bool:
        self._torch("synchronize").synchronize(stream)
        return True

    @hookimpl
    def create_pool(self, alloc: AllocFn | None, free: FreeFn | None) -> Any:
        return self._torch("create_pool").create_pool(alloc, free)

    @hookimpl
    def pool_active_blocks(self, pool: Any) -> list[tuple[int, int]]:
        return self._torch("pool_active_blocks").pool_active_blocks(pool)

    @hookimpl
    def release_pool(self, pool: Any) -> bool:
        self._torch("release_pool").release_pool(pool)
        return True

    @hookimpl
    def create_graph(self) -> Any:
        return self._torch("create_graph").create_graph()

    @hookimpl
    def capture(self, graph: Any, pool: Any, stream: Any, capture_error_mode: str) -> ContextManager[Any]:
        return self._torch("capture").capture(graph, pool, stream, capture_error_mode)

    @hookimpl
    def replay(self, graph: Any) -> bool:
        self._torch("replay").replay(graph)
        return True

    @hookimpl
    def release_graph(self, graph: Any) -> bool:
        self._torch("release_graph").release_graph(graph)
        return True

    @hookimpl
    def shutdown(self) -> bool:
        return True  # the library stays loaded (and initialised) for the process
