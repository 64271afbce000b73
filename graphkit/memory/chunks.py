"""The physical chunks every virtual space of an allocator maps at the same offsets, and the steps that map them."""

from __future__ import annotations

import functools
import logging
import time
from typing import TYPE_CHECKING, Any

import hal
from graphkit.memory.phases import CAPTURE_TIMES
from graphkit.memory.sharing import ExportedRange, export_handles
from graphkit.memory.transaction import Transaction, release_or_keep, retry_releases, unmap_run
from hal.types import fmt_bytes

if TYPE_CHECKING:
    from graphkit.memory.ranges import VirtualSpace

log = logging.getLogger("graphkit.memory.allocator")


class SharedChunks:
    """Chunk ``i`` (one granule) is mapped at offset ``i * granularity`` of every space that reaches it.

    Each driver step records what it did the moment the driver call
    succeeded and appends its undo, which records the undoing the same way:
    the bookkeeping is exact whatever fails. A chunk mapped nowhere whose
    release fails waits in :attr:`pending` and is released later.

    :param spaces: the allocator's live spaces by id (the same dict, read here).
    """

    def __init__(self, backend: hal.Backend, spaces: dict[int, VirtualSpace]) -> None:
        self.backend = backend
        self.granularity = backend.granularity
        self.spaces = spaces
        self.handles: list[Any] = []  # chunk i's handle; None while released (paused)
        self.pending: list[Any] = []  # unmapped chunks whose release failed; retried later
        self.map_calls = 0
        self.map_seconds = 0.0

    # -- figures ------------------------------------------------------------------

    @property
    def physical_bytes(self) -> int:
        """Bytes of the chunks held now."""
        return sum(h is not None for h in self.handles) * self.granularity

    @property
    def held(self) -> list[Any]:
        """The handles held, in chunk order."""
        return [h for h in self.handles if h is not None]

    def mapped_anywhere(self, index: int) -> bool:
        return any(index < s.mapped and index not in s.holes for s in self.spaces.values())

    def has_holes(self) -> bool:
        return any(s.holes for s in self.spaces.values())

    def check_limit(self, count: int, limit: int | None, call: str) -> None:
        """Raise out of memory if ``count`` more chunks would pass ``limit`` bytes."""
        if limit is not None and self.physical_bytes + count * self.granularity > limit:
            raise hal.DeviceOutOfMemoryError(
                f"{fmt_bytes(count * self.granularity)} more would exceed the allocator's max_physical_bytes "
                f"{fmt_bytes(limit)} ({fmt_bytes(self.physical_bytes)} in use)",
                backend=self.backend.name, call=call)

    # -- mapping steps ------------------------------------------------------------

    def _map_granule(self, space: VirtualSpace, index: int) -> None:
        ptr = space.base + index * self.granularity
        counted = CAPTURE_TIMES.start("maps")
        t0 = time.perf_counter()
        self.backend.map(ptr, self.granularity, self.handles[index])
        self.map_seconds += time.perf_counter() - t0
        self.map_calls += 1
        CAPTURE_TIMES.stop(counted)

    def grow(self, space: VirtualSpace, index: int, tx: Transaction) -> None:
        """Map chunk ``index`` at the end of ``space`` (``index == space.mapped``)."""
        self._map_granule(space, index)
        space.mapped = index + 1
        tx.append(functools.partial(self._ungrow, space, index))

    def _ungrow(self, space: VirtualSpace, index: int) -> None:
        if space.mapped != index + 1:  # a later granule would not unmap: this one stays mapped below it
            return
        self.backend.unmap(space.base + index * self.granularity, self.granularity)
        space.mapped = index

    def map_up_to(self, space: VirtualSpace, count: int, limit: int | None, tx: Transaction) -> None:
        """Map chunks ``space.mapped .. count-1`` into ``space``, creating those missing within ``limit`` bytes."""
        self.check_limit(max(count - len(self.handles), 0), limit, "allocate")
        for index in range(space.mapped, count):
            self.ensure(index, tx)
            self.grow(space, index, tx)

    def unmap_space(self, space: VirtualSpace, tx: Transaction) -> None:
        """Unmap every granule mapped in ``space`` (each becomes a hole), last first; mapped back on rollback."""
        unmap_run(self.backend, space.base, self.granularity, self.handles, tx,
                  indices=[i for i in range(space.mapped) if i not in space.holes],
                  on_unmap=space.holes.add, on_map=space.holes.discard)

    def fill_hole(self, space: VirtualSpace, index: int, tx: Transaction) -> None:
        """Map chunk ``index`` back into the hole it left in ``space``."""
        self._map_granule(space, index)
        space.holes.discard(index)
        tx.append(functools.partial(self.unmap_hole, space, index))

    def unmap_hole(self, space: VirtualSpace, index: int) -> None:
        self.backend.unmap(space.base + index * self.granularity, self.granularity)
        space.holes.add(index)

    def unmap_spaces(self, spaces: list[VirtualSpace], errors: list[BaseException]) -> None:
        """At close: unmap every mapped granule of ``spaces``; failures go to ``errors``."""
        for space in spaces:
            for index in range(space.mapped):
                if index in space.holes:
                    continue
                try:
                    self.unmap_hole(space, index)
                except Exception as exc:  # noqa: BLE001 - collected; close() raises the first after the rest
                    errors.append(exc)

    # -- sharing ------------------------------------------------------------------

    def export(self, ptr: int, nbytes: int) -> ExportedRange:
        """The chunks behind ``[ptr, ptr + nbytes)`` of a live space, exported (see :mod:`graphkit.memory.sharing`)."""
        name = self.backend.name
        if (not isinstance(ptr, int) or isinstance(ptr, bool) or not isinstance(nbytes, int)
                or isinstance(nbytes, bool) or nbytes <= 0):
            raise hal.InvalidArgumentError(f"ptr={ptr!r}, nbytes={nbytes!r}: need an int address and nbytes > 0",
                                           backend=name, call="export")
        space = next((s for s in self.spaces.values() if s.contains(ptr)), None)
        if space is None:
            raise hal.InvalidArgumentError(f"ptr={ptr:#x} is in no live space of this allocator", backend=name,
                                           call="export")
        g = self.granularity
        first, end = (ptr - space.base) // g, -(-(ptr - space.base + nbytes) // g)
        unmapped = [i for i in range(first, end) if i >= space.mapped or i in space.holes]
        if unmapped:
            raise hal.InvalidArgumentError(
                f"[{ptr:#x}, {ptr + nbytes:#x}) reaches granule(s) {unmapped[:4]} of space {space.id}, which are not "
                f"mapped (it maps {space.mapped}): export memory its allocations reached", backend=name, call="export")
        return export_handles(self.backend, self.handles[first:end], g, ptr - space.base - first * g, nbytes)

    # -- creating and releasing ---------------------------------------------------

    def ensure(self, index: int, tx: Transaction) -> None:
        """Create chunk ``index`` if it is missing (past the end, or released); released again on rollback."""
        if index < len(self.handles) and self.handles[index] is not None:
            return
        handle = self.backend.create_phy_mem_handle(self.granularity)
        appended = index == len(self.handles)
        if appended:
            self.handles.append(handle)
        else:
            self.handles[index] = handle
        tx.append(functools.partial(self._drop, index, appended))

    def _drop(self, index: int, appended: bool) -> None:
        """Undo a chunk's creation: release it unless a mapping that would not go still uses it."""
        if self.mapped_anywhere(index):
            log.error("chunk %d is still mapped (an unmap failed): kept until it can be unmapped", index)
            return
        handle = self.handles[index]
        if appended and index == len(self.handles) - 1:
            self.handles.pop()
        else:
            self.handles[index] = None
        if handle is not None:
            release_or_keep(self.backend, handle, self.pending)

    def precreate(self, nbytes: int, limit: int | None, reserve_bytes: int) -> None:
        """Create chunks for ``nbytes`` past the last one (all or nothing), within ``limit`` and ``reserve_bytes``."""
        if not isinstance(nbytes, int) or isinstance(nbytes, bool):
            raise hal.InvalidArgumentError(f"nbytes={nbytes!r} must be an int", backend=self.backend.name,
                                           call="precreate")
        count = -(-nbytes // self.granularity)
        if count <= 0:
            return
        self.check_limit(count, limit, "precreate")
        if (len(self.handles) + count) * self.granularity > reserve_bytes:
            raise hal.DeviceOutOfMemoryError(
                f"{fmt_bytes(self.physical_bytes + count * self.granularity)} would not fit in a virtual "
                f"space of reserve_bytes={reserve_bytes}; make the allocator's reserve_bytes larger",
                backend=self.backend.name, call="precreate")
        with Transaction() as tx:
            first = len(self.handles)
            for index in range(first, first + count):
                self.ensure(index, tx)
            tx.commit()

    def retry(self) -> None:
        """Release the chunks whose release failed before."""
        retry_releases(self.backend, self.pending)

    def trim(self, keep: int) -> None:
        """Release every chunk from ``keep`` on (no space reaches them any more)."""
        trimmed, self.handles[:] = self.handles[keep:], self.handles[:keep]
        self.pending.extend(h for h in trimmed if h is not None)
        self.retry()

    def release_all(self) -> int:
        """Release every chunk (all unmapped), keeping its index; return the bytes released."""
        released = 0
        for index, handle in enumerate(self.handles):
            if handle is not None:
                self.handles[index] = None
                released += self.granularity if release_or_keep(self.backend, handle, self.pending) else 0
        self.retry()
        return released

    def release_unmapped(self, errors: list[BaseException]) -> None:
        """At close: release every chunk no space maps any more; if some are still held, say so in ``errors``.

        That error is added only when no earlier step failed (the first failure is what close raises).
        """
        for index, handle in enumerate(self.handles):
            if handle is not None and not self.mapped_anywhere(index):
                self.handles[index] = None
                self.pending.append(handle)
        self.retry()
        if not errors and (self.pending or self.held):
            errors.append(hal.InvalidStateError(f"{len(self.pending)} chunk(s) could not be released yet; "
                                                "close() again to retry", backend=self.backend.name, call="close"))
