"""The physical chunks every virtual space of an allocator maps at the same offsets, and the steps that map them."""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import hal
from graphkit.memory.backing import Backing, Chunk, Place
from graphkit.memory.sharing import ExportedRange, export_handles
from graphkit.memory.stand_in import standing_in
from graphkit.memory.survivors import Survivors
from hal.transaction import Transaction
from hal.types import fmt_bytes

if TYPE_CHECKING:
    from graphkit.memory.ranges import VirtualSpace

log = logging.getLogger(__name__)


class SharedChunks:
    """Chunk ``i`` (one granule) is mapped at offset ``i * granularity`` of every space that reaches it.

    Each driver step records what it did the moment the driver call succeeded and appends its undo, which records
    the undoing the same way: the bookkeeping is exact whatever fails. Its :class:`Backing` keeps the chunks whose
    release failed (pending, released later) and whether a rollback left a hole; it also pauses and resumes them
    all at once. At close, spaces a tensor still uses may be *parked* over one scratch chunk.

    Only it writes its records (the chunk list, the parked spaces, its backing's state, its survivors): the
    allocator and :class:`~graphkit.memory.survivors.Survivors` use its verbs (:meth:`adopt`: a chunk at an index).
    """

    def __init__(self, backend: hal.Backend) -> None:
        self.backend = backend
        self.granularity = backend.granularity
        self._backing = Backing(backend, counted=True)
        self._chunks: list[Chunk] = []  # chunk i; its handle is None while released (paused)
        self._parked: list[VirtualSpace] = []  # spaces parked by close(park_live=True)
        self._parked_bytes = 0  # address space left over the scratch chunk
        self._survivors = Survivors(backend, self._backing, self)  # chunks of their own under survivors

    # -- figures ------------------------------------------------------------------

    @property
    def paused(self) -> bool:
        """Whether any chunk is released or unmapped (or a rollback left a hole)."""
        return self._backing.paused

    @property
    def pending(self) -> list[Any]:
        """Chunks mapped nowhere whose release failed, to release again."""
        return self._backing.pending

    @property
    def map_calls(self) -> int:
        """Map calls made so far (each maps one chunk into one space)."""
        return self._backing.map_calls

    @property
    def map_seconds(self) -> float:
        """Wall time those map calls took."""
        return self._backing.map_seconds

    @property
    def parked_bytes(self) -> int:
        """Address space left over a scratch chunk at close (tensors still used it)."""
        return self._parked_bytes

    @property
    def count(self) -> int:
        """How many shared chunks it has (held or released)."""
        return len(self._chunks)

    def chunk(self, index: int) -> Chunk:
        """Shared chunk ``index`` (below :attr:`count`)."""
        return self._chunks[index]

    @property
    def physical_bytes(self) -> int:
        """Bytes of the chunks held now."""
        return sum(c.handle is not None for c in self._chunks) * self.granularity

    @property
    def held(self) -> list[Any]:
        """The handles held, in chunk order."""
        return [c.handle for c in self._chunks if c.handle is not None]

    @property
    def private_bytes(self) -> int:
        """Bytes of the chunks of their own that survivors of captures hold now."""
        return self._survivors.held_bytes

    @property
    def all_bytes(self) -> int:
        """Bytes of the shared chunks and the private ones held now."""
        return self.physical_bytes + self.private_bytes

    def all_chunks(self) -> list[Chunk]:
        """The shared chunks, then the private ones."""
        return [*self._chunks, *self._survivors.chunks()]

    def footprint_bytes(self, places: Iterable[Place]) -> int:
        """Bytes held while awake (what a pause releases): the chunks held, or mapped at one of ``places``."""
        mapped = {id(p.chunk) for p in places}
        return sum(c.size for c in self.all_chunks() if c.handle is not None or id(c) in mapped)

    def check_limit(self, count: int, limit: int | None, call: str) -> None:
        """Raise out of memory if ``count`` more chunks would pass ``limit`` bytes."""
        if limit is not None and self.physical_bytes + count * self.granularity > limit:
            raise hal.DeviceOutOfMemoryError(
                f"{fmt_bytes(count * self.granularity)} more would exceed the allocator's max_physical_bytes "
                f"{fmt_bytes(limit)} ({fmt_bytes(self.physical_bytes)} in use)",
                backend=self.backend.name, call=call)

    # -- mapping steps ------------------------------------------------------------

    def map_up_to(self, space: VirtualSpace, count: int, limit: int | None) -> None:
        """Map chunks ``space.mapped .. count-1`` into ``space``, creating those missing within ``limit`` bytes
        (all or nothing); nothing when it maps them already."""
        if count <= space.mapped:
            return
        self.check_limit(max(count - len(self._chunks), 0), limit, "allocate")
        with Transaction() as tx:
            with self.backend.deferred_access():  # access set once for the granules side by side
                for index in range(space.mapped, count):
                    self._ensure(index, tx)
                    place = Place(space.base + index * self.granularity, self._chunks[index])
                    self._backing.map(place)
                    space.grow(place)
                    tx.append(functools.partial(self._ungrow, space, place))
            tx.commit()

    def _ungrow(self, space: VirtualSpace, place: Place) -> None:
        if space.place(space.mapped - 1) is not place:  # a later granule would not unmap: this one stays below it
            return
        self._backing.unmap(place)
        space.ungrow(place)

    def unmap_space(self, space: VirtualSpace) -> None:
        """Unmap every granule mapped in ``space`` (each becomes a hole), last first (all or nothing), after the
        device's queued work; then release the chunks ``space`` alone mapped (its survivors')."""
        with self._backing.ordered(), Transaction() as tx:
            for place in reversed(space.places):
                if place.mapped:
                    self._backing.unmap(place, tx)
            tx.commit()
        self._survivors.drop(space)

    # -- survivors ------------------------------------------------------------------

    def adopt(self, index: int, chunk: Chunk, tx: Transaction) -> None:
        """Chunk ``index`` is ``chunk`` from now on (mapped by the spaces that reach it from then on); the one it
        replaces is chunk ``index`` again on rollback of ``tx``."""
        tx.append(functools.partial(self._chunks.__setitem__, index, self._chunks[index]))
        self._chunks[index] = chunk

    def privatize(self, space: VirtualSpace, wanted: set[int], spaces: Iterable[VirtualSpace]) -> None:
        """``space`` alone maps the granules ``wanted`` (see :meth:`Survivors.privatize`); all or nothing."""
        self._survivors.privatize(space, wanted, spaces)

    def on_shared(self, space: VirtualSpace, blocks: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
        """Those of ``blocks`` that reach a granule of ``space`` mapped to a shared chunk."""
        return self._survivors.on_shared(space, blocks)

    @contextlib.contextmanager
    def stand_in(self, spaces: list[tuple[VirtualSpace, Iterable[int]]]) -> Iterator[list[int]]:
        """Scratch chunks at the granules ``spaces`` name for the block (:func:`~graphkit.memory.stand_in.
        standing_in`); a granule whose own chunk would not map again keeps its scratch chunk as a survivor's."""
        with standing_in(self._backing, spaces, self._survivors.keep) as addresses:
            yield addresses

    # -- sharing ------------------------------------------------------------------

    def export(self, space: VirtualSpace, ptr: int, nbytes: int) -> ExportedRange:
        """The chunks behind ``[ptr, ptr + nbytes)`` of ``space``, exported (see :mod:`graphkit.memory.sharing`)."""
        g = self.granularity
        first, end = self._reached(space, ptr, nbytes, "export")
        return export_handles(self.backend, [space.place(i).chunk.handle for i in range(first, end)], g,
                              ptr - space.base - first * g, nbytes)

    def behind(self, space: VirtualSpace, ptr: int, nbytes: int) -> tuple[int, list[tuple[Chunk, bool]]]:
        """The first granule of ``[ptr, ptr + nbytes)`` in ``space`` and, granule by granule, the chunk mapped
        there and whether it is the shared chunk of that index (every space maps it there) or the space's own."""
        first, end = self._reached(space, ptr, nbytes, "behind")
        places = [space.place(i).chunk for i in range(first, end)]
        return first, [(chunk, i < len(self._chunks) and chunk is self._chunks[i])
                       for i, chunk in enumerate(places, first)]

    def pin(self, space: VirtualSpace, granules: range) -> None:
        """Keep the chunks ``space`` maps at ``granules`` where they are (see ``Survivors.pin``)."""
        self._survivors.pin(space, granules)

    def unpin(self, space_id: int, granules: range) -> None:
        """One pin fewer on ``granules`` of space ``space_id``."""
        self._survivors.unpin(space_id, granules)

    def export_chunk(self, chunk: Chunk) -> int:
        """A file descriptor of ``chunk``'s physical memory as it is now (the caller's to close)."""
        if chunk.handle is None:
            raise hal.InvalidStateError("the chunk is released (paused)", backend=self.backend.name,
                                        call="export_chunk")
        return self.backend.export_phy_mem_handle(chunk.handle)

    def _reached(self, space: VirtualSpace, ptr: int, nbytes: int, call: str) -> tuple[int, int]:
        """The granules ``[first, end)`` of ``[ptr, ptr + nbytes)``, all mapped in ``space``; a hal error otherwise."""
        g = self.granularity
        first, end = (ptr - space.base) // g, -(-(ptr - space.base + nbytes) // g)
        # past what the space maps first, by arithmetic: only granules it maps are ever looked at one by one
        unmapped = ([i for i in range(first, min(end, space.mapped)) if not space.place(i).mapped]
                    + list(range(max(first, space.mapped), min(end, max(first, space.mapped) + 4))))
        if unmapped:
            raise hal.InvalidArgumentError(
                f"[{ptr:#x}, {ptr + nbytes:#x}) reaches granule(s) {unmapped[:4]} of space {space.id}, which are not "
                f"mapped (it maps {space.mapped}): export memory its allocations reached", backend=self.backend.name,
                call=call)
        return first, end

    # -- creating and releasing ---------------------------------------------------

    def _ensure(self, index: int, tx: Transaction) -> None:
        """Create chunk ``index`` if it is missing (past the end, or released); released again on rollback."""
        if index < len(self._chunks) and self._chunks[index].handle is not None:
            return
        chunk = self._chunks[index] if index < len(self._chunks) else Chunk(self.granularity)
        self._backing.create(chunk)
        appended = index == len(self._chunks)
        if appended:
            self._chunks.append(chunk)
        tx.append(functools.partial(self._drop, chunk, appended))

    def _drop(self, chunk: Chunk, appended: bool) -> None:
        """Undo a chunk's creation: release it unless a mapping that would not go still uses it."""
        self._backing.drop(chunk)
        if appended and chunk.handle is None and self._chunks and self._chunks[-1] is chunk:
            self._chunks.pop()

    def precreate(self, nbytes: int, limit: int | None, reserve_bytes: int) -> None:
        """Create chunks for ``nbytes`` past the last one (all or nothing), within ``limit`` and ``reserve_bytes``."""
        if not isinstance(nbytes, int) or isinstance(nbytes, bool):
            raise hal.InvalidArgumentError(f"nbytes={nbytes!r} must be an int", backend=self.backend.name,
                                           call="precreate")
        count = -(-nbytes // self.granularity)
        if count <= 0:
            return
        self.check_limit(count, limit, "precreate")
        if (len(self._chunks) + count) * self.granularity > reserve_bytes:
            raise hal.DeviceOutOfMemoryError(
                f"{fmt_bytes(self.physical_bytes + count * self.granularity)} would not fit in a virtual "
                f"space of reserve_bytes={reserve_bytes}; make the allocator's reserve_bytes larger",
                backend=self.backend.name, call="precreate")
        with Transaction() as tx:
            first = len(self._chunks)
            for index in range(first, first + count):
                self._ensure(index, tx)
            tx.commit()

    def trim(self, keep: int) -> None:
        """Release every chunk from ``keep`` on (no space reaches them any more)."""
        trimmed, self._chunks[:] = self._chunks[keep:], self._chunks[:keep]
        self._backing.retry()
        for chunk in trimmed:
            self._backing.release(chunk)

    def retry(self) -> None:
        """Release the chunks whose release failed before; those that fail again stay pending."""
        self._backing.retry()

    # -- sleep ----------------------------------------------------------------------

    def pause(self, places: list[Place]) -> int:
        """Unmap every place (all or nothing) and release every chunk, keeping its index; the bytes released."""
        released = self._backing.pause(places, self.all_chunks())
        self._backing.retry()
        return released

    def resume(self, places: Iterable[Place]) -> None:
        """Create the chunks that places map again and map every hole (all or nothing); a chunk no place maps
        is made when a space reaches it."""
        places = list(places)
        mapped = {id(p.chunk) for p in places}
        self._backing.resume(places, [c for c in self.all_chunks() if id(c) in mapped])

    # -- close ----------------------------------------------------------------------

    def unmap_at_close(self, spaces: list[VirtualSpace], park_live: bool, errors: list[BaseException]) -> set[int]:
        """Park the busy spaces (``park_live``, awake only) or warn about them, and unmap the rest; return the ids
        of the arenas parked spaces lie in (they stay reserved). Failures go to ``errors``."""
        if not self._backing.paused:  # a paused allocator has nothing mapped for a tensor to read
            self._park_busy(spaces, park_live, errors)
        self._backing.unmap_all((p for s in spaces if s not in self._parked for p in s.places), errors)
        return {id(s.arena) for s in self._parked}

    def release_at_close(self, errors: list[BaseException]) -> None:
        """Release every chunk no space maps any more; if some are still held, say so in ``errors``.

        That error is added only when no earlier step failed (the first failure is what close raises).
        """
        self._backing.retry()
        for chunk in self.all_chunks():
            if chunk.handle is not None and not chunk.maps:
                self._backing.release(chunk)
        if not errors and (self._backing.pending or self.held):
            errors.append(hal.InvalidStateError(f"{len(self._backing.pending)} chunk(s) could not be released yet; "
                                                "close() again to retry", backend=self.backend.name, call="close"))

    def stop(self) -> None:
        """Its owner closed: nothing of it may run any more (:attr:`paused` from now on)."""
        self._backing.mark_sleeping()

    def forget(self) -> None:
        """After a close that released everything: no chunk is left to keep."""
        self._chunks.clear()

    def _park_busy(self, spaces: list[VirtualSpace], park_live: bool, errors: list[BaseException]) -> None:
        """Park the mapped spaces with live allocations if ``park_live``, else warn about them (once)."""
        if self._parked:
            return
        busy = [s for s in spaces if s.live_allocations and s.mapped]
        if busy and not park_live:
            log.warning("closing with allocations still live in space(s) %s: tensors still using them "
                        "must not be touched after this", [s.id for s in busy])
        if not busy or not park_live:
            return
        try:
            scratch = self.backend.create_phy_mem_handle(self.granularity)
        except hal.HalError as exc:
            log.warning("closing with allocations still live in space(s) %s and no memory for a scratch chunk: "
                        "tensors still using them must not be touched after this", [s.id for s in busy])
            errors.append(exc)
            return
        with self._backing.ordered():
            self._park(busy, scratch, errors)
        self._parked, self._parked_bytes = busy, sum(s.size for s in busy)
        log.warning("closing with allocations still live in space(s) %s: their %s stay reserved over a scratch "
                    "chunk (reads give garbage) until the backend closes", [s.id for s in busy],
                    fmt_bytes(self._parked_bytes))

    def _park(self, busy: list[VirtualSpace], scratch: Any, errors: list[BaseException]) -> None:
        """Map ``scratch`` over every granule of ``busy`` in place of its chunk (reads give garbage)."""
        for place in (p for s in busy for p in s.places):
            try:
                if place.mapped:
                    self._backing.unmap(place)
                self.backend.map(place.ptr, self.granularity, scratch)
            except Exception as exc:  # noqa: BLE001 - collected; close() raises the first after releasing the rest
                errors.append(exc)
