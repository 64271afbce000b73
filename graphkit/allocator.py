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

Every multi-step operation runs in a :class:`graphkit.transaction.Transaction`:
a driver failure half-way through an allocation, a switch or a release
undoes what that call did, so the allocator stays consistent and usable and
nothing leaks. Where an undo step fails too, the record of what is mapped
stays exact (a granule that would not map back is a *hole* of its space, and
the allocator reads :attr:`~SharedVMMAllocator.paused` until
:meth:`~SharedVMMAllocator.restore_physical` maps it).
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
from graphkit.closing import Closable
from graphkit.deprecation import renamed
from graphkit.transaction import Transaction, release_or_keep, retry_releases, unmap_run
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
    arena: Arena = field(repr=False)
    offset: int = 0  # bump pointer: bytes handed out so far
    mapped: int = 0  # chunks 0 .. mapped-1 are mapped at base + i * granularity
    live_allocations: int = 0
    dying: bool = False  # release requested while allocations were still live
    sealed: bool = False  # trimmed to its use: it cannot grow any more
    holes: set[int] = field(default_factory=set, repr=False)  # granules < mapped that are not mapped now

    def contains(self, ptr: int) -> bool:
        return self.base <= ptr < self.base + self.size


class Arena:
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


class SharedVMMAllocator(Closable):
    """Bump allocator over virtual spaces that all map the same physical chunks.

    :param backend: a :class:`hal.Backend` (any vendor); the allocator only
        uses its vmm methods.
    :param reserve_bytes: how far one space can grow while it is open;
        defaults to the device's total memory (a graph can never need more),
        rounded to the granularity.
    :param max_physical_bytes: optional cap on physical bytes (beyond it,
        allocations fail with :class:`hal.DeviceOutOfMemoryError`), e.g. to
        leave room for the KV cache. ``capacity=`` is its deprecated spelling.
    :param arena_bytes: size of each address reservation spaces are carved
        from (default ``8 * reserve_bytes``).
    """

    def __init__(self, backend: hal.Backend, reserve_bytes: int | None = None,
                 max_physical_bytes: int | None = None, arena_bytes: int | None = None, *,
                 capacity: int | None = None) -> None:
        if capacity is not None:
            renamed("SharedVMMAllocator(capacity=)", "max_physical_bytes=")
            if max_physical_bytes is None:
                max_physical_bytes = capacity
        self.backend = backend
        self.granularity = g = backend.granularity
        if reserve_bytes is None:
            reserve_bytes = backend.mem_info().total
        for name, value in (("reserve_bytes", reserve_bytes), ("arena_bytes", arena_bytes),
                            ("max_physical_bytes", max_physical_bytes)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or not 0 < value < 1 << 64):
                raise hal.InvalidArgumentError(f"{name}={value!r} must be a positive int of bytes below 2**64",
                                               backend=backend.name, call="SharedVMMAllocator")
        self.reserve_bytes = round_up(reserve_bytes, g)
        self.arena_bytes = max(round_up(arena_bytes or ARENA_SPACES * self.reserve_bytes, g), self.reserve_bytes)
        self.max_physical_bytes = max_physical_bytes
        self._lock = threading.RLock()
        self._spaces: dict[int, VirtualSpace] = {}
        self._arenas: list[Arena] = []
        self._chunks: list[Any] = []  # chunk i's handle; None while released (paused)
        self._zombies: list[Any] = []  # unmapped chunks whose release failed; retried later
        self._ids = itertools.count(1)
        self.current: int | None = None
        self.map_calls = 0
        self.map_seconds = 0.0
        self.last_error: str | None = None
        self._closed = False
        self._sleeping = False  # some memory is released or unmapped: nothing may use the spaces
        self._parked: list[VirtualSpace] = []  # spaces parked over a scratch chunk by close(park_live=True)
        self.backup = False  # graph memory needs no backup: every replay writes it afresh
        self.parked_bytes = 0  # address space left over a scratch chunk at close (tensors still used it)

    # -- figures ------------------------------------------------------------------

    @property
    def physical_bytes(self) -> int:
        """Bytes of physical chunks held (mapped into the spaces that reach them)."""
        return sum(h is not None for h in self._chunks) * self.granularity

    @property
    def footprint_bytes(self) -> int:
        """Physical bytes it holds while awake (what a pause releases)."""
        return len(self._chunks) * self.granularity

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
        """Physical handles held, chunk ``i`` at offset ``i * granularity`` of every space that reaches it."""
        return [h for h in self._chunks if h is not None]

    def stats(self) -> AllocatorStats:
        with self._lock:
            return AllocatorStats(self.physical_bytes, self.reserved_bytes, self.num_virtual_spaces,
                                  self.map_calls, self.map_seconds,
                                  {i: s.offset for i, s in self._spaces.items()}, self.arena_reserved_bytes)

    def __repr__(self) -> str:
        return (f"<SharedVMMAllocator {self.backend.name} spaces={self.num_virtual_spaces} "
                f"physical={fmt_bytes(self.physical_bytes)} reserved={fmt_bytes(self.reserved_bytes)}>")

    # -- driver steps -------------------------------------------------------------------------
    # Each step records what it did the moment the driver call succeeded and appends its undo,
    # which records the undoing the same way: the bookkeeping is exact whatever fails.

    def _map_granule(self, space: VirtualSpace, index: int) -> None:
        ptr = space.base + index * self.granularity
        t0 = time.perf_counter()
        self.backend.map(ptr, self.granularity, self._chunks[index])
        self.map_seconds += time.perf_counter() - t0
        self.map_calls += 1

    def _grow_space(self, space: VirtualSpace, index: int, tx: Transaction) -> None:
        """Map chunk ``index`` at the end of ``space`` (``index == space.mapped``)."""
        self._map_granule(space, index)
        space.mapped = index + 1
        tx.append(functools.partial(self._ungrow_space, space, index))

    def _ungrow_space(self, space: VirtualSpace, index: int) -> None:
        if space.mapped != index + 1:  # a later granule would not unmap: this one stays mapped below it
            return
        self.backend.unmap(space.base + index * self.granularity, self.granularity)
        space.mapped = index

    def _unmap_space(self, space: VirtualSpace, tx: Transaction) -> None:
        """Unmap every granule mapped in ``space`` (each becomes a hole), last first; mapped back on rollback."""
        unmap_run(self.backend, space.base, self.granularity, self._chunks, tx,
                  indices=[i for i in range(space.mapped) if i not in space.holes],
                  on_unmap=space.holes.add, on_map=space.holes.discard)

    def _fill_hole(self, space: VirtualSpace, index: int) -> None:
        self._map_granule(space, index)
        space.holes.discard(index)

    def _fill_hole_step(self, space: VirtualSpace, index: int, tx: Transaction) -> None:
        self._fill_hole(space, index)
        tx.append(functools.partial(self._unmap_hole, space, index))

    def _unmap_hole(self, space: VirtualSpace, index: int) -> None:
        self.backend.unmap(space.base + index * self.granularity, self.granularity)
        space.holes.add(index)

    def _mapped_anywhere(self, index: int) -> bool:
        return any(index < s.mapped and index not in s.holes for s in self._spaces.values())

    def _has_holes(self) -> bool:
        return any(s.holes for s in self._spaces.values())

    def _ensure_chunk(self, index: int, tx: Transaction) -> None:
        """Create chunk ``index`` if it is missing (past the end, or released); released again on rollback."""
        if index < len(self._chunks) and self._chunks[index] is not None:
            return
        handle = self.backend.create_phy_mem_handle(self.granularity)
        appended = index == len(self._chunks)
        if appended:
            self._chunks.append(handle)
        else:
            self._chunks[index] = handle
        tx.append(functools.partial(self._drop_chunk, index, appended))

    def _drop_chunk(self, index: int, appended: bool) -> None:
        """Undo a chunk's creation: release it unless a mapping that would not go still uses it."""
        if self._mapped_anywhere(index):
            log.error("chunk %d is still mapped (an unmap failed): kept until it can be unmapped", index)
            return
        handle = self._chunks[index]
        if appended and index == len(self._chunks) - 1:
            self._chunks.pop()
        else:
            self._chunks[index] = None
        if handle is not None:
            release_or_keep(self.backend, handle, self._zombies)

    def _after(self, tx: Transaction) -> None:
        """A rollback that left holes makes the allocator read paused (until restore_physical maps them)."""
        if not tx.clean and self._has_holes():
            self._sleeping = True

    def _check_open(self, call: str, awake: bool = False) -> None:
        if self._closed:
            raise hal.InvalidStateError("the allocator is closed", backend=self.backend.name, call=call)
        if awake and self._sleeping:
            raise hal.InvalidStateError("the allocator's physical memory is released (paused): resume its "
                                        "MemorySaver tag, or call restore_physical(), first",
                                        backend=self.backend.name, call=call)

    # -- sleep and wake -------------------------------------------------------------------

    @property
    def paused(self) -> bool:
        """Whether any of its memory is released or unmapped: nothing of its spaces may run until it is restored.

        True from the first unmap of :meth:`release_physical` until
        :meth:`restore_physical` has mapped everything back (also after a
        failed pause whose rollback could not map everything back).
        """
        return self._sleeping

    def release_physical(self) -> int:
        """Unmap every chunk from every space and release them all; spaces keep their addresses.

        Returns the bytes released. Nothing may read or write the spaces
        (no graph of them may replay) until :meth:`restore_physical`.
        Idempotent; a driver failure half-way maps back what was unmapped
        (what will not map back stays recorded, and the allocator paused).
        A chunk whose release fails is kept and released later.
        """
        with self._lock:
            self._check_open("release_physical")
            was = self._sleeping
            self._sleeping = True  # from the first unmap on, nothing may use the spaces
            try:
                with Transaction() as tx:
                    for space in self._spaces.values():
                        self._unmap_space(space, tx)
                    tx.commit()
            except BaseException:
                self._sleeping = was or self._has_holes()
                raise
            released = 0
            for index, handle in enumerate(self._chunks):
                if handle is not None:
                    self._chunks[index] = None
                    released += self.granularity if release_or_keep(self.backend, handle, self._zombies) else 0
            retry_releases(self.backend, self._zombies)
            return released

    def restore_physical(self, restore: bool = True) -> None:
        """Create the chunks again and map them where they were: every space at the same addresses.

        Graph memory keeps no backup: ``restore`` changes nothing.

        All or nothing: a failure (out of memory, a driver fault) releases
        what this call made and leaves the allocator paused, to retry.
        """
        with self._lock:
            self._check_open("restore_physical")
            if not self._sleeping:
                return
            retry_releases(self.backend, self._zombies)
            with Transaction() as tx:
                for index in range(len(self._chunks)):
                    self._ensure_chunk(index, tx)
                for space in self._spaces.values():
                    for index in sorted(space.holes):
                        self._fill_hole_step(space, index, tx)
                tx.commit()
            self._sleeping = False

    # -- spaces -------------------------------------------------------------------------

    def _carve(self, size: int, tx: Transaction) -> tuple[Arena, int]:
        """A range of ``size`` bytes from an arena, reserving a new arena when none has room."""
        for arena in self._arenas:
            start = arena.take(size)
            if start is not None:
                tx.append(functools.partial(arena.give, start, size))
                return arena, start
        nbytes = max(self.arena_bytes, size)
        base = self.backend.create_vir_ptr(nbytes)
        arena = Arena(base, nbytes)
        self._arenas.append(arena)

        def drop() -> None:
            self.backend.release_vir_ptr(base, nbytes)
            self._arenas.remove(arena)

        tx.append(drop)
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
            retry_releases(self.backend, self._zombies)
            if self.current is not None:
                self.seal(self.current)
            with Transaction() as tx:
                arena, base = self._carve(self.reserve_bytes, tx)
                tx.commit()
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
            keep = max(round_up(space.offset, self.granularity), self.granularity, space.mapped * self.granularity)
            space.arena.give(space.base + keep, space.size - keep)
            space.size = keep
            space.sealed = True
            if self.current == space_id:
                self.current = None

    def _live_space(self, space_id: int, call: str) -> VirtualSpace:
        space = self._spaces.get(space_id)
        if space is None:
            raise hal.InvalidStateError(f"space_id={space_id!r} is not a live virtual space",
                                        backend=self.backend.name, call=call)
        return space

    def release_virtual_space(self, space_id: int) -> None:
        """Unmap and free one space; chunks no remaining space needs are released too.

        All or nothing: a failed unmap maps back what this call unmapped and
        the space stays, to release again.
        """
        with self._lock:
            self._check_open("release_virtual_space")
            space = self._live_space(space_id, "release_virtual_space")
            tx = Transaction()
            try:
                with tx:
                    self._unmap_space(space, tx)
                    tx.commit()
            finally:
                self._after(tx)
            del self._spaces[space_id]
            if self.current == space_id:
                self.current = None
            space.arena.give(space.base, space.size)
            if space.arena.empty:
                self._release_arena(space.arena)
            keep = max((s.mapped for s in self._spaces.values()), default=0)
            trimmed, self._chunks = self._chunks[keep:], self._chunks[:keep]
            self._zombies.extend(h for h in trimmed if h is not None)
            retry_releases(self.backend, self._zombies)

    def _release_arena(self, arena: Arena) -> None:
        try:
            self.backend.release_vir_ptr(arena.base, arena.size)
        except hal.HalError as exc:  # an empty arena is still usable: keep it
            log.warning("could not release an empty arena (kept for reuse): %s", str(exc))
            return
        self._arenas.remove(arena)

    @property
    def pending_release(self) -> int:
        """Chunks mapped nowhere whose release failed and will be retried."""
        return len(self._zombies)

    # -- physical memory ---------------------------------------------------------------

    @property
    def capacity(self) -> int | None:
        """Deprecated spelling of :attr:`max_physical_bytes`."""
        renamed("SharedVMMAllocator.capacity", "max_physical_bytes")
        return self.max_physical_bytes

    def _check_physical_limit(self, count: int, call: str) -> None:
        limit = self.max_physical_bytes
        if limit is not None and self.physical_bytes + count * self.granularity > limit:
            raise hal.DeviceOutOfMemoryError(
                f"{fmt_bytes(count * self.granularity)} more would exceed the allocator's max_physical_bytes "
                f"{fmt_bytes(limit)} ({fmt_bytes(self.physical_bytes)} in use)",
                backend=self.backend.name, call=call)

    def precreate(self, nbytes: int) -> None:
        """Create chunks for ``nbytes`` more physical memory (all or nothing), mapped nowhere yet.

        Spaces map them as their allocations reach them; creating them ahead
        takes the driver's allocation off the capture.
        """
        with self._lock:
            self._check_open("precreate", awake=True)
            if not isinstance(nbytes, int) or isinstance(nbytes, bool):
                raise hal.InvalidArgumentError(f"nbytes={nbytes!r} must be an int", backend=self.backend.name,
                                               call="precreate")
            count = -(-nbytes // self.granularity)
            if count <= 0:
                return
            self._check_physical_limit(count, "precreate")
            if (len(self._chunks) + count) * self.granularity > self.reserve_bytes:
                raise hal.DeviceOutOfMemoryError(
                    f"{fmt_bytes(self.physical_bytes + count * self.granularity)} would not fit in a virtual "
                    f"space of reserve_bytes={self.reserve_bytes}; make the allocator's reserve_bytes larger",
                    backend=self.backend.name, call="precreate")
            with Transaction() as tx:
                first = len(self._chunks)
                for index in range(first, first + count):
                    self._ensure_chunk(index, tx)
                tx.commit()

    def extend_mapping(self, nbytes: int) -> None:
        """Deprecated spelling of :meth:`precreate` (it creates chunks; it maps nothing)."""
        renamed("SharedVMMAllocator.extend_mapping()", "precreate()")
        self.precreate(nbytes)

    def _map_up_to(self, space: VirtualSpace, count: int) -> None:
        """Map chunks ``space.mapped .. count-1`` into ``space``, creating missing ones (all or nothing)."""
        if count <= space.mapped:
            return
        self._check_physical_limit(max(count - len(self._chunks), 0), "allocate")
        tx = Transaction()
        try:
            with tx:
                for index in range(space.mapped, count):
                    self._ensure_chunk(index, tx)
                    self._grow_space(space, index, tx)
                tx.commit()
        finally:
            self._after(tx)

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

    def _unmap_unparked(self, errors: list[BaseException]) -> None:
        """close(): unmap every mapped chunk of every space not parked; failures go to ``errors``."""
        for space in self._spaces.values():
            if space in self._parked:
                continue
            for index in range(space.mapped):
                if index in space.holes:
                    continue
                try:
                    self._unmap_hole(space, index)
                except Exception as exc:  # noqa: BLE001 - collected; close() raises the first after the rest
                    errors.append(exc)

    def _release_arenas(self, keep: set[int], errors: list[BaseException]) -> None:
        """close(): give back every arena but those in ``keep`` (ids of parked spaces' arenas)."""
        for arena in list(self._arenas):
            if id(arena) in keep:
                continue
            try:
                self.backend.release_vir_ptr(arena.base, arena.size)
            except Exception as exc:  # noqa: BLE001 - collected; close() raises the first after the rest
                errors.append(exc)
            else:
                self._arenas.remove(arena)

    def close(self, park_live: bool = False) -> None:
        """Unmap every space, free the arenas, release every chunk. Idempotent.

        Goes on past driver failures and raises the first; what failed stays
        recorded, and calling ``close()`` again finishes the job.

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
            if not self._parked:
                busy = [s for s in self._spaces.values() if s.live_allocations and s.mapped and not self._sleeping]
                if busy and not park_live:
                    log.warning("closing with allocations still live in space(s) %s: tensors still using them "
                                "must not be touched after this", [s.id for s in busy])
                if busy and park_live:
                    self._parked = self._park(busy, errors)
            self._unmap_unparked(errors)
            keep = {id(s.arena) for s in self._parked}
            self._release_arenas(keep, errors)
            for index, handle in enumerate(self._chunks):
                if handle is not None and not self._mapped_anywhere(index):
                    self._chunks[index] = None
                    self._zombies.append(handle)
            retry_releases(self.backend, self._zombies)
            self._sleeping = True  # nothing of it may run any more
            if errors or self._zombies or any(h is not None for h in self._chunks):
                first = errors[0] if errors else hal.InvalidStateError(
                    f"{len(self._zombies)} chunk(s) could not be released yet; close() again to retry",
                    backend=self.backend.name, call="close")
                log.error("allocator close: %d step(s) failed; close() again to finish: %s",
                          len(errors) or 1, str(first))
                raise first
            self._spaces.clear()
            self._arenas = [a for a in self._arenas if id(a) in keep]
            self._chunks = []
            self.current = None
            self._closed = True

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
                    if index not in space.holes:
                        self.backend.unmap(ptr, g)
                        space.holes.add(index)
                    self.backend.map(ptr, g, scratch)
                except Exception as exc:  # noqa: BLE001 - collected; close() raises the first after releasing the rest
                    errors.append(exc)
        self.parked_bytes = sum(s.size for s in busy)
        log.warning("closing with allocations still live in space(s) %s: their %s stay reserved over a scratch "
                    "chunk (reads give garbage) until the backend closes", [s.id for s in busy],
                    fmt_bytes(self.parked_bytes))
        return busy
