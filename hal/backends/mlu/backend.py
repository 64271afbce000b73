"""The ``mlu`` backend plugin: CNDrv VMM through ctypes, graphs through torch_mlu."""

from __future__ import annotations

import ctypes
import functools
import logging
import threading
from typing import Any, ClassVar

from hal.api import hookimpl
from hal.backends._native.hooks import ExtensionHooks
from hal.backends._native.torch_glue import TorchGlue
from hal.backends._native.vmm import map_with_access
from hal.backends.mlu import lib, locate

log = logging.getLogger("hal.mlu")
NAME = lib.NAME


def _mlu_glue(device: int) -> TorchGlue:
    from hal.backends.mlu.torch_glue import MluGlue

    return MluGlue(device)  # torch_mlu makes the device's context current


class MluBackend(ExtensionHooks):
    """Cambricon MLUs through libcndrv (VMM) and torch_mlu (graphs, streams).

    Options:

    * ``library`` -- path of libcndrv.so (a driver or a simulator); default
      ``$HAL_MLU_LIBRARY``, else ``$NEUWARE_HOME/lib64/libcndrv.so``, else the
      soname on the loader path;
    * ``use_torch`` -- ``None`` (default): use torch_mlu when it is installed;
      ``False``: VMM hooks only, torch_mlu is never imported; ``True``: require it.

    ``cnInit(0)`` runs once per library and process, when the backend opens
    (never when it is probed). ``cnMemGetInfo`` and the VMM calls need a current
    CNDrv context: on each thread, before its first call, the backend keeps the
    one that is current; where none is, it asks torch_mlu to make its device
    current, and failing that binds a context of its own (``cnDeviceGet`` +
    ``cnCtxCreate`` once per device and process, then ``cnCtxSetCurrent``).
    Every map is followed by ``cnMemSetAccess`` (read-write is flag 0); a failed
    SetAccess unmaps again. Captures use the mode the caller passes,
    ``"relaxed"`` (torch_mlu's default) when it passes none. ``"custom_pool"``
    and ``"use_pool"`` need a torch_mlu with ``MemPool`` and expandable segments off.
    """

    #: device memory is not host-accessible; the conformance suite over a
    #: simulator overrides this with ``--hal-option host_accessible=true``
    hal_requirements: ClassVar[dict[str, Any]] = {"host_accessible": False}
    backend_name = NAME
    torch_extension = locate.EXTENSION
    torch_device_type = "mlu"
    count_devices = ("cnDeviceGetCount", ctypes.c_int)
    read_mem_info = ("cnMemGetInfo", (), ctypes.c_uint64)

    def __init__(self, device: int = 0, *, library: str | None = None, use_torch: bool | None = None) -> None:
        self.device = device
        self.library = locate.open_library(library)
        self.glue = self._open_glue(use_torch, locate.extension_installed, lambda: _mlu_glue(device))
        self.library.init_once()
        self._thread = threading.local()  # CNDrv binds a context per thread: made sure of once in each
        self.made_context = False  # whether a context of the backend's own was bound on some thread
        self._prop = lib.allocation_prop(device)
        self._access = lib.access_desc(device)
        self._granularity = {rec: self._query_granularity(rec) for rec in (False, True)}
        log.debug("%s: device %d over %s (torch_mlu: %s)", NAME, device, self.library.path,
                  self.glue is not None)

    @classmethod
    def probe(cls) -> str | None:
        return locate.probe_reason()

    def _call(self, call: str, native: str, *args: Any) -> None:
        if not getattr(self._thread, "has_context", False):
            self._bind_context(call)
        self.library.call(call, native, *args)

    def _bind_context(self, call: str) -> None:
        """Make sure a CNDrv context is current on this thread (see the class docstring)."""
        cndrv = self.library
        if not cndrv.current_context(call) and self.glue is not None:
            self.glue.ns.set_device(self.device)  # torch_mlu binds the device's context
        if not cndrv.current_context(call):
            cndrv.call(call, "cnCtxSetCurrent", cndrv.own_context(self.device, call))
            self.made_context = True
            log.debug("%s: bound a context of its own for device %d on thread %s", NAME, self.device,
                      threading.current_thread().name)
        self._thread.has_context = True

    def _query_granularity(self, recommended: bool) -> int:
        gran = ctypes.c_uint64(0)
        option = lib.CN_MEM_ALLOC_GRANULARITY_RECOMMENDED if recommended else lib.CN_MEM_ALLOC_GRANULARITY_MINIMUM
        # CNDrv puts the output first: (&granularity, prop, option)
        self._call("granularity", "cnMemGetAllocationGranularity", ctypes.byref(gran), ctypes.byref(self._prop),
                   option)
        return gran.value

    # -- queries: device_count, mem_info and granularity are ExtensionHooks' over the two names above

    # -- vmm -------------------------------------------------------------------------

    @hookimpl
    def create_vir_ptr(self, size: int) -> int:
        ptr = ctypes.c_uint64(0)
        self._call("create_vir_ptr", "cnMemAddressReserve", ctypes.byref(ptr), size, 0, 0, 0)
        return ptr.value

    @hookimpl
    def release_vir_ptr(self, ptr: int, size: int) -> None:
        self._call("release_vir_ptr", "cnMemAddressFree", ptr, size)

    @hookimpl
    def create_phy_mem_handle(self, size: int) -> int:
        handle = ctypes.c_uint64(0)
        self._call("create_phy_mem_handle", "cnMemCreate", ctypes.byref(handle), size, ctypes.byref(self._prop), 0)
        return handle.value

    @hookimpl
    def release_phy_mem_handle(self, handle: int) -> None:
        self._call("release_phy_mem_handle", "cnMemRelease", handle)

    @hookimpl
    def map(self, ptr: int, size: int, handle: int) -> None:
        call = functools.partial(self._call, "map")
        map_with_access(lambda: call("cnMemMap", ptr, size, 0, handle, 0),
                        lambda: call("cnMemSetAccess", ptr, size, ctypes.byref(self._access), 1),
                        lambda: call("cnMemUnmap", ptr, size), backend=NAME, ptr=ptr, access_call="cnMemSetAccess")

    @hookimpl
    def unmap(self, ptr: int, size: int) -> None:
        self._call("unmap", "cnMemUnmap", ptr, size)

    # -- graphs, streams, pools, use_pool, shutdown: inherited from ExtensionHooks, over torch_mlu when it is there
