"""Virtual spaces and the address reservations they are carved from: a few large ones instead of one per space."""

from __future__ import annotations

import bisect
import functools
import itertools
import logging
from collections.abc import Callable, Iterator, Mapping
from types import MappingProxyType

import hal
from graphkit.memory.backing import Place
from hal.transaction import Transaction
from hal.types import fmt_bytes, round_up

log = logging.getLogger(__name__)


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


class VirtualSpace:
    """One range of an arena, its bump pointer and the chunks mapped into it.

    Only the space writes its state; owners use its verbs: :meth:`allocate` (bump), :meth:`grow` and
    :meth:`ungrow` (a chunk mapped at its end, or taken back), :meth:`swap` (another chunk at a granule),
    :meth:`seal` (trim to its use), :meth:`free` and :meth:`mark_dying` (frees counted, a release waiting
    for them). The rest reads it through read-only properties.
    """

    def __init__(self, id: int, base: int, size: int, arena: Arena) -> None:
        self.id, self.base, self.arena = id, base, arena
        self._size = size
        self._offset = 0  # bump pointer: bytes handed out so far
        self._live = 0  # allocations not freed yet
        self._dying = False  # release requested while allocations were still live
        self._sealed = False  # trimmed to its use: it cannot grow any more
        self._sealed_why = ""  # when and why it was sealed, for the out-of-memory error of a capture that outgrows it
        self._places: list[Place] = []  # place i: chunk i at base + i * granularity

    def __repr__(self) -> str:
        return (f"VirtualSpace(id={self.id}, base={self.base:#x}, size={self._size}, offset={self._offset}, "
                f"live_allocations={self._live}, dying={self._dying}, sealed={self._sealed})")

    @property
    def size(self) -> int:
        """Bytes of address space it holds (trimmed by :meth:`seal`)."""
        return self._size

    @property
    def offset(self) -> int:
        """The bump pointer: bytes handed out so far."""
        return self._offset

    @property
    def live_allocations(self) -> int:
        """Allocations handed out and not freed yet."""
        return self._live

    @property
    def dying(self) -> bool:
        """Its release was asked for while allocations were still live (:meth:`mark_dying`)."""
        return self._dying

    @property
    def sealed(self) -> bool:
        """Trimmed to its use (:meth:`seal`): it cannot grow any more."""
        return self._sealed

    @property
    def places(self) -> tuple[Place, ...]:
        """Its places: place ``i`` maps a chunk at ``base + i * granularity`` (or is a hole)."""
        return tuple(self._places)

    def place(self, index: int) -> Place:
        """Place ``index`` (below :attr:`mapped`)."""
        return self._places[index]

    @property
    def mapped(self) -> int:
        """How many chunks it reaches: chunks 0 .. mapped-1 are mapped at ``base + i * granularity`` (or holes)."""
        return len(self._places)

    @property
    def holes(self) -> set[int]:
        """Granules below :attr:`mapped` that are not mapped now (released by a pause, or a failed rollback)."""
        return {i for i, place in enumerate(self._places) if not place.mapped}

    def contains(self, ptr: int) -> bool:
        return self.base <= ptr < self.base + self._size

    # -- verbs ------------------------------------------------------------------------------

    def next_block(self, nbytes: int, alignment: int, backend: hal.Backend) -> tuple[int, int]:
        """Offsets ``(start, end)`` of the next bump allocation; out of memory when it does not fit."""
        start = round_up(self._offset, alignment)
        end = start + max(nbytes, 1)
        if end > self._size:
            why = (f"space {self.id} was sealed at {fmt_bytes(self._size)} {self._sealed_why}" if self._sealed
                   else f"the space can grow to {fmt_bytes(self._size)}; make the allocator's "
                        "reserve_bytes larger")
            raise hal.DeviceOutOfMemoryError(f"{fmt_bytes(nbytes)} at offset {fmt_bytes(start)} does not fit: "
                                             f"{why}", backend=backend.name, call="allocate")
        return start, end

    def allocate(self, nbytes: int, alignment: int, backend: hal.Backend, reach: Callable[[int], None]) -> int:
        """Bump-allocate ``nbytes``; return the address. ``reach(end)`` runs first, so that the owner maps the
        chunks up to offset ``end`` (:meth:`grow`); when it raises, nothing is handed out."""
        start, end = self.next_block(nbytes, alignment, backend)
        reach(end)
        self._offset = end
        self._live += 1
        return self.base + start

    def grow(self, place: Place) -> None:
        """``place`` (mapped by the owner) is its next granule."""
        self._places.append(place)

    def ungrow(self, place: Place) -> bool:
        """Undo of :meth:`grow`: forget ``place`` if it is the last granule; whether it was (a later granule that
        would not unmap keeps this one below it)."""
        if not self._places or self._places[-1] is not place:
            return False
        self._places.pop()
        return True

    def swap(self, index: int, place: Place) -> None:
        """``place`` (mapped by the owner) stands at granule ``index`` now, in place of :meth:`place` ``(index)``."""
        self._places[index] = place

    def seal(self, granularity: int, why: str) -> None:
        """Trim to what it used (at least one granule), giving the rest back to its arena; idempotent.

        :param why: when and why, for the error of an allocation that no longer fits ("when its capture ended").
        """
        if self._sealed:
            return
        keep = max(round_up(self._offset, granularity), granularity, self.mapped * granularity)
        self.arena.give(self.base + keep, self._size - keep)
        self._size = keep
        self._sealed, self._sealed_why = True, why

    def free(self) -> None:
        """Count one free of an allocation in it (a bump region's memory goes with the space)."""
        self._live = max(self._live - 1, 0)

    def mark_dying(self) -> bool:
        """Whether it is idle (nothing allocated in it is live); else mark it, to release once it is."""
        if self._live == 0:
            return True
        self._dying = True
        return False


class SpaceTable:
    """The spaces of one allocator and the arenas they are carved from, first fit, a new arena only when none has room.

    An arena whose last range comes back is given back to the driver (or
    kept for reuse when that fails). It counts frees against each space's
    live allocations: a space released while a tensor still used it waits,
    ``dying``, until the allocator's next operation finds it idle.

    Only it writes its spaces and arenas (:meth:`open`, :meth:`remove`, :meth:`release_all`, :meth:`forget`);
    the rest reads them through :attr:`spaces` and :attr:`arenas`.
    """

    def __init__(self, backend: hal.Backend, arena_bytes: int) -> None:
        self.backend = backend
        self.arena_bytes = arena_bytes
        self._arenas: list[Arena] = []
        self._spaces: dict[int, VirtualSpace] = {}
        self._ids = itertools.count(1)

    @property
    def spaces(self) -> Mapping[int, VirtualSpace]:
        """The live spaces by id (a read-only view)."""
        return MappingProxyType(self._spaces)

    @property
    def arenas(self) -> tuple[Arena, ...]:
        """The address reservations the spaces are carved from."""
        return tuple(self._arenas)

    @property
    def reserved_bytes(self) -> int:
        """Virtual address space held by the live spaces."""
        return sum(s.size for s in self._spaces.values())

    @property
    def arena_reserved_bytes(self) -> int:
        """Virtual address space reserved from the driver."""
        return sum(a.size for a in self._arenas)

    def get(self, space_id: int, call: str) -> VirtualSpace:
        """The live space ``space_id``; :class:`hal.InvalidStateError` for ``call`` if there is none."""
        space = self._spaces.get(space_id)
        if space is None:
            raise hal.InvalidStateError(f"space_id={space_id!r} is not a live virtual space",
                                        backend=self.backend.name, call=call)
        return space

    def containing(self, ptr: int) -> VirtualSpace | None:
        """The live space whose range holds ``ptr``."""
        return next((s for s in self._spaces.values() if s.contains(ptr)), None)

    def places(self) -> Iterator[Place]:
        """Every place of every live space."""
        for space in self._spaces.values():
            yield from space.places

    def reach(self) -> int:
        """How many chunks the live spaces reach."""
        return max((s.mapped for s in self._spaces.values()), default=0)

    def open(self, size: int) -> VirtualSpace:
        """A new space of ``size`` bytes; out of memory, saying why, when the address space ran out."""
        try:
            with Transaction() as tx:
                arena, base = self._carve(size, tx)
                tx.commit()
        except hal.DeviceOutOfMemoryError as exc:
            opened = sum(not s.sealed for s in self._spaces.values())
            raise hal.DeviceOutOfMemoryError(
                f"no address space left for a new space: {opened} space(s) are open, each keeping room to grow "
                f"to reserve_bytes={fmt_bytes(size)} until its owner seals it (a GraphPools key's space stays open "
                f"until the key is released): release the keys whose graphs are gone, or make reserve_bytes "
                f"smaller ({exc})", backend=self.backend.name, call="open_virtual_space") from exc
        space = VirtualSpace(next(self._ids), base, size, arena)
        self._spaces[space.id] = space
        return space

    def _carve(self, size: int, tx: Transaction) -> tuple[Arena, int]:
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

    def remove(self, space: VirtualSpace) -> None:
        """Forget ``space`` (unmapped) and return its range to its arena; an arena left empty goes to the driver."""
        del self._spaces[space.id]
        arena = space.arena
        arena.give(space.base, space.size)
        if not arena.empty:
            return
        try:
            self.backend.release_vir_ptr(arena.base, arena.size)
        except hal.HalError as exc:  # an empty arena is still usable: keep it
            log.warning("could not release an empty arena (kept for reuse): %s", str(exc))
            return
        self._arenas.remove(arena)

    # -- deferred release -------------------------------------------------------------------

    def free(self, ptr: int) -> None:
        """Count one free in the space holding ``ptr`` (none: it went with its space).

        A free may come from a framework's destructor at any moment (even the
        garbage collector in the middle of another operation), so it only counts.
        """
        space = self.containing(ptr)
        if space is None:
            log.debug("deallocate(%#x): not in a live space (already released with its space)", ptr)
        else:
            space.free()

    def mark_dying(self, space: VirtualSpace) -> bool:
        """Whether ``space`` is idle (nothing allocated in it is live); else mark it, to release once it is."""
        if space.mark_dying():
            return True
        log.info("space %d still has %d live allocation(s): released when they are freed",
                 space.id, space.live_allocations)
        return False

    def idle_dying(self) -> list[VirtualSpace]:
        """The spaces marked by :meth:`mark_dying` that nothing uses any more."""
        return [s for s in self._spaces.values() if s.dying and s.live_allocations == 0]

    def forget(self) -> None:
        """After a close that gave everything back: no space is left to keep."""
        self._spaces.clear()

    def release_all(self, keep: set[int], errors: list[BaseException]) -> None:
        """At close: give back every arena but those in ``keep`` (their ids); failures go to ``errors``."""
        for arena in list(self._arenas):
            if id(arena) in keep:
                continue
            try:
                self.backend.release_vir_ptr(arena.base, arena.size)
            except Exception as exc:  # noqa: BLE001 - collected; close() raises the first after the rest
                errors.append(exc)
            else:
                self._arenas.remove(arena)
