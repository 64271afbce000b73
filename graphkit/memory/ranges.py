"""Virtual spaces and the address reservations they are carved from: a few large ones instead of one per space."""

from __future__ import annotations

import bisect
import functools
import logging
from dataclasses import dataclass, field

import hal
from graphkit.memory.transaction import Transaction
from hal.types import fmt_bytes, round_up

log = logging.getLogger("graphkit.memory.allocator")


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
    sealed_why: str = ""  # when and why it was sealed, for the out-of-memory error of a capture that outgrows it
    holes: set[int] = field(default_factory=set, repr=False)  # granules < mapped that are not mapped now

    def contains(self, ptr: int) -> bool:
        return self.base <= ptr < self.base + self.size

    def next_block(self, nbytes: int, alignment: int, backend: hal.Backend) -> tuple[int, int]:
        """Offsets ``(start, end)`` of the next bump allocation; out of memory when it does not fit."""
        start = round_up(self.offset, alignment)
        end = start + max(nbytes, 1)
        if end > self.size:
            why = (f"space {self.id} was sealed at {fmt_bytes(self.size)} {self.sealed_why}" if self.sealed
                   else f"the space can grow to {fmt_bytes(self.size)}; make the allocator's "
                        "reserve_bytes larger")
            raise hal.DeviceOutOfMemoryError(f"{fmt_bytes(nbytes)} at offset {fmt_bytes(start)} does not fit: "
                                             f"{why}", backend=backend.name, call="allocate")
        return start, end

    def seal(self, granularity: int, why: str) -> None:
        """Trim to what it used (at least one granule), giving the rest back to its arena; idempotent.

        :param why: when and why, for the error of an allocation that no longer fits ("when its capture ended").
        """
        if self.sealed:
            return
        keep = max(round_up(self.offset, granularity), granularity, self.mapped * granularity)
        self.arena.give(self.base + keep, self.size - keep)
        self.size = keep
        self.sealed, self.sealed_why = True, why


class SpaceArenas:
    """The arenas of one allocator: ranges carved first fit, a new arena only when none has room.

    An arena whose last range comes back is given back to the driver (or
    kept for reuse when that fails).
    """

    def __init__(self, backend: hal.Backend, arena_bytes: int) -> None:
        self.backend = backend
        self.arena_bytes = arena_bytes
        self.arenas: list[Arena] = []

    def __len__(self) -> int:
        return len(self.arenas)

    @property
    def reserved_bytes(self) -> int:
        """Virtual address space reserved from the driver."""
        return sum(a.size for a in self.arenas)

    def carve(self, size: int) -> tuple[Arena, int]:
        """A range of ``size`` bytes from an arena, reserving a new arena when none has room (all or nothing)."""
        with Transaction() as tx:
            arena, start = self._carve(size, tx)
            tx.commit()
        return arena, start

    def open_space(self, space_id: int, size: int, open_spaces: int) -> VirtualSpace:
        """A new space of ``size`` bytes; out of memory, saying why, when the address space ran out.

        :param open_spaces: how many spaces are open (each keeping room to grow to ``size``), for that error.
        """
        try:
            arena, base = self.carve(size)
        except hal.DeviceOutOfMemoryError as exc:
            raise hal.DeviceOutOfMemoryError(
                f"no address space left for a new space: {open_spaces} space(s) are open, each keeping room to grow "
                f"to reserve_bytes={fmt_bytes(size)} until its owner seals it (a GraphPools key's space stays open "
                f"until the key is released): release the keys whose graphs are gone, or make reserve_bytes "
                f"smaller ({exc})", backend=self.backend.name, call="open_virtual_space") from exc
        return VirtualSpace(space_id, base, size, arena)

    def _carve(self, size: int, tx: Transaction) -> tuple[Arena, int]:
        for arena in self.arenas:
            start = arena.take(size)
            if start is not None:
                tx.append(functools.partial(arena.give, start, size))
                return arena, start
        nbytes = max(self.arena_bytes, size)
        base = self.backend.create_vir_ptr(nbytes)
        arena = Arena(base, nbytes)
        self.arenas.append(arena)

        def drop() -> None:
            self.backend.release_vir_ptr(base, nbytes)
            self.arenas.remove(arena)

        tx.append(drop)
        start = arena.take(size)
        assert start is not None
        log.debug("arena of %s at %#x", fmt_bytes(nbytes), base)
        return arena, start

    def give_back(self, arena: Arena, start: int, size: int) -> None:
        """Return a range to its arena; an arena left empty goes back to the driver."""
        arena.give(start, size)
        if not arena.empty:
            return
        try:
            self.backend.release_vir_ptr(arena.base, arena.size)
        except hal.HalError as exc:  # an empty arena is still usable: keep it
            log.warning("could not release an empty arena (kept for reuse): %s", str(exc))
            return
        self.arenas.remove(arena)

    def release_all(self, keep: set[int], errors: list[BaseException]) -> None:
        """At close: give back every arena but those in ``keep`` (their ids); failures go to ``errors``."""
        for arena in list(self.arenas):
            if id(arena) in keep:
                continue
            try:
                self.backend.release_vir_ptr(arena.base, arena.size)
            except Exception as exc:  # noqa: BLE001 - collected; close() raises the first after the rest
                errors.append(exc)
            else:
                self.arenas.remove(arena)
