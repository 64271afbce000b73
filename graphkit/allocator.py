"""SharedVMMAllocator: every capture gets a fresh virtual range, all ranges share one set of chunks.

Physical memory is a list of chunks of one granule each. Chunk ``i`` is
mapped at offset ``i * granularity`` of **every** live virtual space, so a
graph captured in space A and a graph captured in space B use the same
physical bytes at the same offsets: N graphs cost the physical memory of the
largest one. Inside a space, allocation is a bump pointer; freeing is a
no-op (the space dies as a whole, with its graph).

Every multi-step operation keeps an undo list: a driver failure half-way
through an extend, a switch or a release undoes what that call did, so the
allocator stays consistent and usable and nothing leaks.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import hal
from hal.types import fmt_bytes, round_up

log = logging.getLogger("graphkit.allocator")


@dataclass
class VirtualSpace:
    """One reserved range and its bump pointer."""

    id: int
    base: int
    size: int
    offset: int = 0  # bump pointer: bytes handed out so far
    live_allocations: int = 0
    dying: bool = False  # release requested while allocations were still live

    def contains(self, ptr: int) -> bool:
        return self.base <= ptr < self.base + self.size


@dataclass
class AllocatorStats:
    """A snapshot of :class:`SharedVMMAllocator` figures."""

    physical_bytes: int
    reserved_bytes: int
    num_virtual_spaces: int
    map_calls: int
    map_seconds: float
    high_water: dict[int, int] = field(default_factory=dict)


class _Undo:
    """Undo list for a multi-step driver operation (run in reverse on failure)."""

    def __init__(self) -> None:
        self._steps: list[tuple[str, Callable[[], None]]] = []

    def push(self, what: str, fn: Callable[[], None]) -> None:
        self._steps.append((what, fn))

    def run(self) -> None:
        for what, fn in reversed(self._steps):
            try:
                fn()
            except Exception as exc:  # a second failure: log it, undo the rest
                log.error("rollback step %r failed: %s", what, exc)
        self._steps.clear()


class SharedVMMAllocator:
    """Bump allocator over virtual spaces that all map the same physical chunks.

    :param backend: a :class:`hal.Backend` (any vendor); the allocator only
        uses its vmm methods.
    :param reserve_bytes: size of each virtual space; defaults to the device's
        total memory (a graph can never need more), rounded to the granularity.
    :param capacity: optional cap on physical bytes (beyond it, allocations
        fail with :class:`hal.DeviceOutOfMemoryError`), e.g. to leave room for
        the KV cache.
    """

    def __init__(self, backend: hal.Backend, reserve_bytes: int | None = None,
                 capacity: int | None = None) -> None:
        self.backend = backend
        self.granularity = g = backend.granularity
        if reserve_bytes is None:
            reserve_bytes = backend.mem_info().total
        if not isinstance(reserve_bytes, int) or reserve_bytes <= 0:
            raise hal.InvalidArgumentError(f"reserve_bytes={reserve_bytes!r} must be a positive int",
                                           backend=backend.name, call="SharedVMMAllocator")
        self.reserve_bytes = round_up(reserve_bytes, g)
        self.capacity = capacity
        self._lock = threading.RLock()
        self._spaces: dict[int, VirtualSpace] = {}
        self._chunks: list[Any] = []
        self._zombies: list[Any] = []  # unmapped chunks whose release failed; retried later
        self._ids = itertools.count(1)
        self.current: int | None = None
        self.map_calls = 0
        self.map_seconds = 0.0
        self.last_error: str | None = None
        self._closed = False

    # -- figures ------------------------------------------------------------------

    @property
    def physical_bytes(self) -> int:
        """Bytes of physical chunks mapped into every space."""
        return len(self._chunks) * self.granularity

    @property
    def reserved_bytes(self) -> int:
        """Virtual address space reserved by the live spaces."""
        return sum(s.size for s in self._spaces.values())

    @property
    def num_virtual_spaces(self) -> int:
        return len(self._spaces)

    @property
    def spaces(self) -> dict[int, VirtualSpace]:
        """Live spaces by id (read only)."""
        return dict(self._spaces)

    @property
    def chunks(self) -> list[Any]:
        """Physical handles, chunk ``i`` at offset ``i * granularity`` of every space."""
        return list(self._chunks)

    def stats(self) -> AllocatorStats:
        with self._lock:
            return AllocatorStats(self.physical_bytes, self.reserved_bytes, self.num_virtual_spaces,
                                  self.map_calls, self.map_seconds,
                                  {i: s.offset for i, s in self._spaces.items()})

    def __repr__(self) -> str:
        return (f"<SharedVMMAllocator {self.backend.name} spaces={self.num_virtual_spaces} "
                f"physical={fmt_bytes(self.physical_bytes)} reserved={fmt_bytes(self.reserved_bytes)}>")

    # -- driver steps with timing ---------------------------------------------------------

    def _map(self, space: VirtualSpace, index: int, undo: _Undo) -> None:
        ptr = space.base + index * self.granularity
        t0 = time.perf_counter()
        self.backend.map(ptr, self.granularity, self._chunks[index])
        self.map_seconds += time.perf_counter() - t0
        self.map_calls += 1
        undo.push(f"unmap {ptr:#x}", lambda: self.backend.unmap(ptr, self.granularity))

    def _unmap(self, space: VirtualSpace, index: int, undo: _Undo) -> None:
        ptr, handle = space.base + index * self.granularity, self._chunks[index]
        self.backend.unmap(ptr, self.granularity)
        undo.push(f"remap {ptr:#x}", lambda: self.backend.map(ptr, self.granularity, handle))

    def _check_open(self, call: str) -> None:
        if self._closed:
            raise hal.InvalidStateError("the allocator is closed", backend=self.backend.name, call=call)

    # -- spaces -------------------------------------------------------------------------

    def switch_to_new_virtual_space(self) -> int:
        """Reserve a new space, map every existing chunk into it, make it current; return its id."""
        with self._lock:
            self._check_open("switch_to_new_virtual_space")
            self._reap()
            self._retry_zombies()
            undo = _Undo()
            base = self.backend.create_vir_ptr(self.reserve_bytes)
            undo.push("release range", lambda: self.backend.release_vir_ptr(base, self.reserve_bytes))
            space = VirtualSpace(next(self._ids), base, self.reserve_bytes)
            try:
                for index in range(len(self._chunks)):
                    self._map(space, index, undo)
            except BaseException:
                undo.run()
                raise
            self._spaces[space.id] = space
            self.current = space.id
            log.debug("space %d at %#x: %d chunk(s) mapped", space.id, base, len(self._chunks))
            return space.id

    def release_virtual_space(self, space_id: int) -> None:
        """Unmap and free one space; chunks no remaining space needs are released too."""
        with self._lock:
            self._check_open("release_virtual_space")
            space = self._spaces.get(space_id)
            if space is None:
                raise hal.InvalidStateError(f"space_id={space_id} is not a live virtual space",
                                            backend=self.backend.name, call="release_virtual_space")
            others = [s for s in self._spaces.values() if s.id != space_id]
            keep = -(-max((s.offset for s in others), default=0) // self.granularity)
            undo = _Undo()
            try:
                for index in reversed(range(keep, len(self._chunks))):  # trim: unmap from the others
                    for other in others:
                        self._unmap(other, index, undo)
                for index in reversed(range(len(self._chunks))):
                    self._unmap(space, index, undo)
                self.backend.release_vir_ptr(space.base, space.size)
            except BaseException:
                undo.run()
                raise
            del self._spaces[space_id]
            if self.current == space_id:
                self.current = None
            trimmed, self._chunks = self._chunks[keep:], self._chunks[:keep]
            self._zombies.extend(trimmed)
            self._retry_zombies()

    def _retry_zombies(self) -> None:
        """Release chunks that are mapped nowhere; keep those whose release fails for later."""
        left = []
        for handle in self._zombies:
            try:
                self.backend.release_phy_mem_handle(handle)
            except hal.HalError as exc:
                log.warning("could not release a chunk yet (will retry): %s", exc)
                left.append(handle)
        self._zombies = left

    @property
    def pending_release(self) -> int:
        """Chunks mapped nowhere whose release failed and will be retried."""
        return len(self._zombies)

    # -- physical memory ---------------------------------------------------------------

    def extend_mapping(self, nbytes: int) -> None:
        """Create chunks for ``nbytes`` more and map each into every live space (all or nothing)."""
        with self._lock:
            self._check_open("extend_mapping")
            count = -(-nbytes // self.granularity)
            if count <= 0:
                return
            if self.capacity is not None and self.physical_bytes + count * self.granularity > self.capacity:
                raise hal.DeviceOutOfMemoryError(
                    f"{fmt_bytes(count * self.granularity)} more would exceed the allocator's capacity "
                    f"{fmt_bytes(self.capacity)} ({fmt_bytes(self.physical_bytes)} in use)",
                    backend=self.backend.name, call="extend_mapping")
            if (len(self._chunks) + count) * self.granularity > self.reserve_bytes:
                raise hal.DeviceOutOfMemoryError(
                    f"{fmt_bytes(self.physical_bytes + count * self.granularity)} would not fit in a virtual "
                    f"space of reserve_bytes={self.reserve_bytes}; make the allocator's reserve_bytes larger",
                    backend=self.backend.name, call="extend_mapping")
            undo = _Undo()
            first = len(self._chunks)
            try:
                for _ in range(count):
                    handle = self.backend.create_phy_mem_handle(self.granularity)
                    self._chunks.append(handle)
                    undo.push("release chunk", lambda h=handle: self.backend.release_phy_mem_handle(h))
                    for space in self._spaces.values():
                        self._map(space, len(self._chunks) - 1, undo)
            except BaseException:
                undo.run()
                del self._chunks[first:]
                raise

    # -- allocation -------------------------------------------------------------------------

    def allocate(self, nbytes: int, alignment: int = 512, space_id: int | None = None) -> int:
        """Bump-allocate ``nbytes`` in a space (the current one by default); return the address."""
        with self._lock:
            self._check_open("allocate")
            sid = self.current if space_id is None else space_id
            space = self._spaces.get(sid) if sid is not None else None
            if space is None:
                raise hal.InvalidStateError(
                    "no live virtual space to allocate in; call switch_to_new_virtual_space() first"
                    if sid is None else f"space_id={sid} is not a live virtual space",
                    backend=self.backend.name, call="allocate")
            if nbytes < 0 or alignment <= 0 or alignment & (alignment - 1):
                raise hal.InvalidArgumentError(f"nbytes={nbytes}, alignment={alignment}: need nbytes >= 0 "
                                               "and a power-of-two alignment",
                                               backend=self.backend.name, call="allocate")
            start = round_up(space.offset, alignment)
            end = start + max(nbytes, 1)
            if end > space.size:
                raise hal.DeviceOutOfMemoryError(
                    f"{fmt_bytes(nbytes)} at offset {fmt_bytes(start)} exceeds the virtual space of "
                    f"{fmt_bytes(space.size)}; make the allocator's reserve_bytes larger",
                    backend=self.backend.name, call="allocate")
            if end > self.physical_bytes:
                self.extend_mapping(end - self.physical_bytes)
            space.offset = end
            space.live_allocations += 1
            return space.base + start

    def deallocate(self, ptr: int) -> None:
        """Accept a free: a no-op, memory of a bump region is reclaimed with its space.

        A space whose release was deferred is released at the allocator's next
        operation after its last free: a free may come from a framework's
        destructor at any moment (even from the garbage collector in the
        middle of another operation of this allocator), so it never unmaps.
        """
        with self._lock:
            for space in self._spaces.values():
                if space.contains(ptr):
                    space.live_allocations = max(space.live_allocations - 1, 0)
                    return
        log.debug("deallocate(%#x): not in a live space (already released with its space)", ptr)

    def _reap(self) -> None:
        """Release deferred spaces that nothing uses any more."""
        for space in [s for s in self._spaces.values() if s.dying and s.live_allocations == 0]:
            try:
                self.release_virtual_space(space.id)
            except hal.HalError as exc:
                log.error("deferred release of space %d failed (will retry): %s", space.id, exc)

    def release_when_idle(self, space_id: int) -> bool:
        """Release a space now if nothing allocated in it is live, else when its last block is freed.

        Returns whether it was released now. A space whose memory a tensor
        still uses must not be unmapped: the next space would reuse the
        addresses under that tensor.
        """
        with self._lock:
            space = self._spaces.get(space_id)
            if space is None:
                raise hal.InvalidStateError(f"space_id={space_id} is not a live virtual space",
                                            backend=self.backend.name, call="release_when_idle")
            if space.live_allocations == 0:
                self.release_virtual_space(space_id)
                self._reap()
                return True
            space.dying = True
            log.info("space %d still has %d live allocation(s): released when they are freed",
                     space_id, space.live_allocations)
            return False

    def pool_callbacks(self, space_id: int) -> tuple[Callable[[int], int], Callable[[int, int], None]]:
        """``(alloc, free)`` for :meth:`hal.Backend.create_pool`, bound to one space.

        ``alloc`` raises the allocator's error (e.g. :class:`hal.DeviceOutOfMemoryError`)
        after logging it and keeping it in :attr:`last_error`; the backend's
        glue turns that into the framework's own out-of-memory error, with
        this reason attached, and never lets it reach native code.
        """

        def alloc(nbytes: int) -> int:
            try:
                return self.allocate(nbytes, alignment=512, space_id=space_id)
            except Exception as exc:
                self.last_error = str(exc)
                log.error("graph pool allocation of %s failed: %s", fmt_bytes(nbytes), exc)
                raise

        def free(ptr: int, nbytes: int) -> None:
            try:
                self.deallocate(ptr)
            except Exception as exc:  # pragma: no cover - deallocate does not raise
                log.error("graph pool free failed: %s", exc)

        return alloc, free

    # -- teardown ---------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Unmap every space, free the ranges, release every chunk. Idempotent."""
        with self._lock:
            if self._closed:
                return
            busy = {s.id: s.live_allocations for s in self._spaces.values() if s.live_allocations}
            if busy:
                log.warning("closing with allocations still live in space(s) %s: tensors still using them "
                            "must not be touched after this", busy)
            errors: list[BaseException] = []
            for space in list(self._spaces.values()):
                for index in range(len(self._chunks)):
                    try:
                        self.backend.unmap(space.base + index * self.granularity, self.granularity)
                    except Exception as exc:
                        errors.append(exc)
                try:
                    self.backend.release_vir_ptr(space.base, space.size)
                except Exception as exc:
                    errors.append(exc)
            self._spaces.clear()
            self._zombies.extend(self._chunks)
            self._chunks = []
            self._retry_zombies()
            self.current = None
            self._closed = True
            if errors or self._zombies:
                raise (errors[0] if errors else hal.InvalidStateError(
                    f"{len(self._zombies)} chunk(s) could not be released", backend=self.backend.name, call="close"))

    def __enter__(self) -> "SharedVMMAllocator":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
