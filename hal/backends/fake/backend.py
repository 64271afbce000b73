"""The ``fake`` backend plugin: host-memory VMM with real aliasing, and graphs from the host recorder."""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
from collections.abc import Iterator
from typing import Any

from hal.api import hookimpl
from hal.errors import DeviceOutOfMemoryError, InvalidArgumentError
from hal.host import HostGraphs, HostStream, vm
from hal.transaction import Transaction
from hal.types import MemInfo, fmt_bytes

NAME = "fake"

#: ``1`` makes ``asynchronous`` the default of every fake backend (a test suite turns it on this way).
ASYNC_ENV = "HAL_FAKE_ASYNC"


#: The fake device's stream is the host recorder's.
FakeStream = HostStream

_current = threading.local()

#: the machine's device count where ``device_count`` is not given (every process started with it sees as many)
DEVICES_ENV = "HAL_FAKE_DEVICE_COUNT"


def _machine_devices() -> int:
    """``$HAL_FAKE_DEVICE_COUNT``, else 1."""
    raw = os.environ.get(DEVICES_ENV, "").strip()
    if not raw:
        return 1
    try:
        count = int(raw)
    except ValueError:
        count = 0
    if count < 1:
        raise InvalidArgumentError(f"{DEVICES_ENV}={raw!r} must be a positive int (the fake machine's device "
                                   "count)", backend=NAME, call="get_backend")
    return count


def set_device(device: int) -> None:
    """Make ``device`` the current fake device of this thread, as ``torch.cuda.set_device`` does for a GPU:
    ``hal.get_backend("fake")`` and graphkit's objects made without a backend take it."""
    if not isinstance(device, int) or isinstance(device, bool) or device < 0:
        raise InvalidArgumentError(f"device={device!r} must be a non-negative int", backend=NAME, call="set_device")
    _current.device = device


def _async_default() -> bool:
    value = os.environ.get(ASYNC_ENV, "").strip()
    if value not in ("", "0", "1"):
        raise InvalidArgumentError(f"{ASYNC_ENV}={value!r} must be 1 (asynchronous) or 0", backend=NAME,
                                   call="get_backend")
    return value == "1"


class FakeBackend(HostGraphs):
    """Host memory made to behave like a device with virtual memory management.

    Its graphs, pools and capture routing are the public host recorder's
    (:class:`hal.host.HostGraphs`), wired to :meth:`device_malloc`.

    Options:

    * ``granularity`` -- bytes per physical chunk unit (default 2 MiB; any
      multiple of the page size);
    * ``capacity`` -- total physical bytes of the simulated device (default
      16 GiB); creating past it raises :class:`hal.DeviceOutOfMemoryError`;
    * ``device_count`` -- how many simulated devices there are (default:
      ``$HAL_FAKE_DEVICE_COUNT``, else 1; the variable makes a machine of
      several devices for every process that starts with it, as ranks do);
    * ``asynchronous`` -- behave as a device that runs behind the host
      (default: on when the environment variable ``HAL_FAKE_ASYNC`` is ``1``).
      Work still runs when it is issued, but the backend keeps what queued
      work may still use until the next ``synchronize`` -- the spans of each
      graph replayed, each block a pool handed out outside a capture, each
      range given out by ``tensor_at`` -- and refuses an ``unmap`` of such a
      range with :class:`hal.UseAfterUnmapError`, unmapping nothing (a GPU
      faults there). A chunk is released only once unmapped everywhere, so
      the unmap check covers ``release_phy_mem_handle`` too. Callers wait
      first, or pass ``wait=True`` to ``unmap``/``release_phy_mem_handle``.
      A ``synchronize`` inside a capture on the same thread raises
      :class:`hal.CaptureError`, as a GPU refuses it (callers ask
      ``Backend.capturing()`` first).

    A chunk is a memfd: a fork child shares it with the parent, so the
    backend serves only the process that made it (see :class:`hal.Backend`).
    """

    @classmethod
    def current_device(cls) -> int:
        """The current fake device of this thread (:func:`set_device`; 0 until it is set)."""
        return int(getattr(_current, "device", 0))

    def __init__(self, device: int = 0, *, granularity: int = 2 << 20,
                 capacity: int = 16 << 30, device_count: int | None = None,
                 asynchronous: bool | None = None) -> None:
        def bad(arg: str, value: Any, why: str) -> InvalidArgumentError:
            return InvalidArgumentError(f"{arg}={value!r} {why}", backend=NAME, call="get_backend")

        if not isinstance(granularity, int) or granularity <= 0 or granularity % vm.PAGE_SIZE:
            raise bad("granularity", granularity, f"must be a positive multiple of the page size {vm.PAGE_SIZE}")
        if not isinstance(capacity, int) or capacity <= 0:
            raise bad("capacity", capacity, "must be a positive int of bytes")
        if device_count is None:
            device_count = _machine_devices()
        if not isinstance(device_count, int) or device_count < 1:
            raise bad("device_count", device_count, "must be >= 1")
        if device >= device_count:
            raise bad("device", device, f"is out of range: this fake has {device_count} device(s) (give "
                      f"device_count=, or set {DEVICES_ENV} for every process)")
        if asynchronous is None:
            asynchronous = _async_default()
        elif not isinstance(asynchronous, bool):
            raise bad("asynchronous", asynchronous, "must be True or False")
        self.device = device
        self._granularity = granularity
        self._capacity = capacity
        self._device_count = device_count
        self._lock = threading.Lock()
        self._used = 0
        self._chunks: dict[int, tuple[int, int]] = {}  # handle -> (fd, size)
        self._imported: set[int] = set()  # handles of chunks another backend made (not charged here)
        self._anon: dict[int, int] = {}  # own allocations: ptr -> size
        self._handle_ids = itertools.count(1)
        self._deferred = threading.local()  # per thread, inside deferred_access: the mappings still inaccessible
        #: calls that made memory accessible: one per map, or one per contiguous run of a deferred_access block
        self.access_calls = 0
        self.init_host_graphs(NAME, alloc=self.device_malloc, free=self.device_free, segment_size=granularity,
                              asynchronous=asynchronous)

    @classmethod
    def probe(cls) -> str | None:
        return vm.unavailable_reason()

    @property
    def _routers(self) -> list[Any]:
        """The ``route_captures`` blocks active now, innermost last (the host recorder's list)."""
        return self._host_routers

    # -- internal memory ---------------------------------------------------------

    def _charge(self, call: str, size: int) -> None:
        with self._lock:
            if self._used + size > self._capacity:
                raise DeviceOutOfMemoryError(
                    f"{fmt_bytes(size)} requested, {fmt_bytes(self._capacity - self._used)} free "
                    f"of capacity {fmt_bytes(self._capacity)}", backend=NAME, call=call)
            self._used += size

    def _refund(self, size: int) -> None:
        with self._lock:
            self._used -= size

    def device_malloc(self, size: int) -> int:
        """The fake device's own allocator (segments of non-custom pools); 0 when full."""
        try:
            self._charge("device_malloc", size)
        except DeviceOutOfMemoryError:
            return 0
        with Transaction() as tx:
            tx.append(lambda: self._refund(size))
            ptr = vm.alloc(size, backend=NAME)
            tx.commit()
        self._anon[ptr] = size
        return ptr

    def device_free(self, ptr: int, size: int) -> None:
        owned = self._anon.pop(ptr, None)
        if owned is None:  # freed by shutdown already (a tensor outlived its backend)
            return
        vm.free(ptr, owned, backend=NAME)
        self._refund(size)

    # -- queries ---------------------------------------------------------------------

    @hookimpl
    def device_count(self) -> int:
        return self._device_count

    @hookimpl
    def granularity(self, recommended: bool) -> int:
        return self._granularity

    @hookimpl
    def mem_info(self) -> MemInfo:
        with self._lock:
            return MemInfo(free=self._capacity - self._used, total=self._capacity)

    # -- vmm -------------------------------------------------------------------------

    @hookimpl
    def create_vir_ptr(self, size: int) -> int:
        return vm.reserve(size, self._granularity, backend=NAME)

    @hookimpl
    def release_vir_ptr(self, ptr: int, size: int) -> None:
        vm.release(ptr, size, backend=NAME)

    @hookimpl
    def create_phy_mem_handle(self, size: int) -> int:
        self._charge("create_phy_mem_handle", size)
        with Transaction() as tx:  # OSError, OverflowError and the like: nothing may stay charged
            tx.append(lambda: self._refund(size))
            fd = vm.create_chunk(size, backend=NAME)
            tx.commit()
        handle = next(self._handle_ids)
        self._chunks[handle] = (fd, size)
        return handle

    @hookimpl
    def release_phy_mem_handle(self, handle: int) -> None:
        fd, size = self._chunks[handle]
        vm.release_chunk(fd, backend=NAME)
        del self._chunks[handle]
        if handle in self._imported:
            self._imported.discard(handle)
        else:
            self._refund(size)

    @hookimpl
    def capabilities(self) -> frozenset[str]:
        """The host recorder's, and ``"memory_sharing"``: a chunk is a memfd, which another process can map."""
        return HostGraphs.capabilities(self) | {"memory_sharing"}

    @hookimpl
    def export_phy_mem_handle(self, handle: int) -> int:
        fd, _ = self._chunks[handle]
        return vm.export_chunk(fd, backend=NAME)

    @hookimpl
    def import_phy_mem_handle(self, fd: int, size: int) -> int:
        own = vm.import_chunk(fd, size, backend=NAME)
        handle = next(self._handle_ids)
        self._chunks[handle] = (own, size)
        self._imported.add(handle)
        return handle

    @hookimpl
    def map(self, ptr: int, size: int, handle: int) -> None:
        fd, chunk_size = self._chunks[handle]
        if size != chunk_size:  # the facade checks this too; real drivers refuse it
            raise InvalidArgumentError(f"size={size} differs from the chunk's {chunk_size}", backend=NAME, call="map")
        pending: list[tuple[int, int]] | None = getattr(self._deferred, "pending", None)
        vm.map_chunk(ptr, size, fd, backend=NAME, accessible=pending is None)
        if pending is None:
            self.access_calls += 1  # mapped read-write at once, as a driver's map + access
        else:
            pending.append((ptr, size))

    @hookimpl
    def unmap(self, ptr: int, size: int) -> None:
        if self.in_flight is not None:  # before anything changes: a refused unmap leaves the mapping as it was
            self.in_flight.check_unmap(ptr, size)
        vm.unmap_chunk(ptr, size, backend=NAME)
        pending: list[tuple[int, int]] | None = getattr(self._deferred, "pending", None)
        if pending is not None and (ptr, size) in pending:
            pending.remove((ptr, size))

    @hookimpl
    @contextlib.contextmanager
    def deferred_access(self) -> Iterator[None]:
        """Maps inside the block stay inaccessible (``PROT_NONE``) until it ends; then one ``mprotect`` per
        contiguous run makes them read-write, as a GPU driver's one access call for many chunks side by side."""
        if getattr(self._deferred, "pending", None) is not None:  # inside a block of this thread: join it
            yield
            return
        self._deferred.pending = []
        try:
            yield
        finally:
            pending, self._deferred.pending = self._deferred.pending, None
            runs: list[list[int]] = []  # [start, end] of each contiguous run
            for ptr, size in sorted(pending):
                if runs and ptr == runs[-1][1]:
                    runs[-1][1] += size
                else:
                    runs.append([ptr, ptr + size])
            for start, end in runs:
                vm.set_access(start, end - start, backend=NAME)
                self.access_calls += 1

    @hookimpl
    def shutdown(self) -> None:
        for ptr, size in list(self._anon.items()):
            self.device_free(ptr, size)

