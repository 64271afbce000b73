"""The physical chunks of elastic ranges: the free list a reservation's ranges share, and one range's prefix.

A range's prefix grows and shrinks at its end, one granule and one chunk at
a time; chunks it gives back go to the free list, and growth takes them from
there before it pays a driver allocation.
"""

from __future__ import annotations

import functools
import logging
import threading
from typing import Any

import hal
from graphkit.memory.closing import close_step
from graphkit.memory.transaction import Transaction, map_run, release_or_keep, retry_releases, unmap_run

log = logging.getLogger("graphkit.memory.elastic")


class FreeChunks:
    """Chunks mapped nowhere: pre-created ones to grow from, and ones whose release failed (released later).

    :attr:`lock` guards it and is the reservation's lock too: a buffer takes
    its own lock first, then this one.
    """

    def __init__(self, backend: hal.Backend) -> None:
        self.backend = backend
        self.granularity = backend.granularity
        self.lock = threading.RLock()
        self.free: list[Any] = []  # pre-created chunks, mapped nowhere
        self.zombies: list[Any] = []  # chunks mapped nowhere whose release failed: released later
        self.created = 0  # chunks created over its life (growth that paid a driver allocation)

    @property
    def free_bytes(self) -> int:
        return len(self.free) * self.granularity

    def create(self, count: int) -> None:
        """Create ``count`` chunks into the free list (all or nothing)."""
        made: list[Any] = []
        with Transaction() as tx:
            for _ in range(count):
                handle = self.backend.create_phy_mem_handle(self.granularity)
                made.append(handle)
                tx.append(functools.partial(self._undo_create, handle))
            tx.commit()
        self.free.extend(made)
        self.created += len(made)

    def _undo_create(self, handle: Any) -> None:
        self.release(handle)

    def take(self) -> Any:
        """A chunk for growth: from the free list, else a new one (the caller puts it back on failure)."""
        if self.free:
            return self.free.pop()
        handle = self.backend.create_phy_mem_handle(self.granularity)
        self.created += 1
        return handle

    def put(self, handle: Any) -> None:
        """A chunk mapped nowhere goes back to the free list."""
        with self.lock:
            self.free.append(handle)

    def release(self, handle: Any) -> bool:
        """Release a chunk mapped nowhere; one that will not go is kept and released later."""
        return release_or_keep(self.backend, handle, self.zombies)

    def retry_releases(self) -> None:
        retry_releases(self.backend, self.zombies)

    def trim(self) -> int:
        """Release the free list's chunks (and those kept from failed releases); return the bytes released."""
        with self.lock:
            self.retry_releases()
            free, self.free = self.free, []
            released = 0
            for handle in reversed(free):
                if self.release(handle):
                    released += self.granularity
            return released


class RangeChunks:
    """The chunk behind each granule of one range's prefix, the granules unmapped now, and stray mappings.

    ``chunks[i]`` backs granule ``i`` (``None``: released while paused);
    ``holes`` are the granules of the prefix not mapped now (paused, or a
    failed rollback); ``stray`` are mappings past the prefix that a failed
    rollback could not undo yet. All three are changed in place, never
    rebound, and the object refers to no buffer: a buffer dropped without
    ``close()`` leaves it to its reservation, which unmaps what it records.
    """

    __slots__ = ("backend", "chunks", "granularity", "holes", "ptr", "size", "store", "stray")

    def __init__(self, store: FreeChunks, ptr: int, size: int) -> None:
        self.store = store
        self.backend = store.backend
        self.granularity = store.granularity
        self.ptr, self.size = ptr, size
        self.chunks: list[Any] = []
        self.holes: set[int] = set()
        self.stray: list[tuple[int, Any]] = []

    @property
    def mapped_bytes(self) -> int:
        return (len(self.chunks) - len(self.holes)) * self.granularity

    @property
    def footprint_bytes(self) -> int:
        return len(self.chunks) * self.granularity

    @property
    def released(self) -> bool:
        """Nothing mapped and no chunk held (a finished pause)."""
        return not self.mapped_bytes and all(h is None for h in self.chunks)

    # -- growing and shrinking ----------------------------------------------------------

    def grow(self, target: int) -> None:
        """Map chunks at granules ``len(chunks) .. target``, from the free list first (all or nothing)."""
        g = self.granularity
        made: list[Any] = []
        with self.store.lock, Transaction() as tx:
            for index in range(len(self.chunks), target):
                ptr = self.ptr + index * g
                handle = self.store.take()
                try:
                    self.backend.map(ptr, g, handle)
                except BaseException:
                    self.store.put(handle)  # mapped nowhere: back to the free list
                    raise
                made.append(handle)
                tx.append(functools.partial(self._unmap_to_free, ptr, handle))
            tx.commit()
        self.chunks.extend(made)

    def _unmap_to_free(self, ptr: int, handle: Any) -> None:
        """Undo of a growth step: unmap, chunk back to the free list; a mapping that will not go is kept and retried."""
        stray = (ptr, handle)
        try:
            self.backend.unmap(ptr, self.granularity)
        except hal.HalError:
            if stray not in self.stray:
                self.stray.append(stray)
            raise
        if stray in self.stray:  # an earlier try recorded it
            self.stray.remove(stray)
        self.store.put(handle)

    def shrink(self, target: int) -> None:
        """Unmap granules ``target ..`` (all or nothing); their chunks go to the free list."""
        with Transaction() as tx:
            self.unmap_from(target, tx)
            tx.commit()
        freed = self.chunks[target:]
        del self.chunks[target:]
        self.holes.difference_update(range(target, target + len(freed)))
        with self.store.lock:
            self.store.free.extend(reversed(freed))  # reused by the next growth

    def unmap_from(self, first: int, tx: Transaction) -> None:
        """Unmap granules ``first ..`` of the prefix, last first; each is mapped back on rollback."""
        unmap_run(self.backend, self.ptr, self.granularity, self.chunks, tx,
                  indices=[i for i in range(first, len(self.chunks)) if i not in self.holes],
                  on_unmap=self.holes.add, on_map=self.holes.discard)

    def fill_holes(self, tx: Transaction) -> None:
        """Map the granules of the prefix that are unmapped; each is unmapped again on rollback."""
        map_run(self.backend, self.ptr, self.granularity, self.chunks, tx, indices=list(self.holes),
                on_map=self.holes.discard, on_unmap=self.holes.add)

    # -- what failed steps left -----------------------------------------------------------

    def retry_strays(self) -> None:
        """Unmap the stray mappings a failed rollback left; those that fail again stay recorded."""
        for ptr, handle in list(self.stray):
            try:
                self.backend.unmap(ptr, self.granularity)
            except hal.HalError as exc:
                log.error("elastic range: unmap at %#x failed (retried later): %s", ptr, str(exc))
                continue
            self.stray.remove((ptr, handle))
            self.store.put(handle)

    def heal(self, call: str, sleeping: bool) -> None:
        """Unmap stray mappings and (unless ``sleeping``) map holes back; raises if a stray mapping stays."""
        self.retry_strays()
        if self.holes and not sleeping:
            with Transaction() as tx:
                self.fill_holes(tx)
                tx.commit()
        if self.stray:
            raise hal.InvalidStateError(f"{len(self.stray)} mapping(s) of a failed resize still cannot be "
                                        "undone", backend=self.backend.name, call=f"ElasticBuffer.{call}")

    # -- sleep and teardown -----------------------------------------------------------------

    def release_chunks(self) -> int:
        """Release every chunk of the (unmapped) prefix; the bytes released (one that will not go is kept)."""
        released = 0
        for index, handle in enumerate(self.chunks):
            if handle is not None:
                self.chunks[index] = None
                if self.store.release(handle):
                    released += self.granularity
        return released

    def recreate_chunks(self, tx: Transaction) -> None:
        """A fresh chunk for every granule whose chunk a pause released; each is released on rollback."""
        for index, handle in enumerate(self.chunks):
            if handle is None:
                self.chunks[index] = self.backend.create_phy_mem_handle(self.granularity)
                tx.append(functools.partial(self._drop_chunk, index))

    def _drop_chunk(self, index: int) -> None:
        """Undo of a chunk made by a restore: released, unless a mapping that would not go still uses it."""
        if index not in self.holes:
            return
        handle, self.chunks[index] = self.chunks[index], None
        self.store.release(handle)

    def unmap_all(self) -> list[BaseException]:
        """Unmap the whole prefix, last first, and put its chunks on the free list; the unmaps that failed.

        Goes on past failures; once nothing is left mapped (strays
        included) the record is empty. Calling it again finishes.
        """
        errors: list[BaseException] = []
        self.retry_strays()
        for index in reversed(range(len(self.chunks))):
            handle = self.chunks[index]
            if index not in self.holes:
                if not close_step(errors, self.backend.unmap, self.ptr + index * self.granularity, self.granularity):
                    continue
                self.holes.add(index)
            if handle is not None:
                self.chunks[index] = None
                self.store.put(handle)
        if not errors and not self.stray:
            del self.chunks[:]
            self.holes.clear()
        return errors
