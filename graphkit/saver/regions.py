"""The memory a :class:`graphkit.MemorySaver` hands out inside its ``region()`` blocks.

Each tag made through ``region()`` gets a pool of the framework's allocator
whose callbacks come here: every segment the framework asks for is a range
of its own with one chunk mapped into it (a :class:`graphkit.memory.backing.Place`),
and a segment the framework frees is torn down. A :class:`Region` is one tag's
segments, and the :class:`graphkit.Sleeper` the saver pauses and resumes for
it, on the one release/restore machine (:class:`graphkit.memory.backing.Backing`).
A chunk or a range whose release fails is pending: released by a later call, never lost.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch

import hal
from graphkit.memory.backing import Backing, Chunk, Place
from graphkit.memory.closing import close_step
from graphkit.memory.host_backup import HostBacked, HostBackup
from hal.transaction import Transaction
from hal.types import round_up

log = logging.getLogger(__name__)


class Region(HostBacked):
    """The memory of one tag made through :meth:`graphkit.MemorySaver.region`: a :class:`graphkit.Sleeper`.

    :param lock: its :class:`RegionMemory`'s lock: an allocation never overlaps a pause.
    """

    def __init__(self, tag: str, backup: bool, backend: hal.Backend, lock: threading.RLock, pin: bool) -> None:
        self.tag = tag
        self.backup = backup
        self.backend = backend
        self.lock = lock
        self.pool: Any = None
        self.segments: dict[int, Place] = {}  # ptr -> the segment: its own range, its own chunk
        self.blocks = 0  # region() blocks open on it (any thread)
        host = HostBackup(pin and backend.torch_device().type != "cpu", name=f"graphkit-backup-{tag}")
        self.backing = Backing(backend, host)
        self._backup = host
        self.host: dict[int, torch.Tensor] = host.pieces  # segment address -> its host buffer, reused every pause

    @property
    def paused(self) -> bool:
        return self.backing.paused

    @property
    def footprint_bytes(self) -> int:
        return sum(s.size for s in self.segments.values())

    def prepare_in_background(self) -> None:
        """Make the host buffer of every segment that has none, on a thread of its own (pinning is slow: about
        0.5 s per GB), so that the first pause only copies; a pause that finds buffers missing makes them."""
        self._backup.prepare_in_background([(s.ptr, s.size) for s in self.segments.values()])

    @property
    def preparing(self) -> threading.Thread | None:
        """The thread that made (or makes) the backup buffers in the background."""
        return self._backup.thread

    def forget(self, segment: Place) -> None:
        """``segment`` was freed by the framework: its backup buffer goes."""
        self._backup.forget(segment.ptr, segment.size)

    def _backup_spans(self) -> list[tuple[int, int]] | None:
        return [(s.ptr, s.size) for s in self.segments.values()] if self.backup else None

    def release_physical(self, *, keep_backup: bool = False) -> int:
        """See :class:`graphkit.Sleeper`; ``keep_backup``: a failed resume goes back to the last pause's backup."""
        with self.lock:
            segments = list(self.segments.values())
            unmapped = f"tag {self.tag!r}: part of it is unmapped (a failed rollback); resume it before pausing"
            return self.backing.pause(segments, [s.chunk for s in segments], backup=self._backup_spans(),
                                      keep_backup=keep_backup, refuse=(unmapped, "MemorySaver.pause"))

    def restore_physical(self, restore: bool = True) -> None:
        with self.lock:
            if self.paused:
                segments = list(self.segments.values())
                self.backing.resume(segments, [s.chunk for s in segments],
                                    backup=self._backup_spans() if restore else None)


class RegionMemory:
    """Every region of one saver: their pools, the segments the framework gets from them, and what is pending.

    Its lock (and each region's) keeps an allocation from overlapping a pause.
    """

    def __init__(self, backend: hal.Backend, pin: bool) -> None:
        self.backend = backend
        self.lock = threading.RLock()
        self._pin = pin
        self.regions: dict[str, Region] = {}
        self.backing = Backing(backend)  # its pending chunks: release failed, released later
        self.pending: list[Place] = []  # segments whose teardown failed half-way: finished later

    def enter(self, tag: str, backup: bool) -> Region:
        """The region of ``tag`` (made with its pool on the first block) with one more block open on it.

        :raises hal.UnsupportedError: the backend has no pools the framework allocates from.
        """
        be = self.backend
        if not be.supports("use_pool") or not be.supports("custom_pool"):
            raise hal.UnsupportedError(
                "regions need pools over allocator callbacks that the framework allocates from "
                "(capabilities 'custom_pool' and 'use_pool')", backend=be.name, call="MemorySaver.region")
        with self.lock:
            region = self.regions.get(tag)
            if region is None:
                made = Region(tag, backup, be, self.lock, self._pin)
                made.pool = be.create_pool(lambda n: self._alloc(made, n), lambda p, n: self._free(made, p))
                region = self.regions[tag] = made  # only once its pool exists
            elif region.backup != backup:
                raise hal.InvalidArgumentError(f"tag={tag!r} was made with backup={region.backup}", backend=be.name,
                                               call="MemorySaver.region")
            if region.paused:
                raise hal.InvalidStateError(f"tag {tag!r} is paused: resume it before allocating in it",
                                            backend=be.name, call="MemorySaver.region")
            region.blocks += 1
            return region

    def leave(self, region: Region) -> None:
        """A block of ``region`` ended: once none is open, a backed-up region makes its backup buffers."""
        with self.lock:
            region.blocks -= 1
            if region.backup and not region.blocks and not region.paused:
                region.prepare_in_background()  # the first pause then only copies

    def _alloc(self, region: Region, nbytes: int) -> int:
        """A segment of its own for the framework: a range, one chunk, mapped (all or nothing)."""
        be = self.backend
        with self.lock:
            if region.paused:
                raise hal.InvalidStateError(f"tag {region.tag!r} is paused", backend=be.name, call="MemorySaver")
            size = round_up(max(nbytes, 1), be.granularity)
            self.retry()
            with Transaction() as tx:
                ptr = be.create_vir_ptr(size)
                tx.append(lambda: self._release_range(ptr, size))
                segment = Place(ptr, Chunk(size))
                self.backing.create(segment.chunk, tx)
                self.backing.map(segment)
                tx.commit()
            region.segments[ptr] = segment
            return ptr

    def _release_range(self, ptr: int, size: int) -> None:
        try:
            self.backend.release_vir_ptr(ptr, size)
        except hal.HalError as exc:  # kept as an empty segment: released by the next retry
            log.warning("a range could not be released yet (retried later): %s", str(exc))
            self.pending.append(Place(ptr, Chunk(size)))

    def retry(self) -> None:
        """Finish what is pending: chunks to release, segments half torn down."""
        self.backing.retry()
        for region in self.regions.values():
            region.backing.retry()
        pending, self.pending = self.pending, []
        for segment in pending:
            self._tear_down(segment)

    def _tear_down(self, segment: Place) -> bool:
        """Unmap, release the chunk, free the range; a step that fails is pending, retried later."""
        try:
            if segment.mapped:
                self.backing.unmap(segment)
            self.backing.release(segment.chunk)
            self.backend.release_vir_ptr(segment.ptr, segment.size)
        except hal.HalError as exc:
            log.warning("a freed segment could not be torn down yet (retried later): %s", str(exc))
            self.pending.append(segment)
            return False
        return True

    def _free(self, region: Region, ptr: int) -> None:
        with self.lock:
            segment = region.segments.pop(ptr, None)
            if segment is None:
                return
            region.forget(segment)
            if not self.backend.closed:
                self._tear_down(segment)

    def close(self) -> list[BaseException]:
        """Release every region's pool (the segments go as the framework frees them) and retry what is pending.

        Goes on past failures; returns them (a chunk or segment still pending
        counts as one), so that a later ``close()`` finishes.
        """
        errors: list[BaseException] = []
        with self.lock:
            for region in self.regions.values():
                if region.pool is not None and close_step(errors, self.backend.release_pool, region.pool):
                    region.pool = None
            self.retry()
            chunks = len(self.backing.pending) + sum(len(r.backing.pending) for r in self.regions.values())
            if not errors and (chunks or self.pending):
                errors.append(hal.InvalidStateError(
                    f"{chunks} chunk(s) and {len(self.pending)} segment(s) could not be released yet",
                    backend=self.backend.name, call="MemorySaver.close"))
        return errors

