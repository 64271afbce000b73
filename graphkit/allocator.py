"""SharedVMMAllocator: every capture gets a fresh virtual range, all ranges share one set of chunks.

Physical memory is a list of chunks of one granule each. Chunk ``i`` is
mapped at offset ``i * granularity`` of every space that has reached that
offset, so a graph captured in space A and a graph captured in space B use
the same physical bytes at the same offsets: N graphs cost the physical
memory of the largest one. Inside a space, allocation is a bump pointer;
freeing is a no-op (the space dies as a whole, with its graph).

Address space is cheap but finite (a CUDA process gets 128 TiB of it), so
spaces are carved out of a few large reservations ("arenas") instead of one
device-sized reservation each: a space is opened with room to grow to
``reserve_bytes``, and *sealed* when the next space opens (or on request),
which trims it to what its capture used and gives the rest back to the
arena. Chunks are mapped into a space lazily, as its bump pointer reaches
them, so a small capture after a large one costs a few map calls.

Every multi-step operation keeps an undo list: a driver failure half-way
through an allocation, a switch or a release undoes what that call did, so
the allocator stays consistent and usable and nothing leaks.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import hal
from hal.types import fmt_bytes, round_up

log = logging.getLogger("graphkit.allocator")

#: how many ``reserve_bytes`` one arena reservation holds by default
ARENA_SPACES = 8


@dataclass
class VirtualSpace:
    """One range of an arena, its bump pointer and how many chunks are mapped into it."""

    id: int
    base: int
    size: int
    arena: _Arena = field(repr=False)
    offset: int = 0  # bump pointer: bytes handed out so far
    mapped: int = 0  # chunks 0 .. mapped-1 are mapped at base + i * granularity
    live_allocations: int = 0
    dying: bool = False  # release requested while allocations were still live
    sealed: bool = False  # trimmed to its use: it cannot grow any more

    def contains(self, ptr: int) -> bool:
        return self.base <= ptr < self.base + self.size


class _Arena:
    """One reservation, handed out in ranges (first fit, neighbours coalesce)."""

    def __init__(self, base: int, size: int) -> None:
        self.base, self.size = base, size
        self.holes: list[tuple[int, int]] = [(base, size)]  # (start, size), sorted by start

    def take(self, size: int) -> int | None:
        for i, (start, hole) in enumerate(self.holes):
            if hole >= size:
                self.holes[i:i + 1] = [(start + size, hole - size)] if hole > size else []
                return start
        return None

    def give(self, start: int, size: int) -> None:
        if size <= 0:
            return
        i = bisect.bisect_left(self.holes, (start, 0))
        lo, hi = start, start + size
        if i < len(self.holes) and self.holes[i][0] == hi:  # merge with the next hole
            hi += self.holes.pop(i)[1]
        if i and self.holes[i - 1][0] + self.holes[i - 1][1] == lo:  # and the previous one
            lo = self.holes.pop(i - 1)[0]
            i -= 1
        self.holes.insert(i, (lo, hi - lo))

    @property
    def empty(self) -> bool:
        return self.holes == [(self.base, self.size)]


@dataclass
class AllocatorStats:
    """A snapshot of :class:`SharedVMMAllocator` figures."""

    physical_bytes: int
    reserved_bytes: int
    num_virtual_spaces: int
    map_calls: int
    map_seconds: float
    high_water: dict[int, int] = field(default_factory=dict)
    arena_bytes: int = 0


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
            except Exception as exc:  # noqa: BLE001 - a second failure is logged; the rest of the rollback still runs
                log.error("rollback step %r failed: %s", what, str(exc))
        self._steps.clear()


class SharedVMMAllocator:
    """Bump allocator over virtual spaces that all map the same physical chunks.

    :param backend: a :class:`hal.Backend` (any vendor); the allocator only
        uses its vmm methods.
    :param reserve_bytes: how far one space can grow while it is open;
        defaults to the device's total memory (a graph can never need more),
        rounded to the granularity.
    :param capacity: optional cap on physical bytes (beyond it, allocations
        fail with :class:`hal.DeviceOutOfMemoryError`), e.g. to leave room for
        the KV cache.
    :param arena_bytes: size of each address reservation spaces are carved
        from (default ``8 * reserve_bytes``).
    """

    def __init__(self, backend: hal.Backend, reserve_bytes: int | None = None,
                 capacity: int | None = None, arena_bytes: int | None = None) -> None:
        self.backend = backend
        self.granularity = g = backend.granularity
        if reserve_bytes is None:
            reserve_bytes = backend.mem_info().total
        for name, value in (("reserve_bytes", reserve_bytes), ("arena_bytes", arena_bytes),
                            ("capacity", capacity)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or not 0 < value < 1 << 64):
                raise hal.InvalidArgumentError(f"{name}={value!r} must be a positive int of bytes below 2**64",
                                               backend=backend.name, call="SharedVMMAllocator")
        self.reserve_bytes = round_up(reserve_bytes, g)
        self.arena_bytes = max(round_up(arena_bytes or ARENA_SPACES * self.reserve_bytes, g), self.reserve_bytes)
        self.capacity = capacity
        self._lock = threading.RLock()
        self._spaces: dict[int, VirtualSpace] = {}
        self._arenas: list[_Arena] = []
        self._chunks: list[Any] = []
        self._zombies: list[Any] = []  # unmapped chunks whose release failed; retried later
        self._ids = itertools.count(1)
        self.current: int | None = None
        self.map_calls = 0
        self.map_seconds = 0.0
        self.last_error: str | None = None
        self._closed = False
        self._paused_chunks: int | None = None  # chunk count to recreate on resume; None: awake
        self.parked_bytes = 0  # address space left over a scratch chunk at close (tensors still used it)

    # -- figures ------------------------------------------------------------------

    @property
    def physical_bytes(self) -> int:
        """Bytes of physical chunks held (mapped into the spaces that reach them)."""
        return len(self._chunks) * self.granularity

    @property
    def footprint_bytes(self) -> int:
        """Physical bytes it holds while awake (what a pause releases)."""
        return (self._paused_chunks if self._paused_chunks is not None else len(self._chunks)) * self.granularity

    @property
    def reserved_bytes(self) -> int:
        """Virtual address space held by the live spaces."""
        return sum(s.size for s in self._spaces.values())

    @property
    def arena_reserved_bytes(self) -> int:
        """Virtual address space reserved from the driver (the arenas spaces are carved from)."""
        return sum(a.size for a in self._arenas)

    @property
    def num_virtual_spaces(self) -> int:
        return len(self._spaces)

    @property
    def num_arenas(self) -> int:
        return len(self._arenas)

    @property
    def spaces(self) -> dict[int, VirtualSpace]:
        """Live spaces by id (read only)."""
        return dict(self._spaces)

    @property
    def chunks(self) -> list[Any]:
        """Physical handles, chunk ``i`` at offset ``i * granularity`` of every space that reaches it."""
        return list(self._chunks)

    def stats(self) -> AllocatorStats:
        with self._lock:
            return AllocatorStats(self.physical_bytes, self.reserved_bytes, self.num_virtual_spaces,
                                  self.map_calls, self.map_seconds,
                                  {i: s.offset for i, s in self._spaces.items()}, self.arena_reserved_bytes)

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

    def _check_open(self, call: str, awake: bool = False) -> None:
        if self._closed:
            raise hal.InvalidStateError("the allocator is closed", backend=self.backend.name, call=call)
        if awake and self._paused_chunks is not None:
            raise hal.InvalidStateError("the allocator's physical memory is released (paused): resume it first",
                                        backend=self.backend.name, call=call)

    # -- sleep and wake -------------------------------------------------------------------

    @property
    def paused(self) -> bool:
        """Whether the physical memory is released (spaces keep their addresses, nothing is mapped)."""
        return self._paused_chunks is not None

    def release_physical(self) -> int:
        """Unmap every chunk from every space and release them all; spaces keep their addresses.

        Returns the bytes released. Nothing may read or write the spaces
        (no graph of them may replay) until :meth:`restore_physical`.
        Idempotent; a driver failure half-way maps back what was unmapped.
        """
        with self._lock:
            self._check_open("release_physical")
            if self._paused_chunks is not None:
                return 0
            undo = _Undo()
            try:
                for space in self._spaces.values():
                    for index in reversed(range(space.mapped)):
                        ptr, handle = space.base + index * self.granularity, self._chunks[index]
                        self.backend.unmap(ptr, self.granularity)
                        undo.push(f"remap {ptr:#x}", functools.partial(self.backend.map, ptr, self.granularity, handle))
            except BaseException:
                undo.run()
                raise
            released = self.physical_bytes
            self._paused_chunks = len(self._chunks)
            self._zombies.extend(self._chunks)
            self._chunks = []
            self._retry_zombies()
            return released

    def restore_physical(self) -> None:
        """Create the chunks again and map them where they were: every space at the same addresses.

        All or nothing: a failure (out of memory, a driver fault) releases
        what this call made and leaves the allocator paused, to retry.
        """
        with self._lock:
            self._check_open("restore_physical")
            if self._paused_chunks is None:
                return
            undo = _Undo()
            try:
                for _ in range(self._paused_chunks):
                    self._create_chunk(undo)
                for space in self._spaces.values():
                    for index in range(space.mapped):
                        self._map(space, index, undo)
            except BaseException:
                undo.run()
                self._chunks = []
                raise
            self._paused_chunks = None

    # -- spaces -------------------------------------------------------------------------

    def _carve(self, size: int, undo: _Undo) -> tuple[_Arena, int]:
        """A range of ``size`` bytes from an arena, reserving a new arena when none has room."""
        for arena in self._arenas:
            start = arena.take(size)
            if start is not None:
                undo.push("give the range back", functools.partial(arena.give, start, size))
                return arena, start
        nbytes = max(self.arena_bytes, size)
        base = self.backend.create_vir_ptr(nbytes)
        arena = _Arena(base, nbytes)
        self._arenas.append(arena)

        def drop() -> None:
            self._arenas.remove(arena)
            self.backend.release_vir_ptr(base, nbytes)

        undo.push("release the arena", drop)
        start = arena.take(size)
        assert start is not None
        log.debug("arena of %s at %#x", fmt_bytes(nbytes), base)
        return arena, start

    def switch_to_new_virtual_space(self) -> int:
        """Seal the current space, open a new one and make it current; return its id.

        No chunk is mapped yet: chunks are mapped as allocations reach them.
        """
        with self._lock:
            self._check_open("switch_to_new_virtual_space", awake=True)
            self._reap()
            self._retry_zombies()
            if self.current is not None:
                self.seal(self.current)
            undo = _Undo()
            try:
                arena, base = self._carve(self.reserve_bytes, undo)
            except BaseException:
                undo.run()
                raise
            space = VirtualSpace(next(self._ids), base, self.reserve_bytes, arena)
            self._spaces[space.id] = space
            self.current = space.id
            log.debug("space %d at %#x", space.id, base)
            return space.id

    def seal(self, space_id: int) -> None:
        """Trim a space to what it used (at least one granule); it cannot grow afterwards.

        Called for the current space when the next one opens. Allocations
        that still fit in the sealed size keep working.
        """
        with self._lock:
            space = self._live_space(space_id, "seal")
            if space.sealed:
                return
            keep = max(round_up(space.offset, self.granularity), self.granularity)
            space.arena.give(space.base + keep, space.size - keep)
            space.size = keep
            space.sealed = True
            if self.current == space_id:
                self.current = None

    def _live_space(self, space_id: int, call: str) -> VirtualSpace:
        space = self._spaces.get(space_id)
        if space is None:
            raise hal.InvalidStateError(f"space_id={space_id} is not a live virtual space",
                                        backend=self.backend.name, call=call)
        return space

    def release_virtual_space(self, space_id: int) -> None:
        """Unmap and free one space; chunks no remaining space needs are released too."""
        with self._lock:
            self._check_open("release_virtual_space")
            space = self._live_space(space_id, "release_virtual_space")
            undo = _Undo()
            try:
                for index in reversed(range(0 if self.paused else space.mapped)):
                    ptr, handle = space.base + index * self.granularity, self._chunks[index]
                    self.backend.unmap(ptr, self.granularity)
                    undo.push(f"remap {ptr:#x}", functools.partial(self.backend.map, ptr, self.granularity, handle))
            except BaseException:
                undo.run()
                raise
            del self._spaces[space_id]
            if self.current == space_id:
                self.current = None
            space.arena.give(space.base, space.size)
            if space.arena.empty:
                self._release_arena(space.arena)
            keep = max((s.mapped for s in self._spaces.values()), default=0)
            if self._paused_chunks is not None:
                self._paused_chunks = min(self._paused_chunks, keep)
            trimmed, self._chunks = self._chunks[keep:], self._chunks[:keep]
            self._zombies.extend(trimmed)
            self._retry_zombies()

    def _release_arena(self, arena: _Arena) -> None:
        try:
            self.backend.release_vir_ptr(arena.base, arena.size)
        except hal.HalError as exc:  # an empty arena is still usable: keep it
            log.warning("could not release an empty arena (kept for reuse): %s", str(exc))
            return
        self._arenas.remove(arena)

    def _retry_zombies(self) -> None:
        """Release chunks that are mapped nowhere; keep those whose release fails for later."""
        left = []
        for handle in self._zombies:
            try:
                self.backend.release_phy_mem_handle(handle)
            except hal.HalError as exc:
                log.warning("could not release a chunk yet (will retry): %s", str(exc))
                left.append(handle)
        self._zombies = left

    @property
    def pending_release(self) -> int:
        """Chunks mapped nowhere whose release failed and will be retried."""
        return len(self._zombies)

    # -- physical memory ---------------------------------------------------------------

    def _check_capacity(self, count: int, call: str) -> None:
        if self.capacity is not None and self.physical_bytes + count * self.granularity > self.capacity:
            raise hal.DeviceOutOfMemoryError(
                f"{fmt_bytes(count * self.granularity)} more would exceed the allocator's capacity "
                f"{fmt_bytes(self.capacity)} ({fmt_bytes(self.physical_bytes)} in use)",
                backend=self.backend.name, call=call)

    def _create_chunk(self, undo: _Undo) -> None:
        handle = self.backend.create_phy_mem_handle(self.granularity)
        self._chunks.append(handle)

        def drop() -> None:
            self._chunks.remove(handle)
            try:
                self.backend.release_phy_mem_handle(handle)
            except BaseException:
                self._zombies.append(handle)  # a second fault: released later, never lost
                raise

        undo.push("release chunk", drop)

    def extend_mapping(self, nbytes: int) -> None:
        """Create chunks for ``nbytes`` more physical memory (all or nothing).

        Spaces map them as their allocations reach them; creating them ahead
        takes the driver's allocation off the capture.
        """
        with self._lock:
            self._check_open("extend_mapping", awake=True)
            count = -(-nbytes // self.granularity)
            if count <= 0:
                return
            self._check_capacity(count, "extend_mapping")
            if (len(self._chunks) + count) * self.granularity > self.reserve_bytes:
                raise hal.DeviceOutOfMemoryError(
                    f"{fmt_bytes(self.physical_bytes + count * self.granularity)} would not fit in a virtual "
                    f"space of reserve_bytes={self.reserve_bytes}; make the allocator's reserve_bytes larger",
                    backend=self.backend.name, call="extend_mapping")
            undo = _Undo()
            try:
                for _ in range(count):
                    self._create_chunk(undo)
            except BaseException:
                undo.run()
                raise

    def _map_up_to(self, space: VirtualSpace, count: int) -> None:
        """Map chunks ``space.mapped .. count-1`` into ``space``, creating missing ones (all or nothing)."""
        if count <= space.mapped:
            return
        self._check_capacity(max(count - len(self._chunks), 0), "allocate")
        undo = _Undo()
        try:
            for index in range(space.mapped, count):
                if index == len(self._chunks):
                    self._create_chunk(undo)
                self._map(space, index, undo)
        except BaseException:
            undo.run()
            raise
        space.mapped = count

    # -- allocation -------------------------------------------------------------------------

    def allocate(self, nbytes: int, alignment: int = hal.ALLOCATION_ALIGNMENT, space_id: int | None = None) -> int:
        """Bump-allocate ``nbytes`` in a space (the current one by default); return the address."""
        with self._lock:
            self._check_open("allocate", awake=True)
            sid = self.current if space_id is None else space_id
            space = self._spaces.get(sid) if sid is not None else None
            if space is None:
                raise hal.InvalidStateError(
                    "no live virtual space to allocate in; call switch_to_new_virtual_space() first"
                    if sid is None else f"space_id={sid} is not a live virtual space",
                    backend=self.backend.name, call="allocate")
            if (not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0
                    or not isinstance(alignment, int) or isinstance(alignment, bool) or alignment <= 0
                    or alignment & (alignment - 1) or alignment > self.granularity):
                raise hal.InvalidArgumentError(f"nbytes={nbytes!r}, alignment={alignment!r}: need nbytes >= 0 "
                                               f"and a power-of-two alignment up to the granularity "
                                               f"{self.granularity} (spaces are aligned to it)",
                                               backend=self.backend.name, call="allocate")
            start = round_up(space.offset, alignment)
            end = start + max(nbytes, 1)
            if end > space.size:
                why = (f"space {space.id} was sealed at {fmt_bytes(space.size)} when a newer space opened "
                       "(capture the graphs of one space one after the other)" if space.sealed
                       else f"the space can grow to {fmt_bytes(space.size)}; make the allocator's "
                            "reserve_bytes larger")
                raise hal.DeviceOutOfMemoryError(f"{fmt_bytes(nbytes)} at offset {fmt_bytes(start)} does not fit: "
                                                 f"{why}", backend=self.backend.name, call="allocate")
            self._map_up_to(space, -(-end // self.granularity))
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
                log.error("deferred release of space %d failed (will retry): %s", space.id, str(exc))

    def reap(self) -> None:
        """Release the spaces whose release waited for their last block to be freed."""
        with self._lock:
            if not self._closed:
                self._reap()

    def release_when_idle(self, space_id: int) -> bool:
        """Release a space now if nothing allocated in it is live, else when its last block is freed.

        Returns whether it was released now. A space whose memory a tensor
        still uses must not be unmapped: the next space would reuse the
        addresses under that tensor.
        """
        with self._lock:
            space = self._live_space(space_id, "release_when_idle")
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
                return self.allocate(nbytes, alignment=hal.ALLOCATION_ALIGNMENT, space_id=space_id)
            except Exception as exc:
                self.last_error = str(exc)
                log.error("graph pool allocation of %s failed: %s", fmt_bytes(nbytes), str(exc))
                raise

        def free(ptr: int, nbytes: int) -> None:
            try:
                self.deallocate(ptr)
            except Exception as exc:  # noqa: BLE001  # pragma: no cover - deallocate does not raise; a free must not raise into torch
                log.error("graph pool free failed: %s", str(exc))

        return alloc, free

    # -- teardown ---------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self, park_live: bool = False) -> None:
        """Unmap every space, free the arenas, release every chunk. Idempotent.

        :param park_live: a space that a framework tensor still uses (a view
            output kept after its graph) is *parked* instead: its range stays
            reserved and mapped to one scratch chunk, so reading the tensor
            gives garbage instead of a fault. Parked memory (one granule, and
            the ranges) is given back only by :meth:`hal.Backend.close`.
        """
        with self._lock:
            if self._closed:
                return
            errors: list[BaseException] = []
            busy = [s for s in self._spaces.values() if s.live_allocations and s.mapped and not self.paused]
            if busy and not park_live:
                log.warning("closing with allocations still live in space(s) %s: tensors still using them "
                            "must not be touched after this", [s.id for s in busy])
            parked = self._park(busy, errors) if busy and park_live else []
            for space in list(self._spaces.values()):
                if space in parked:
                    continue
                for index in range(0 if self.paused else space.mapped):
                    try:
                        self.backend.unmap(space.base + index * self.granularity, self.granularity)
                    except Exception as exc:  # noqa: BLE001 - collected; close() raises the first after releasing the rest
                        errors.append(exc)
            keep = {id(s.arena) for s in parked}
            for arena in self._arenas:
                if id(arena) in keep:
                    continue
                try:
                    self.backend.release_vir_ptr(arena.base, arena.size)
                except Exception as exc:  # noqa: BLE001 - collected; close() raises the first after releasing the rest
                    errors.append(exc)
            self._spaces.clear()
            self._arenas.clear()
            self._zombies.extend(self._chunks)
            self._chunks = []
            self._retry_zombies()
            self.current = None
            self._closed = True
            if errors or self._zombies:
                raise (errors[0] if errors else hal.InvalidStateError(
                    f"{len(self._zombies)} chunk(s) could not be released", backend=self.backend.name, call="close"))

    def _park(self, busy: list[VirtualSpace], errors: list[BaseException]) -> list[VirtualSpace]:
        """Map one scratch chunk over every granule of the busy spaces in place of the real chunks."""
        g = self.granularity
        try:
            scratch = self.backend.create_phy_mem_handle(g)
        except hal.HalError as exc:
            log.warning("closing with allocations still live in space(s) %s and no memory for a scratch chunk: "
                        "tensors still using them must not be touched after this", [s.id for s in busy])
            errors.append(exc)
            return []
        for space in busy:
            for index in range(space.mapped):
                ptr = space.base + index * g
                try:
                    self.backend.unmap(ptr, g)
                    self.backend.map(ptr, g, scratch)
                except Exception as exc:  # noqa: BLE001 - collected; close() raises the first after releasing the rest
                    errors.append(exc)
        self.parked_bytes = sum(s.size for s in busy)
        log.warning("closing with allocations still live in space(s) %s: their %s stay reserved over a scratch "
                    "chunk (reads give garbage) until the backend closes", [s.id for s in busy],
                    fmt_bytes(self.parked_bytes))
        return busy

    def __enter__(self) -> SharedVMMAllocator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
