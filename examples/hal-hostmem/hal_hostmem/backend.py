"""The ``hostmem`` backend: the whole hal contract over host memory.

The vmm half: a reservation is inaccessible host address space, a physical
chunk is a ``memfd``, and ``map`` puts the chunk's pages at the address, so
two mappings of one chunk really share their bytes. The OS calls come from
hal's public helper :mod:`hal.host.vm`, which also turns the OS's failures
into hal errors; a device backend calls its driver there instead, and turns
the driver's codes into hal errors in one place (docs/plugins.md, "Errors").

The graph half comes from hal's host recorder (:class:`hal.host.HostGraphs`):
wired to the device's own allocator (:meth:`HostMemBackend.device_malloc`),
it gives the ``graphs``, ``custom_pool``, ``capture_routing``, ``use_pool``,
``graph_addresses``, ``lazy_graphs`` and ``graph_update`` capabilities. A chunk is a file descriptor, so it can
be exported to another process and imported there: ``memory_sharing``.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import hal
from hal.host import HostGraphs, vm
from hal.types import MemInfo

NAME = "hostmem"


@dataclass(eq=False)  # handles compare by identity: a released handle never equals a new one
class Chunk:
    """One physical chunk: the opaque handle this backend hands out."""

    fd: int
    size: int
    imported: bool = False  # another device's chunk: its bytes are counted there, not here


class HostMemBackend(HostGraphs):
    """Host memory as a device with virtual memory management and graphs.

    Options (``hal.get_backend("hostmem", **options)``):

    * ``granularity`` -- bytes per physical allocation unit (default 64 KiB,
      a multiple of the page size);
    * ``capacity`` -- physical bytes the device pretends to have (default 1 GiB).
    """

    #: What the conformance suite may assume (see ``hal.testing.Requirements``).
    hal_requirements: ClassVar[dict[str, Any]] = {"host_accessible": True}
    #: Tried after ``fake`` (1000): installing a host device must not change what a CPU machine chooses.
    hal_priority: ClassVar[int] = 2000

    def __init__(self, device: int = 0, *, granularity: int = 64 << 10, capacity: int = 1 << 30) -> None:
        if device != 0:
            raise hal.InvalidArgumentError(f"device={device}: there is only device 0", backend=NAME,
                                           call="get_backend")
        for name, value, unit in (("granularity", granularity, vm.PAGE_SIZE), ("capacity", capacity, 1)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0 or value % unit:
                raise hal.InvalidArgumentError(f"{name}={value!r} must be an int of bytes, a positive multiple of "
                                               f"{unit}", backend=NAME, call="get_backend")
        self.granularity_bytes = granularity
        self.capacity = capacity
        self.used = 0
        self._lock = threading.Lock()
        self.init_host_graphs(NAME, alloc=self.device_malloc, free=self.device_free, segment_size=granularity)

    @classmethod
    def probe(cls) -> str | None:
        """Cheap check, run by discovery: ``None`` when usable here, else the reason."""
        return vm.unavailable_reason()

    # -- the device's own allocator, for the pools of the host recorder ---------------

    @contextlib.contextmanager
    def charged(self, size: int, call: str) -> Iterator[None]:
        """Count ``size`` bytes as used while the block allocates them; give them back if it fails.

        Pools call ``device_malloc`` and ``device_free`` from any thread: the count is under a lock.
        """
        with self._lock:
            if self.used + size > self.capacity:
                raise hal.DeviceOutOfMemoryError(f"{size} bytes requested, {self.capacity - self.used} free",
                                                 backend=NAME, call=call)
            self.used += size
        try:
            yield
        except BaseException:
            self.refund(size)
            raise

    def refund(self, size: int) -> None:
        with self._lock:
            self.used -= size

    def device_malloc(self, nbytes: int) -> int:
        """A segment of ``nbytes`` for a pool; raises ``DeviceOutOfMemoryError`` when the device is full."""
        with self.charged(nbytes, "device_malloc"):
            return vm.alloc(nbytes, backend=NAME)

    def device_free(self, ptr: int, nbytes: int) -> None:
        vm.free(ptr, nbytes, backend=NAME)
        self.refund(nbytes)

    # -- queries ------------------------------------------------------------------

    @hal.hookimpl
    def device_count(self) -> int:
        return 1

    @hal.hookimpl
    def granularity(self, recommended: bool) -> int:
        return self.granularity_bytes * (4 if recommended else 1)

    @hal.hookimpl
    def mem_info(self) -> MemInfo:
        """The configured capacity, less the chunks and pool segments allocated (graphkit measures by it)."""
        return MemInfo(free=self.capacity - self.used, total=self.capacity)

    # -- vmm: the facade has checked sizes, alignment, ranges and handles already ---

    @hal.hookimpl
    def create_vir_ptr(self, size: int) -> int:
        return vm.reserve(size, self.granularity_bytes, backend=NAME)

    @hal.hookimpl
    def release_vir_ptr(self, ptr: int, size: int) -> None:
        vm.release(ptr, size, backend=NAME)

    @hal.hookimpl
    def create_phy_mem_handle(self, size: int) -> Chunk:
        with self.charged(size, "create_phy_mem_handle"):
            return Chunk(vm.create_chunk(size, backend=NAME), size)

    @hal.hookimpl
    def release_phy_mem_handle(self, handle: Chunk) -> None:
        vm.release_chunk(handle.fd, backend=NAME)
        if not handle.imported:
            self.refund(handle.size)

    # -- memory sharing: a chunk's descriptor, passed to another process -------------

    @hal.hookimpl
    def capabilities(self) -> frozenset[str]:
        return HostGraphs.capabilities(self) | {"memory_sharing"}

    @hal.hookimpl
    def export_phy_mem_handle(self, handle: Chunk) -> int:
        return vm.export_chunk(handle.fd, backend=NAME)

    @hal.hookimpl
    def import_phy_mem_handle(self, fd: int, size: int) -> Chunk:
        return Chunk(vm.import_chunk(fd, size, backend=NAME), size, imported=True)

    @hal.hookimpl
    def map(self, ptr: int, size: int, handle: Chunk) -> None:
        vm.map_chunk(ptr, size, handle.fd, backend=NAME)

    @hal.hookimpl
    def unmap(self, ptr: int, size: int) -> None:
        vm.unmap_chunk(ptr, size, backend=NAME)
