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
``reserve_bytes``, and *sealed* once no more captures go into it (by its
owner; by :meth:`~SharedVMMAllocator.switch_to_new_virtual_space` for the
current space), which trims it to what its captures used and gives the rest
back to the arena. Opening a space with
:meth:`~SharedVMMAllocator.open_virtual_space` seals no other: open spaces
keep their room side by side (handles asked for up front, a capture in each
of several threads), and address space is what limits how many stay open.
Chunks are mapped into a space lazily, as its bump pointer reaches them, so
a small capture after a large one costs a few map calls.

Every multi-step operation runs in a :class:`hal.transaction.Transaction`:
a driver failure half-way through an allocation, a switch or a release
undoes what that call did, so the allocator stays consistent and usable and
nothing leaks. Where an undo step fails too, the record of what is mapped
stays exact (a granule that would not map back is a *hole* of its space, and
the allocator reads :attr:`~SharedVMMAllocator.paused` until
:meth:`~SharedVMMAllocator.restore_physical` maps it).

The allocator owns two things: its spaces (``graphkit.memory.ranges.SpaceTable``:
the spaces, the reservations they are carved from, and the frees counted
against them until a space released while in use can go) and its chunks
(``graphkit.memory.chunks.SharedChunks``: the shared chunks, the driver steps
that map them into the spaces, their pause and resume through the one
release/restore machine of ``graphkit.memory.backing``, and parking at close).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import hal
from graphkit.memory.backing import Chunk
from graphkit.memory.chunks import SharedChunks
from graphkit.memory.closing import Closable, raise_first_failure
from graphkit.memory.ranges import SpaceTable, VirtualSpace
from graphkit.memory.sharing import ExportedRange
from graphkit.memory.survivors import checked_blocks, granules_of
from hal.types import fmt_bytes, round_up

log = logging.getLogger(__name__)

#: how many ``reserve_bytes`` one arena reservation holds by default
ARENA_SPACES = 8

#: every allocator of this process not closed yet (for :func:`allocator_holding`)
_open_allocators: weakref.WeakSet[SharedVMMAllocator] = weakref.WeakSet()


def allocator_holding(ptr: int) -> SharedVMMAllocator | None:
    """The open allocator of this process whose live spaces hold address ``ptr``, or None."""
    for allocator in list(_open_allocators):
        if allocator.holds(ptr):
            return allocator
    return None


@dataclass(frozen=True)
class ChunksBehind:
    """What lies under a range of a space: where it is in the space, and the chunk of every granule it touches.

    ``shared[k]`` says whether ``chunks[k]`` is the shared chunk of granule ``first + k`` (every space of the
    allocator maps it at that offset) rather than one of the space's own (memory that outlived its capture).
    """

    offset: int  # of the range's first byte from its space's base
    first: int  # granule index of that byte
    chunks: tuple[Chunk, ...]
    shared: tuple[bool, ...]
    space: int = -1  # the space's id


def _address_sizes(backend: hal.Backend, reserve_bytes: int | None, arena_bytes: int | None,
                   max_physical_bytes: int | None) -> tuple[int, int]:
    """Check the allocator's byte sizes (each None or a positive int below 2**64); return its
    ``(reserve_bytes, arena_bytes)``, defaults filled in and rounded up to the granularity."""
    g = backend.granularity
    if reserve_bytes is None:
        reserve_bytes = backend.mem_info().total
    for name, value in (("reserve_bytes", reserve_bytes), ("arena_bytes", arena_bytes),
                        ("max_physical_bytes", max_physical_bytes)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                  or not 0 < value < 1 << 64):
            raise hal.InvalidArgumentError(f"{name}={value!r} must be a positive int of bytes below 2**64",
                                           backend=backend.name, call="SharedVMMAllocator")
    reserve_bytes = round_up(reserve_bytes, g)
    return reserve_bytes, max(round_up(arena_bytes or ARENA_SPACES * reserve_bytes, g), reserve_bytes)


def _check_allocation(backend: hal.Backend, nbytes: int, alignment: int) -> None:
    """``allocate()``'s arguments: ``nbytes >= 0`` and a power-of-two alignment up to the granularity."""
    if (not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0
            or not isinstance(alignment, int) or isinstance(alignment, bool) or alignment <= 0
            or alignment & (alignment - 1) or alignment > backend.granularity):
        raise hal.InvalidArgumentError(f"nbytes={nbytes!r}, alignment={alignment!r}: need nbytes >= 0 "
                                       f"and a power-of-two alignment up to the granularity "
                                       f"{backend.granularity} (spaces are aligned to it)",
                                       backend=backend.name, call="allocate")


def _exported_space(table: SpaceTable, ptr: int, nbytes: int) -> VirtualSpace:
    """``export()``'s arguments checked: the live space of ``table`` that holds ``ptr``."""
    name = table.backend.name
    if (not isinstance(ptr, int) or isinstance(ptr, bool) or not isinstance(nbytes, int)
            or isinstance(nbytes, bool) or nbytes <= 0):
        raise hal.InvalidArgumentError(f"ptr={ptr!r}, nbytes={nbytes!r}: need an int address and nbytes > 0",
                                       backend=name, call="export")
    space = table.containing(ptr)
    if space is None:
        raise hal.InvalidArgumentError(f"ptr={ptr:#x} is in no live space of this allocator", backend=name,
                                       call="export")
    if ptr + nbytes > space.base + space.size:  # checked before any per-granule work: nbytes may be huge
        raise hal.InvalidArgumentError(
            f"nbytes={nbytes:#x} from ptr={ptr:#x} runs past the end of space {space.id} "
            f"({space.base + space.size:#x}): export a range inside one space", backend=name, call="export")
    return space


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

    It owns its spaces (a :class:`~graphkit.memory.ranges.SpaceTable`) and its
    chunks (:class:`~graphkit.memory.chunks.SharedChunks`), and bump-allocates
    in the spaces for itself and for the pools of a backend (:meth:`pool_callbacks`).

    :param backend: a :class:`hal.Backend` (any vendor); the allocator only uses its vmm methods.
    :param reserve_bytes: how far one space can grow while it is open;
        defaults to the device's total memory (a graph can never need more),
        rounded to the granularity.
    :param max_physical_bytes: optional cap on physical bytes (beyond it,
        allocations fail with :class:`hal.DeviceOutOfMemoryError`), e.g. to
        leave room for the KV cache.
    :param arena_bytes: size of each address reservation spaces are carved
        from (default ``8 * reserve_bytes``).
    """

    def __init__(self, backend: hal.Backend, reserve_bytes: int | None = None,
                 max_physical_bytes: int | None = None, arena_bytes: int | None = None) -> None:
        if not isinstance(backend, hal.Backend):
            raise hal.InvalidArgumentError(f"backend={backend!r} must be a hal.Backend (hal.get_backend(...))",
                                           call="SharedVMMAllocator")
        self.backend = backend
        self.granularity = backend.granularity
        self.reserve_bytes, self.arena_bytes = _address_sizes(backend, reserve_bytes, arena_bytes, max_physical_bytes)
        self.max_physical_bytes = max_physical_bytes
        self._lock = threading.RLock()
        self._table = SpaceTable(backend, self.arena_bytes)
        self._chunks = SharedChunks(backend)
        self.current: int | None = None
        self._closed = False
        self.last_error: str | None = None  # why the last allocation a pool callback asked for failed (logged too)
        self.backup = False  # graph memory needs no backup: every replay writes it afresh
        self._pauses = 0
        _open_allocators.add(self)

    def stats(self) -> AllocatorStats:
        with self._lock:
            return AllocatorStats(self.physical_bytes, self.reserved_bytes, self.num_virtual_spaces,
                                  self.map_calls, self.map_seconds,
                                  {i: s.offset for i, s in self._table.spaces.items()}, self.arena_reserved_bytes)

    def __repr__(self) -> str:
        return (f"<SharedVMMAllocator {self.backend.name} spaces={self.num_virtual_spaces} "
                f"physical={fmt_bytes(self.physical_bytes)} reserved={fmt_bytes(self.reserved_bytes)}>")

    # -- figures, read from what its chunks and its spaces show (read only) ----------------------------------

    @property
    def physical_bytes(self) -> int:
        """Bytes of physical chunks held: the shared ones (mapped into the spaces that reach them) and the
        survivors' own."""
        return self._chunks.all_bytes

    @property
    def shared_bytes(self) -> int:
        """Bytes of the shared chunks held (mapped into every space that reaches them)."""
        return self._chunks.physical_bytes

    @property
    def footprint_bytes(self) -> int:
        """Physical bytes it holds while awake (what a pause releases): the chunks held or mapped somewhere."""
        return self._chunks.footprint_bytes(self._table.places())

    @property
    def survivor_bytes(self) -> int:
        """Bytes of the chunks of their own that memory outliving its capture holds (counted in physical_bytes
        too)."""
        return self._chunks.private_bytes

    @property
    def chunks(self) -> list[Any]:
        """Physical handles held, chunk ``i`` at offset ``i * granularity`` of every space that reaches it."""
        return self._chunks.held

    @property
    def pending_release(self) -> int:
        """Chunks mapped nowhere whose release failed and will be retried."""
        return len(self._chunks.pending)

    @property
    def parked_bytes(self) -> int:
        """Address space left over a scratch chunk at close (tensors still used it)."""
        return self._chunks.parked_bytes

    @property
    def reserved_bytes(self) -> int:
        """Virtual address space held by the live spaces."""
        return self._table.reserved_bytes

    @property
    def arena_reserved_bytes(self) -> int:
        """Virtual address space reserved from the driver (the arenas spaces are carved from)."""
        return self._table.arena_reserved_bytes

    @property
    def num_virtual_spaces(self) -> int:
        """Live virtual spaces."""
        return len(self._table.spaces)

    @property
    def num_arenas(self) -> int:
        """Address reservations spaces are carved from."""
        return len(self._table.arenas)

    @property
    def spaces(self) -> dict[int, VirtualSpace]:
        """Live spaces by id (read only)."""
        return dict(self._table.spaces)

    @property
    def map_calls(self) -> int:
        """Map calls made so far (each maps one chunk into one space)."""
        return self._chunks.map_calls

    @property
    def map_seconds(self) -> float:
        """Wall time those map calls took."""
        return self._chunks.map_seconds

    @property
    def paused(self) -> bool:
        """Whether any of its memory is released or unmapped (or a failed pause left a hole): nothing may run
        on it."""
        return self._chunks.paused

    def _check_open(self, call: str, awake: bool = False) -> None:
        if self._closed:
            raise hal.InvalidStateError("the allocator is closed", backend=self.backend.name, call=call)
        if awake and self._chunks.paused:
            raise hal.InvalidStateError("the allocator's physical memory is released (paused): resume its "
                                        "MemorySaver tag, or call restore_physical(), first",
                                        backend=self.backend.name, call=call)

    def release_physical(self, *, keep_backup: bool = False) -> int:
        """Unmap every chunk from every space and release them all; spaces keep their addresses (no backup to keep).

        Returns the bytes released. No graph of the spaces may replay until :meth:`restore_physical`.
        Idempotent; a driver failure half-way maps back what was unmapped (what will not map back stays
        recorded, and the allocator paused). A chunk whose release fails is kept and released later.
        """
        with self._lock:
            self._check_open("release_physical")
            awake = not self.paused
            released = self._chunks.pause(list(self._table.places()))
            self._pauses += awake
            return released

    @property
    def pauses(self) -> int:
        """How many times its memory was released (a peer that mapped its chunks before a pause needs the new
        ones after: :mod:`graphkit.memory.peers`)."""
        return self._pauses

    def restore_physical(self, restore: bool = True) -> None:
        """Create the chunks again and map them where they were: every space at the same addresses.

        Graph memory keeps no backup: ``restore`` changes nothing. All or nothing: a failure (out of
        memory, a driver fault) releases what this call made and leaves the allocator paused, to retry.
        """
        with self._lock:
            self._check_open("restore_physical")
            if self.paused:
                self._chunks.resume(self._table.places())

    def open_virtual_space(self) -> int:
        """Open a new space that can grow to ``reserve_bytes``; return its id. No chunk is mapped yet.

        Other spaces stay as they are: open ones keep their room to grow (handles asked for up front, captures
        in several threads) until their owner seals them.
        """
        with self._lock:
            self._check_open("open_virtual_space", awake=True)
            self._reap()
            self._chunks.retry()
            space = self._table.open(self.reserve_bytes)
            log.debug("space %d at %#x", space.id, space.base)
            return space.id

    def switch_to_new_virtual_space(self) -> int:
        """Seal the current space, open a new one and make it current (what :meth:`allocate` uses); return its id."""
        with self._lock:
            self._check_open("switch_to_new_virtual_space", awake=True)
            if self.current is not None:
                self.seal(self.current, "when a newer space opened (switch_to_new_virtual_space() seals the "
                                        "current one)")
            self.current = self.open_virtual_space()
            return self.current

    def seal(self, space_id: int, why: str = "on request") -> None:
        """Trim a space to its use once no more captures go into it (``why``: named by a later out-of-memory error)."""
        with self._lock:
            self._table.get(space_id, "seal").seal(self.granularity, why)
            if self.current == space_id:
                self.current = None

    def release_virtual_space(self, space_id: int) -> None:
        """Unmap and free one space; chunks no remaining space needs are released too.

        All or nothing: a failed unmap maps back what this call unmapped and the space stays, to release again.
        """
        with self._lock:
            self._check_open("release_virtual_space")
            space = self._table.get(space_id, "release_virtual_space")
            self._chunks.unmap_space(space)
            self._table.remove(space)
            if self.current == space_id:
                self.current = None
            self._chunks.trim(self._table.reach())

    def keep_private(self, space_id: int, blocks: Iterable[tuple[int, int]]) -> None:
        """Give the granules of a space under ``blocks`` (``(address, nbytes)`` still allocated after a capture)
        memory of their own, those under none back to the shared chunks (``Survivors.privatize``); a no-op
        for a space that is gone, or while paused or closed. All or nothing.

        :raises hal.InvalidArgumentError: ``blocks`` are not ``(address, nbytes)`` pairs of ints with ``nbytes >= 0``
            (a block of any size is clipped to the granules the space maps: nothing is enumerated past them)."""
        blocks = checked_blocks(blocks, self.backend.name, "keep_private")
        with self._lock:
            space = None if self._closed or self.paused else self._table.spaces.get(space_id)
            if space is not None:
                self._chunks.privatize(space, granules_of(space, blocks, self.granularity),
                                  self._table.spaces.values())

    def on_shared_chunks(self, space_id: int, blocks: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
        """Those of ``blocks`` that reach a granule on the shared chunks (another space's replay overwrites it)."""
        with self._lock:
            space = self._table.spaces.get(space_id)
            return list(blocks) if space is None else self._chunks.on_shared(space, blocks)

    @contextlib.contextmanager
    def stand_in(self, granules: Mapping[int, Iterable[int]]) -> Iterator[list[int]]:
        """Inside the block, the granules ``{space id: granule indices}`` map fresh scratch chunks at their
        addresses instead of their own; yields the scratch granules' addresses. After it each space maps its own
        chunks again, bytes untouched (``graphkit.memory.stand_in``); a granule whose own chunk would not map again
        (a fault, tried twice) keeps its scratch chunk as a chunk of its own, and the fault is raised: no scratch
        chunk is left to nobody. Holds the lock for the whole block; waits for the device before the unmaps, both
        ways."""
        with self._lock:
            self._check_open("stand_in", awake=True)
            spaces = [(self._table.get(space_id, "stand_in"), indices) for space_id, indices in granules.items()]
            with self._chunks.stand_in(spaces) as addresses:
                yield addresses

    def precreate(self, nbytes: int) -> None:
        """Create chunks for ``nbytes`` more physical memory (all or nothing), mapped nowhere yet.

        Spaces map them as their allocations reach them; creating them ahead takes the driver's
        allocation off the capture.
        """
        with self._lock:
            self._check_open("precreate", awake=True)
            self._chunks.precreate(nbytes, self.max_physical_bytes, self.reserve_bytes)

    def allocate(self, nbytes: int, alignment: int = hal.ALLOCATION_ALIGNMENT, space_id: int | None = None) -> int:
        """Bump-allocate ``nbytes`` in a space (the current one by default); return the address."""
        with self._lock:
            self._check_open("allocate", awake=True)
            sid = self.current if space_id is None else space_id
            if sid is None:
                raise hal.InvalidStateError("no live virtual space to allocate in; call switch_to_new_virtual_space() "
                                            "first", backend=self.backend.name, call="allocate")
            space = self._table.get(sid, "allocate")
            _check_allocation(self.backend, nbytes, alignment)
            return space.allocate(nbytes, alignment, self.backend, lambda end: self._chunks.map_up_to(
                space, -(-end // self.granularity), self.max_physical_bytes))

    def deallocate(self, ptr: int) -> None:
        """Accept a free: it only counts (a bump region's memory goes with its space), so it may come at any moment."""
        with self._lock:
            self._table.free(ptr)

    def reap(self) -> None:
        """Release the spaces whose release waited for their last block to be freed."""
        with self._lock:
            if not self._closed:
                self._reap()

    def _reap(self) -> None:
        for space in self._table.idle_dying():
            try:
                self.release_virtual_space(space.id)
            except hal.HalError as exc:
                log.error("deferred release of space %d failed (will retry): %s", space.id, str(exc))

    def release_when_idle(self, space_id: int) -> bool:
        """Release a space now if nothing allocated in it is live, else when its last block is freed.

        Returns whether it was released now. A space whose memory a tensor still uses must not be
        unmapped: the next space would reuse the addresses under that tensor.
        """
        with self._lock:
            if not self._table.mark_dying(self._table.get(space_id, "release_when_idle")):
                return False
            self.release_virtual_space(space_id)
            self._reap()
            return True

    def pool_callbacks(self, space_id: int) -> tuple[Callable[[int], int], Callable[[int, int], None]]:
        """``(alloc, free)`` for :meth:`hal.Backend.create_pool`, bound to one space. ``free`` never raises;
        ``alloc`` raises the allocator's error after keeping it in :attr:`last_error` (the backend's glue turns
        it into the framework's out-of-memory error, this reason attached, never letting it reach native code)."""

        def alloc(nbytes: int) -> int:
            try:
                return self.allocate(nbytes, hal.ALLOCATION_ALIGNMENT, space_id)
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

    def export(self, ptr: int, nbytes: int) -> ExportedRange:
        """The chunks behind ``[ptr, ptr + nbytes)`` of a live space, for another process
        (:mod:`graphkit.memory.sharing`)."""
        with self._lock:
            self._check_open("export", awake=True)
            return self._chunks.export(_exported_space(self._table, ptr, nbytes), ptr, nbytes)

    def holds(self, ptr: int) -> bool:
        """Whether ``ptr`` lies in one of its live spaces."""
        with self._lock:
            return not self._closed and self._table.containing(ptr) is not None

    def chunks_behind(self, ptr: int, nbytes: int, *, pin: bool = False) -> ChunksBehind:
        """The chunks under ``[ptr, ptr + nbytes)`` of a live space, granule by granule (:class:`ChunksBehind`).

        :param pin: keep them there from now on (another process maps them): no survivor of this space or another
            moves them until :meth:`unpin`; a survivor of another space on the same granule gets a copy instead.
        """
        with self._lock:
            self._check_open("chunks_behind", awake=True)
            space = _exported_space(self._table, ptr, nbytes)
            first, chunks = self._chunks.behind(space, ptr, nbytes)
            if pin:
                self._chunks.pin(space, range(first, first + len(chunks)))
            return ChunksBehind(ptr - space.base, first, tuple(c for c, _ in chunks), tuple(s for _, s in chunks),
                                space.id)

    def unpin(self, behind: ChunksBehind) -> None:
        """One pin fewer on the granules of ``behind`` (from :meth:`chunks_behind` with ``pin``); a gone space is
        ignored."""
        with self._lock:
            if not self._closed:
                self._chunks.unpin(behind.space, range(behind.first, behind.first + len(behind.chunks)))

    def export_chunk(self, chunk: Chunk) -> int:
        """A file descriptor of ``chunk``'s physical memory as it is now (after a resume: the new memory); the
        caller closes it. Refused while the allocator is paused."""
        with self._lock:
            self._check_open("export_chunk", awake=True)
            return self._chunks.export_chunk(chunk)

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self, park_live: bool = False) -> None:
        """Unmap every space, free the arenas, release every chunk. Idempotent.

        Goes on past driver failures and raises the first; what failed stays recorded, and calling
        ``close()`` again finishes the job. After the backend's close it only forgets (nothing is left).

        :param park_live: a space that a framework tensor still uses (a view output kept after its
            graph) is *parked* instead: its range stays reserved and mapped to one scratch chunk, so
            reading the tensor gives garbage instead of a fault. Parked memory (one granule, and the
            ranges) is given back only by :meth:`hal.Backend.close`.
        """
        with self._lock:
            if self._closed:
                return
            errors: list[BaseException] = []
            if not self.backend.closed:  # else the backend's close released every mapping, range and chunk
                parked = self._chunks.unmap_at_close(list(self._table.spaces.values()), park_live, errors)
                self._table.release_all(parked, errors)
                self._chunks.release_at_close(errors)
            self._chunks.stop()  # nothing of it may run any more
            raise_first_failure(log, errors, "allocator close")
            self._table.forget()
            self._chunks.forget()
            self.current = None
            self._closed = True
            _open_allocators.discard(self)
