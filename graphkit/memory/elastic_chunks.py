"""The physical chunks of elastic ranges: the free list a reservation's ranges share, and one range's prefix.

A range's prefix grows and shrinks at its end, one granule and one chunk at
a time; chunks it gives back go to the free list, and growth takes them from
there before it pays a driver allocation. Its sleep runs on the one
release/restore machine, :class:`graphkit.memory.backing.Backing`.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Iterable
from typing import Any

import hal
from graphkit.memory.backing import Backing, Chunk, Place
from graphkit.memory.closing import close_step
from graphkit.memory.figures import figure
from graphkit.memory.host_backup import HostBackup
from graphkit.memory.transaction import Transaction

log = logging.getLogger(__name__)

_UNMAPPED = "part of the buffer is unmapped (a failed rollback): restore_physical() it before a pause can back it up"


class FreeChunks:
    """Chunks mapped nowhere: pre-created ones to grow from, and pending ones whose release failed (released later).

    :attr:`lock` guards it and is the reservation's lock too: a buffer takes
    its own lock first, then this one.
    """

    def __init__(self, backend: hal.Backend) -> None:
        self.backend = backend
        self.granularity = backend.granularity
        self.lock = threading.RLock()
        self.free: list[Any] = []  # pre-created chunks, mapped nowhere
        self.backing = Backing(backend)  # its pending chunks: mapped nowhere, release failed, released later
        self.created = 0  # chunks created over its life (growth that paid a driver allocation)

    @property
    def free_bytes(self) -> int:
        return len(self.free) * self.granularity

    @property
    def pending(self) -> list[Any]:
        """Chunks mapped nowhere whose release failed: released at the next :meth:`trim`."""
        return self.backing.pending

    def create(self, count: int) -> None:
        """Create ``count`` chunks into the free list (all or nothing)."""
        made = [Chunk(self.granularity) for _ in range(count)]
        with Transaction() as tx:
            for chunk in made:
                self.backing.create(chunk, tx)
            tx.commit()
        self.free.extend(c.handle for c in made)
        self.created += len(made)

    def take(self) -> Any:
        """A chunk for growth: from the free list, else a new one (the caller puts it back on failure)."""
        if self.free:
            return self.free.pop()
        handle = self.backend.create_phy_mem_handle(self.granularity)
        self.created += 1
        return handle

    def put(self, handles: Iterable[Any]) -> None:
        """Chunks mapped nowhere go back to the free list (reused by the next growth)."""
        with self.lock:
            self.free.extend(handles)

    def keep(self, handles: list[Any]) -> None:
        """Chunks whose release failed elsewhere: pending here, released at the next :meth:`trim`."""
        with self.lock:
            self.backing.pending.extend(handles)

    def trim(self) -> int:
        """Release the free list's chunks (and the pending ones); return the bytes released."""
        with self.lock:
            self.backing.retry()
            free, self.free = self.free, []
            return sum(self.granularity for handle in reversed(free) if self.backing.release_handle(handle))


class RangeChunks:
    """The place (granule and chunk) of each granule of one range's prefix, and its pending mappings.

    ``places[i]`` maps granule ``i``; a place that is not mapped is a hole (paused, or a failed
    rollback), its chunk None while a pause released it. ``pending`` are mappings past the prefix
    that a failed rollback could not undo yet. The object refers to no buffer: a buffer dropped
    without ``close()`` leaves it to its reservation, which unmaps what it records.
    """

    __slots__ = ("backend", "backing", "granularity", "pending", "places", "ptr", "size", "store")
    backing: Backing
    paused = figure("backing", "paused", "Whether part of the prefix is released or unmapped.")

    def __init__(self, store: FreeChunks, ptr: int, size: int, host: HostBackup | None = None) -> None:
        self.store = store
        self.backend = store.backend
        self.granularity = store.granularity
        self.ptr, self.size = ptr, size
        self.backing = Backing(store.backend, host)
        self.places: list[Place] = []
        self.pending: list[Place] = []  # mappings past the prefix whose unmap failed: unmapped later

    @property
    def mapped_bytes(self) -> int:
        if not self.backing.paused:
            return len(self.places) * self.granularity
        return sum(p.mapped for p in self.places) * self.granularity

    @property
    def footprint_bytes(self) -> int:
        return len(self.places) * self.granularity

    @property
    def released(self) -> bool:
        """Nothing mapped and no chunk held (a finished pause)."""
        return all(not p.mapped and p.chunk.handle is None for p in self.places)

    @property
    def held(self) -> int:
        """Chunks held by the prefix."""
        return sum(p.chunk.handle is not None for p in self.places)

    # -- growing and shrinking ----------------------------------------------------------

    def grow(self, target: int) -> None:
        """Map chunks at granules ``len(places) .. target``, from the free list first (all or nothing)."""
        made: list[Place] = []
        with self.store.lock, Transaction() as tx:
            for index in range(len(self.places), target):
                place = Place(self.ptr + index * self.granularity, Chunk(self.granularity, self.store.take()))
                try:
                    self.backing.map(place)
                except BaseException:
                    self.store.put([place.chunk.handle])  # mapped nowhere: back to the free list
                    raise
                made.append(place)
                tx.append(functools.partial(self._unmap_to_free, place))
            tx.commit()
        self.places.extend(made)

    def _unmap_to_free(self, place: Place) -> None:
        """Undo of a growth step: unmap, chunk back to the free list; a mapping that will not go is pending."""
        try:
            self.backing.unmap(place)
        except hal.HalError:
            if place not in self.pending:
                self.pending.append(place)
            raise
        if place in self.pending:  # an earlier try recorded it
            self.pending.remove(place)
        self.store.put([place.chunk.handle])

    def shrink(self, target: int) -> None:
        """Unmap granules ``target ..`` (all or nothing); their chunks go to the free list."""
        with Transaction() as tx:
            for place in reversed(self.places[target:]):
                if place.mapped:
                    self.backing.unmap(place, tx)
            tx.commit()
        freed = self.places[target:]
        del self.places[target:]
        self.store.put(p.chunk.handle for p in reversed(freed) if p.chunk.handle is not None)

    # -- what failed steps left -----------------------------------------------------------

    def retry_pending(self) -> None:
        """Unmap the pending mappings a failed rollback left; those that fail again stay pending."""
        for place in list(self.pending):
            try:
                self.backing.unmap(place)
            except hal.HalError as exc:
                log.error("elastic range: unmap at %#x failed (retried later): %s", place.ptr, str(exc))
                continue
            self.pending.remove(place)
            self.store.put([place.chunk.handle])

    def heal(self, call: str, sleeping: bool) -> None:
        """Unmap pending mappings and (unless ``sleeping``) map holes back; raises if a pending mapping stays."""
        self.retry_pending()
        if self.backing.holes and not sleeping:
            self.backing.fill(self.places)
        if self.pending:
            raise hal.InvalidStateError(f"{len(self.pending)} mapping(s) of a failed resize still cannot be "
                                        "undone", backend=self.backend.name, call=f"ElasticBuffer.{call}")

    # -- sleep and teardown -----------------------------------------------------------------

    def pause(self, backup: bool, keep_backup: bool) -> int:
        """Back up the prefix (``backup``), unmap it and release its chunks (see :meth:`Backing.pause`)."""
        spans = [(self.ptr, self.footprint_bytes)] if backup and self.places else None
        try:
            return self.backing.pause(self.places, [p.chunk for p in self.places], backup=spans,
                                      keep_backup=keep_backup,
                                      refuse=(_UNMAPPED, "ElasticBuffer.pause"))
        finally:
            self.store.keep(self.backing.take_pending())

    def resume(self, restore: bool) -> None:
        """Fresh chunks mapped at the same addresses, the backup copied back where ``restore`` (all or nothing)."""
        self.retry_pending()
        spans = [(self.ptr, self.footprint_bytes)] if restore and self.places else None
        try:
            self.backing.resume(self.places, [p.chunk for p in self.places], backup=spans)
        finally:
            self.store.keep(self.backing.take_pending())

    def unmap_all(self) -> list[BaseException]:
        """Unmap the whole prefix, last first, and put its chunks on the free list; the unmaps that failed.

        Goes on past failures; once nothing is left mapped (pending mappings
        included) the record is empty. Calling it again finishes.
        """
        errors: list[BaseException] = []
        self.retry_pending()
        for place in reversed(self.places):
            if place.mapped and not close_step(errors, self.backing.unmap, place):
                continue
            if place.chunk.handle is not None:
                self.store.put([place.chunk.handle])
                place.chunk.handle = None
        if not errors and not self.pending:
            del self.places[:]
        return errors
