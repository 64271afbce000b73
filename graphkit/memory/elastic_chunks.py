"""The physical chunks of elastic ranges: the free list a reservation's ranges share, and one range's prefix.

A range's prefix grows and shrinks at its end, in chunks of whole granules:
a growth step maps what the free list holds that fits, then creates what is
missing as chunks of at most ``chunk_bytes`` (one chunk, one map call, for a
step of any size when that allows it). A chunk is mapped, unmapped, released
and created again only whole, so a pause and a resume cost a driver call or
two per chunk, not per granule, and a resume creates the same chunks again.
A shrink gives back the chunks that lie wholly past the new size; a chunk that
holds bytes below it stays mapped whole (nothing is copied, no byte below the
new size moves), so the prefix can end up to one chunk less a granule past
the size asked. Chunks given back go to the free list, and growth takes them
from there before it pays a driver allocation. Its sleep runs on the one
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
from graphkit.memory.host_backup import HostBackup
from hal.transaction import Transaction

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
        self.free: dict[int, list[Any]] = {}  # chunk bytes -> pre-created chunks of that size, mapped nowhere
        self.backing = Backing(backend)  # its pending chunks: mapped nowhere, release failed, released later
        self.created = 0  # chunks created over its life (growth that paid a driver allocation)

    @property
    def free_bytes(self) -> int:
        return sum(size * len(handles) for size, handles in self.free.items())

    @property
    def pending(self) -> list[Any]:
        """Chunks mapped nowhere whose release failed: released at the next :meth:`trim`."""
        return self.backing.pending

    def retry(self) -> None:
        """Release the pending chunks again; those that fail again stay pending."""
        self.backing.retry()

    def create(self, count: int) -> None:
        """Create ``count`` chunks of one granule into the free list (all or nothing)."""
        made = [Chunk(self.granularity) for _ in range(count)]
        with Transaction() as tx:
            for chunk in made:
                self.backing.create(chunk, tx)
            tx.commit()
        self.put((c.handle, c.size) for c in made)
        self.created += len(made)

    def take(self, most: int) -> Chunk:
        """A chunk of at most ``most`` bytes for growth: the largest free one that fits, else a new one of
        ``most`` bytes (the caller puts it back on failure)."""
        fits = [size for size, handles in self.free.items() if size <= most and handles]
        if fits:
            size = max(fits)
            return Chunk(size, self.free[size].pop())
        chunk = Chunk(most, self.backend.create_phy_mem_handle(most))
        self.created += 1
        return chunk

    def put(self, chunks: Iterable[tuple[Any, int]]) -> None:
        """Chunks mapped nowhere, as ``(handle, bytes)``, go back to the free list (reused by the next growth)."""
        with self.lock:
            for handle, size in chunks:
                self.free.setdefault(size, []).append(handle)

    def keep(self, handles: list[Any]) -> None:
        """Chunks whose release failed elsewhere: pending here, released at the next :meth:`trim`."""
        with self.lock:
            self.backing.keep_pending(handles)

    def trim(self) -> int:
        """Release the free list's chunks (and the pending ones); return the bytes released."""
        with self.lock:
            self.backing.retry()
            free, self.free = self.free, {}
            return sum(size for size, handles in free.items() for handle in reversed(handles)
                       if self.backing.release_handle(handle))


class RangeChunks:
    """The places (a chunk of whole granules each, end to end from the range's start) of one range's prefix,
    and its pending mappings.

    ``places`` cover granules ``0 .. granules`` in order; a place that is not mapped is a hole (paused, or a
    failed rollback), its chunk's handle None while a pause released it. ``pending`` are mappings past the
    prefix that a failed rollback could not undo yet. The object refers to no buffer: a buffer dropped
    without ``close()`` leaves it to its reservation, which unmaps what it records.

    :param chunk_bytes: the most bytes a chunk made for growth holds (a multiple of the granularity).
    """

    __slots__ = ("backend", "backing", "chunk_bytes", "granularity", "granules", "pending", "places", "ptr", "size",
                 "store")
    backing: Backing

    @property
    def paused(self) -> bool:
        """Whether part of the prefix is released or unmapped."""
        return self.backing.paused

    @property
    def sleeping(self) -> bool:
        """Whether a pause released it (a failed rollback's holes aside)."""
        return self.backing.sleeping

    def __init__(self, store: FreeChunks, ptr: int, size: int, host: HostBackup | None = None,
                 chunk_bytes: int | None = None) -> None:
        self.store = store
        self.backend = store.backend
        self.granularity = store.granularity
        self.ptr, self.size = ptr, size
        self.chunk_bytes = chunk_bytes if chunk_bytes is not None else size
        self.backing = Backing(store.backend, host)
        self.places: list[Place] = []
        self.granules = 0  # granules the places cover (the prefix, mapped or a hole)
        self.pending: list[Place] = []  # mappings past the prefix whose unmap failed: unmapped later

    @property
    def mapped_bytes(self) -> int:
        if not self.backing.paused:
            return self.granules * self.granularity
        return sum(p.size for p in self.places if p.mapped)

    @property
    def footprint_bytes(self) -> int:
        return self.granules * self.granularity

    @property
    def released(self) -> bool:
        """Nothing mapped and no chunk held (a finished pause)."""
        return all(not p.mapped and p.chunk.handle is None for p in self.places)

    @property
    def held_bytes(self) -> int:
        """Bytes of the chunks the prefix holds."""
        return sum(p.size for p in self.places if p.chunk.handle is not None)

    def kept(self, target: int) -> int:
        """The granules a shrink to ``target`` granules leaves: ``target``, or the end of the chunk that holds
        granule ``target - 1`` (chunks go only whole); ``granules`` when ``target`` is not below it."""
        if target >= self.granules:
            return self.granules
        end = self.granules
        for place in reversed(self.places):
            start = end - place.size // self.granularity
            if start < target:
                return end
            end = start
        return 0

    def settled(self, target: int) -> bool:
        """Whether a resize to ``target`` granules would change nothing (a decode loop asks this every step)."""
        if target > self.granules:
            return False
        if target == self.granules:
            return True
        return self.granules - self.places[-1].size // self.granularity < target

    # -- growing and shrinking ----------------------------------------------------------

    def _unmapped(self, chunks: Iterable[Chunk]) -> list[tuple[Any, int]]:
        return [(c.handle, c.size) for c in chunks if c.handle is not None]

    def grow(self, target: int) -> None:
        """Map chunks at granules ``granules .. target``, from the free list first, then new ones of at most
        ``chunk_bytes`` (all or nothing)."""
        made: list[Place] = []
        g = self.granularity
        at = self.granules * g
        end = target * g
        with self.store.lock, Transaction() as tx:
            with self.backend.deferred_access():  # access set once for the chunks side by side
                while at < end:
                    place = Place(self.ptr + at, self.store.take(min(end - at, self.chunk_bytes)))
                    tx.append(functools.partial(self._give_back, place))
                    self.backing.map(place)
                    made.append(place)
                    at += place.size
            tx.commit()
        self.places.extend(made)
        self.granules = target

    def _give_back(self, place: Place) -> None:
        """Undo of a growth step: the chunk taken goes back to the free list, unmapped first if it was mapped."""
        if place.mapped:
            self._unmap_to_free(place)
        else:
            self.store.put(self._unmapped([place.chunk]))  # mapped nowhere: back to the free list

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
        self.store.put(self._unmapped([place.chunk]))

    def shrink(self, target: int) -> None:
        """Unmap the chunks that lie wholly at granules ``target ..`` (all or nothing); they go to the free list.

        A chunk that holds granules on both sides of ``target`` stays whole (see :meth:`kept`).
        """
        keep = self.kept(target)
        end, cut = self.granules, len(self.places)
        while end > keep:
            cut -= 1
            end -= self.places[cut].size // self.granularity
        with self.backing.ordered(), Transaction() as tx:  # one wait for the device, then every unmap
            for place in reversed(self.places[cut:]):
                if place.mapped:
                    self.backing.unmap(place, tx)
            tx.commit()
        freed = self.places[cut:]
        del self.places[cut:]
        self.granules = keep
        self.store.put(self._unmapped(p.chunk for p in reversed(freed)))

    # -- what failed steps left -----------------------------------------------------------

    def retry_pending(self) -> None:
        """Unmap the pending mappings a failed rollback left; those that fail again stay pending."""
        if not self.pending:
            return
        with self.backing.ordered():
            for place in list(self.pending):
                try:
                    self.backing.unmap(place)
                except hal.HalError as exc:
                    log.error("elastic range: unmap at %#x failed (retried later): %s", place.ptr, str(exc))
                    continue
                self.pending.remove(place)
                self.store.put(self._unmapped([place.chunk]))

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
        """Back up the prefix (``backup``), unmap it and release its chunks (see :meth:`Backing.pause`):
        an unmap and a release per chunk."""
        spans = [(self.ptr, self.footprint_bytes)] if backup and self.places else None
        try:
            return self.backing.pause(self.places, [p.chunk for p in self.places], backup=spans,
                                      keep_backup=keep_backup,
                                      refuse=(_UNMAPPED, "ElasticBuffer.pause"))
        finally:
            self.store.keep(self.backing.take_pending())

    def resume(self, restore: bool) -> None:
        """Fresh chunks of the same sizes mapped at the same addresses (a creation and a map per chunk), the
        backup copied back where ``restore`` (all or nothing)."""
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
        with self.backing.ordered():  # one wait for the device, then every unmap
            for place in reversed(self.places):
                if place.mapped and not close_step(errors, self.backing.unmap, place):
                    continue
                if place.chunk.handle is not None:
                    self.store.put([(self.backing.hand_over(place.chunk), place.chunk.size)])
        if not errors and not self.pending:
            del self.places[:]
            self.granules = 0
        return errors
