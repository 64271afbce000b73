"""The memory a :class:`graphkit.MemorySaver` hands out inside its ``region()`` blocks.

Each tag made through ``region()`` gets a pool of the framework's allocator
whose callbacks come here: every segment the framework asks for is a range
of its own with one chunk mapped into it, and a segment the framework frees
is torn down. A :class:`Region` is one tag's segments, and the
:class:`graphkit.Sleeper` the saver pauses and resumes for it. A chunk or a
range whose release fails is kept and released by a later call, never lost.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Container
from dataclasses import dataclass, field
from typing import Any

import torch

import hal
from graphkit.memory.closing import close_step
from graphkit.memory.transaction import Transaction, release_or_keep, retry_releases
from hal.types import round_up

log = logging.getLogger("graphkit.saver")


@dataclass(eq=False)
class Segment:
    """One segment handed to the framework: its own range and, while awake, its own chunk."""

    ptr: int
    size: int
    handle: Any = None  # its chunk; None once released while paused
    mapped: bool = True


@dataclass(eq=False)
class Region:
    """The memory of one tag made through :meth:`graphkit.MemorySaver.region`: a :class:`graphkit.Sleeper`."""

    tag: str
    backup: bool
    backend: hal.Backend
    zombies: list[Any]  # the saver's chunks to release later
    pin: bool = True
    pool: Any = None
    segments: dict[int, Segment] = field(default_factory=dict)
    host: dict[int, torch.Tensor] = field(default_factory=dict)  # segment ptr -> backup, reused every pause
    blocks: int = 0  # region() blocks open on it (any thread)
    sleeping: bool = False
    backed_up: bool = False
    woke_backed_up: bool = False  # backed_up when the last sleep ended (a failed resume goes back to it)
    preparing: threading.Thread | None = None  # making the backup buffers in the background
    pin_seconds: float = 0.0  # time spent making (pinning) backup buffers, off the pause path or on it

    @property
    def paused(self) -> bool:
        return self.sleeping or any(not s.mapped for s in self.segments.values())

    @property
    def footprint_bytes(self) -> int:
        return sum(s.size for s in self.segments.values())

    @property
    def host_bytes(self) -> int:
        return sum(h.numel() for h in self.host.values())

    @property
    def pinned(self) -> bool:
        return self.pin and self.backend.torch_device().type != "cpu"

    def prepare_backups(self) -> None:
        """Make the host buffer of every segment that has none (pinning is slow: about 0.5 s per GB).

        Runs in the background when a backed-up region block ends, so that
        the first pause only copies; a pause that finds buffers missing makes
        them itself.
        """
        start = time.perf_counter()
        made = False
        for s in list(self.segments.values()):
            host = self.host.get(s.ptr)
            if host is None or host.numel() != s.size:
                host = torch.empty(s.size, dtype=torch.uint8, pin_memory=self.pinned)
                if not self.pinned:  # pageable memory gets its pages at the first write: now, not in the first pause
                    host.zero_()
                self.host[s.ptr] = host
                made = True
        if made:
            self.pin_seconds += time.perf_counter() - start

    def prepare_in_background(self) -> None:
        """Start :meth:`prepare_backups` on a thread of its own (one at a time)."""
        if self.preparing is not None and self.preparing.is_alive():
            return

        def run() -> None:
            try:
                self.prepare_backups()
            except Exception as exc:  # noqa: BLE001 - the first pause makes what is missing
                log.warning("tag %r: backup buffers not made in the background (the first pause makes them): %s",
                            self.tag, exc)

        self.preparing = threading.Thread(target=run, name=f"graphkit-backup-{self.tag}", daemon=True)
        self.preparing.start()

    def release_physical(self, *, keep_backup: bool = False) -> int:
        """See :class:`graphkit.Sleeper`; ``keep_backup``: a failed resume goes back to the last pause's backup."""
        be = self.backend
        segments = list(self.segments.values())
        if keep_backup:
            self.backed_up = self.woke_backed_up
        elif self.backup and not self.backed_up:  # every copy first, then every unmap: never a copy racing its unmap
            if any(not s.mapped for s in segments):
                raise hal.InvalidStateError(f"tag {self.tag!r}: part of it is unmapped (a failed rollback); "
                                            "resume it before pausing", backend=be.name, call="MemorySaver.pause")
            if self.preparing is not None:
                self.preparing.join()  # the buffers made in the background
                self.preparing = None
            self.prepare_backups()
            pin = self.pinned
            for s in segments:
                self.host[s.ptr].copy_(be.tensor_at(s.ptr, s.size), non_blocking=pin)
            be.synchronize()
            self.backed_up = True
        was, self.sleeping = self.sleeping, True
        try:
            with Transaction() as tx:
                for s in reversed(segments):
                    if s.mapped:
                        be.unmap(s.ptr, s.size)
                        s.mapped = False
                        tx.append(functools.partial(self._map, s))
                tx.commit()
        except BaseException:
            self.sleeping = was
            if not self.paused:
                self.backed_up = False  # awake again, as before
            raise
        released = 0
        for s in segments:
            if s.handle is not None:
                handle, s.handle = s.handle, None
                if release_or_keep(be, handle, self.zombies):
                    released += s.size
        return released

    def _map(self, s: Segment) -> None:
        self.backend.map(s.ptr, s.size, s.handle)
        s.mapped = True

    def _unmap(self, s: Segment) -> None:
        self.backend.unmap(s.ptr, s.size)
        s.mapped = False

    def restore_physical(self, restore: bool = True) -> None:
        be = self.backend
        if not self.paused:
            return
        with Transaction() as tx:
            for s in self.segments.values():
                if s.handle is None:
                    s.handle = be.create_phy_mem_handle(s.size)
                    tx.append(functools.partial(self._drop_chunk, s))
            for s in self.segments.values():
                if not s.mapped:
                    self._map(s)
                    tx.append(functools.partial(self._unmap, s))
            if restore and self.backup and self.backed_up:
                for s in self.segments.values():
                    host = self.host.get(s.ptr)
                    if host is not None:
                        be.tensor_at(s.ptr, s.size).copy_(host, non_blocking=True)
                be.synchronize()
            tx.commit()
        self.sleeping = False
        self.woke_backed_up, self.backed_up = self.backed_up, False

    def _drop_chunk(self, s: Segment) -> None:
        if s.mapped:  # an unmap of the rollback failed: the chunk stays with its mapping
            return
        handle, s.handle = s.handle, None
        release_or_keep(self.backend, handle, self.zombies)


class RegionMemory:
    """Every region of one saver: their pools, the segments the framework gets from them, and what failed to go.

    :param lock: the saver's lock: an allocation never overlaps a pause.
    :param paused: the saver's paused tags (read here, never written): a
        paused tag's pool hands out nothing.
    """

    def __init__(self, backend: hal.Backend, lock: threading.RLock, paused: Container[str], pin: bool) -> None:
        self.backend = backend
        self._lock = lock
        self._paused = paused
        self._pin = pin
        self.regions: dict[str, Region] = {}
        self.zombies: list[Any] = []  # chunks whose release failed: released later
        self.dead_segments: list[Segment] = []  # segments whose teardown failed half-way: finished later

    def enter(self, tag: str, backup: bool) -> Region:
        """The region of ``tag`` (made with its pool on the first block) with one more block open on it.

        The caller holds the lock. :raises hal.UnsupportedError: the backend
        has no pools the framework allocates from.
        """
        be = self.backend
        if not be.supports("use_pool") or not be.supports("custom_pool"):
            raise hal.UnsupportedError(
                "regions need pools over allocator callbacks that the framework allocates from "
                "(capabilities 'custom_pool' and 'use_pool')", backend=be.name, call="MemorySaver.region")
        region = self.regions.get(tag)
        if region is None:
            made = Region(tag, backup, be, self.zombies, self._pin)
            made.pool = be.create_pool(lambda n: self._alloc(made, n), lambda p, n: self._free(made, p))
            region = self.regions[tag] = made  # only once its pool exists
        elif region.backup != backup:
            raise hal.InvalidArgumentError(f"tag={tag!r} was made with backup={region.backup}", backend=be.name,
                                           call="MemorySaver.region")
        if tag in self._paused:
            raise hal.InvalidStateError(f"tag {tag!r} is paused: resume it before allocating in it",
                                        backend=be.name, call="MemorySaver.region")
        region.blocks += 1
        return region

    def leave(self, region: Region) -> None:
        """A block of ``region`` ended: once none is open, a backed-up region makes its backup buffers."""
        with self._lock:
            region.blocks -= 1
            if region.backup and not region.blocks and region.tag not in self._paused:
                region.prepare_in_background()  # the first pause then only copies

    def _alloc(self, region: Region, nbytes: int) -> int:
        """A segment of its own for the framework: a range, one chunk, mapped (all or nothing)."""
        be = self.backend
        with self._lock:
            if region.tag in self._paused or region.sleeping:
                raise hal.InvalidStateError(f"tag {region.tag!r} is paused", backend=be.name, call="MemorySaver")
            size = round_up(max(nbytes, 1), be.granularity)
            self.retry()
            with Transaction() as tx:
                ptr = be.create_vir_ptr(size)
                tx.append(lambda: self._release_range(ptr, size))
                handle = be.create_phy_mem_handle(size)
                tx.append(functools.partial(self._release_chunk, handle))
                be.map(ptr, size, handle)
                tx.commit()
            region.segments[ptr] = Segment(ptr, size, handle, mapped=True)
            return ptr

    def _release_chunk(self, handle: Any) -> None:
        release_or_keep(self.backend, handle, self.zombies)

    def _release_range(self, ptr: int, size: int) -> None:
        try:
            self.backend.release_vir_ptr(ptr, size)
        except hal.HalError as exc:  # kept as an empty segment: released by the next retry
            log.warning("a range could not be released yet (retried later): %s", str(exc))
            self.dead_segments.append(Segment(ptr, size, None, mapped=False))

    def retry(self) -> None:
        """Finish what failed before: chunks to release, segments half torn down."""
        retry_releases(self.backend, self.zombies)
        dead, self.dead_segments = self.dead_segments, []
        for segment in dead:
            self._tear_down(segment)

    def _tear_down(self, segment: Segment) -> bool:
        """Unmap, release the chunk, free the range; a step that fails is kept and retried later."""
        be = self.backend
        try:
            if segment.mapped:
                be.unmap(segment.ptr, segment.size)
                segment.mapped = False
            if segment.handle is not None:
                handle, segment.handle = segment.handle, None
                release_or_keep(be, handle, self.zombies)
            be.release_vir_ptr(segment.ptr, segment.size)
        except hal.HalError as exc:
            log.warning("a freed segment could not be torn down yet (retried later): %s", str(exc))
            self.dead_segments.append(segment)
            return False
        return True

    def _free(self, region: Region, ptr: int) -> None:
        with self._lock:
            segment = region.segments.pop(ptr, None)
            region.host.pop(ptr, None)
            if segment is None or self.backend.closed:
                return
            self._tear_down(segment)

    def close(self) -> list[BaseException]:
        """Release every region's pool (the segments go as the framework frees them) and retry what failed before.

        Goes on past failures; returns them (a chunk or segment still held
        counts as one), so that a later ``close()`` finishes.
        """
        errors: list[BaseException] = []
        for region in self.regions.values():
            if region.pool is not None and close_step(errors, self.backend.release_pool, region.pool):
                region.pool = None
        self.retry()
        if not errors and (self.zombies or self.dead_segments):
            errors.append(hal.InvalidStateError(
                f"{len(self.zombies)} chunk(s) and {len(self.dead_segments)} segment(s) could not be "
                "released yet", backend=self.backend.name, call="MemorySaver.close"))
        return errors
