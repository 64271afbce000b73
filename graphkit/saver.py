"""MemorySaver: give device memory back while another job runs, return at the same addresses.

RL post-training runs the rollout engine and the trainer on the same
devices: the engine pauses, the trainer runs, the engine resumes with its
weights, KV cache and captured graphs intact. A pause unmaps and releases
the physical memory and keeps every virtual range; a resume maps new
memory at the same addresses, so pointers baked into graphs stay valid.

>>> saver = graphkit.MemorySaver(be)
>>> with saver.region("weights", backup=True):   # tensors made here live in graphkit memory
...     weights = load_weights()
>>> with saver.region("kv_cache"):
...     kv = torch.empty(...)
>>> pools = graphkit.GraphPools(be, saver=saver)   # graph memory sleeps too, tag "graphs"
>>> saver.pause()            # every tag; weights copied to host first
>>> saver.resume()           # same addresses; weights bit-exact; graphs replay as captured

What the library cannot see: a tensor of a paused region touched by user code
reads unmapped memory -- a device fault on a GPU, a segmentation fault on
``fake`` -- as with any sleep mode over virtual memory.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

import hal
from graphkit.closing import Closable
from graphkit.transaction import Transaction, release_or_keep, retry_releases
from hal.types import fmt_bytes, round_up

log = logging.getLogger("graphkit.saver")

GRAPHS = "graphs"


@runtime_checkable
class Sleeper(Protocol):
    """What a :class:`MemorySaver` pauses and resumes under a tag.

    :class:`graphkit.SharedVMMAllocator` (graph memory), :class:`graphkit.ElasticBuffer`
    and the saver's own regions implement it. Both calls are idempotent and
    all or nothing; where a rollback itself fails, :attr:`paused` stays true
    (part of the memory is gone) so that nothing uses it before a restore.
    """

    backup: bool  # whether a pause copies the bytes to the host and a restore copies them back

    @property
    def paused(self) -> bool:
        """Whether any of its memory is released or unmapped."""
        ...

    @property
    def footprint_bytes(self) -> int:
        """Physical bytes it holds while awake (what a pause releases)."""
        ...

    def release_physical(self) -> int:
        """Unmap and release its physical memory (backing it up first where it keeps a backup); the bytes released."""
        ...

    def restore_physical(self, restore: bool = True) -> None:
        """Map fresh memory at the same addresses (and copy the backup back, unless ``restore`` is false)."""
        ...


@dataclass(eq=False)
class _Segment:
    """One segment handed to the framework: its own range and, while awake, its own chunk."""

    ptr: int
    size: int
    handle: Any = None  # its chunk; None once released while paused
    mapped: bool = True


@dataclass(eq=False)
class _Region:
    """The memory of one tag made through :meth:`MemorySaver.region`: a :class:`Sleeper`."""

    tag: str
    backup: bool
    backend: hal.Backend
    zombies: list[Any]  # the saver's chunks to release later
    pin: bool = True
    pool: Any = None
    segments: dict[int, _Segment] = field(default_factory=dict)
    host: dict[int, torch.Tensor] = field(default_factory=dict)  # segment ptr -> backup, reused every pause
    blocks: int = 0  # region() blocks open on it (any thread)
    sleeping: bool = False
    backed_up: bool = False
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
                self.host[s.ptr] = torch.empty(s.size, dtype=torch.uint8, pin_memory=self.pinned)
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

    def release_physical(self) -> int:
        be = self.backend
        segments = list(self.segments.values())
        if self.backup and not self.backed_up:  # every copy first, then every unmap: never a copy racing its unmap
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

    def _map(self, s: _Segment) -> None:
        self.backend.map(s.ptr, s.size, s.handle)
        s.mapped = True

    def _unmap(self, s: _Segment) -> None:
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
        self.backed_up = False

    def _drop_chunk(self, s: _Segment) -> None:
        if s.mapped:  # an unmap of the rollback failed: the chunk stays with its mapping
            return
        handle, s.handle = s.handle, None
        release_or_keep(self.backend, handle, self.zombies)


@dataclass
class TagReport:
    """The state of one tag."""

    tag: str
    paused: bool
    backup: bool
    bytes: int  # virtual bytes the tag covers (its physical memory while awake)
    host_bytes: int  # host memory holding its backup
    last_pause_s: float | None = None
    last_resume_s: float | None = None
    pin_s: float = 0.0  # time spent making its backup buffers (pinned host memory), mostly off the pause path


class MemorySaver(Closable):
    """Tags of device memory that pause (release physical memory) and resume (at the same addresses).

    :param backend: a :class:`hal.Backend` (default ``hal.get_backend()``, then owned).
    :param pin_backups: keep backups in pinned host memory where the device
        has it (the copies then run at the bus's speed); ``False`` for
        pageable memory.

    Each tag holds one or more :class:`Sleeper` objects; a pause or resume
    of a tag is all or nothing across them. Code that must not run while a
    tag sleeps (a graph replay) holds :meth:`awake` around it, and a pause
    waits for those blocks to end.
    """

    def __init__(self, backend: hal.Backend | None = None, *, pin_backups: bool = True) -> None:
        if backend is not None and not isinstance(backend, hal.Backend):
            raise hal.InvalidArgumentError(f"backend={backend!r} must be a hal.Backend (hal.get_backend(...))",
                                           call="MemorySaver")
        self._owns_backend = backend is None
        self.backend = backend if backend is not None else hal.get_backend(
            requires=("graphs", "custom_pool", "use_pool"))  # regions need pools the framework allocates from
        self.pin_backups = pin_backups
        self._lock = threading.RLock()
        self._regions: dict[str, _Region] = {}
        self._sleepers: dict[str, list[Sleeper]] = {}  # tag -> graphkit objects that sleep (allocators, buffers)
        self._paused: set[str] = set()
        self._times: dict[str, tuple[float | None, float | None]] = {}
        self._zombies: list[Any] = []  # chunks whose release failed: released later
        self._dead_segments: list[_Segment] = []  # segments whose teardown failed half-way: finished later
        self._guard = threading.Condition(threading.Lock())
        self._users: dict[str, int] = {}  # tag -> awake() blocks running now
        self._pausing: collections.Counter[str] = collections.Counter()  # tags with a pause under way
        self._mine = threading.local()  # tags this thread holds awake() on
        self._closed = False

    # -- tags -------------------------------------------------------------------------------

    def _bad(self, message: str, call: str) -> hal.InvalidArgumentError:
        return hal.InvalidArgumentError(message, backend=self.backend.name, call=f"MemorySaver.{call}")

    def _check_tag(self, tag: Any, call: str) -> str:
        if not isinstance(tag, str) or not tag:
            raise self._bad(f"tag={tag!r} must be a non-empty str", call)
        return tag

    @property
    def closed(self) -> bool:
        return self._closed

    @contextlib.contextmanager
    def region(self, tag: str, backup: bool = False) -> Iterator[None]:
        """Framework allocations made inside the block (this thread) live in memory of ``tag``.

        :param backup: copy the tag's bytes to the host on pause and back on
            resume (weights); without it a resumed tag holds garbage (a KV
            cache, activations).
        :raises hal.UnsupportedError: the backend cannot direct the
            framework's allocations to a pool (capability ``"use_pool"``,
            e.g. torch_mlu); graphkit's own memory still sleeps there.

        A tag cannot pause while a block of it is open (in any thread): the
        framework may hand out cached memory of the region without asking
        graphkit, memory a pause would have unmapped.
        """
        tag = self._check_tag(tag, "region")
        if not isinstance(backup, bool):
            raise self._bad(f"backup={backup!r} must be a bool", "region")
        with self._lock:
            self._check_open("region")
            if tag in self._sleepers:
                raise self._bad(f"tag={tag!r} already holds graph memory; use another tag", "region")
            if not self.backend.supports("use_pool") or not self.backend.supports("custom_pool"):
                raise hal.UnsupportedError(
                    "regions need pools over allocator callbacks that the framework allocates from "
                    "(capabilities 'custom_pool' and 'use_pool')", backend=self.backend.name, call="MemorySaver.region")
            region = self._regions.get(tag)
            if region is None:
                made = _Region(tag, backup, self.backend, self._zombies, self.pin_backups)
                made.pool = self.backend.create_pool(lambda n: self._alloc(made, n),
                                                     lambda p, n: self._free(made, p))
                region = self._regions[tag] = made  # only once its pool exists
            elif region.backup != backup:
                raise self._bad(f"tag={tag!r} was made with backup={region.backup}", "region")
            if tag in self._paused:
                raise hal.InvalidStateError(f"tag {tag!r} is paused: resume it before allocating in it",
                                            backend=self.backend.name, call="MemorySaver.region")
            region.blocks += 1
        try:
            with self.backend.use_pool(region.pool):
                yield
        finally:
            with self._lock:
                region.blocks -= 1
                if region.backup and not region.blocks and tag not in self._paused:
                    region.prepare_in_background()  # the first pause then only copies

    def _alloc(self, region: _Region, nbytes: int) -> int:
        """A segment of its own for the framework: a range, one chunk, mapped (all or nothing)."""
        be = self.backend
        with self._lock:
            if region.tag in self._paused or region.sleeping:
                raise hal.InvalidStateError(f"tag {region.tag!r} is paused", backend=be.name, call="MemorySaver")
            size = round_up(max(nbytes, 1), be.granularity)
            self._retry()
            with Transaction() as tx:
                ptr = be.create_vir_ptr(size)
                tx.append(lambda: self._release_range(ptr, size))
                handle = be.create_phy_mem_handle(size)
                tx.append(functools.partial(self._release_chunk, handle))
                be.map(ptr, size, handle)
                tx.commit()
            region.segments[ptr] = _Segment(ptr, size, handle, mapped=True)
            return ptr

    def _release_chunk(self, handle: Any) -> None:
        release_or_keep(self.backend, handle, self._zombies)

    def _release_range(self, ptr: int, size: int) -> None:
        try:
            self.backend.release_vir_ptr(ptr, size)
        except hal.HalError as exc:  # kept as an empty segment: released by the next retry
            log.warning("a range could not be released yet (retried later): %s", str(exc))
            self._dead_segments.append(_Segment(ptr, size, None, mapped=False))

    def _retry(self) -> None:
        """Finish what failed before: chunks to release, segments half torn down."""
        retry_releases(self.backend, self._zombies)
        dead, self._dead_segments = self._dead_segments, []
        for segment in dead:
            self._tear_down(segment)

    def _tear_down(self, segment: _Segment) -> bool:
        """Unmap, release the chunk, free the range; a step that fails is kept and retried later."""
        be = self.backend
        try:
            if segment.mapped:
                be.unmap(segment.ptr, segment.size)
                segment.mapped = False
            if segment.handle is not None:
                handle, segment.handle = segment.handle, None
                release_or_keep(be, handle, self._zombies)
            be.release_vir_ptr(segment.ptr, segment.size)
        except hal.HalError as exc:
            log.warning("a freed segment could not be torn down yet (retried later): %s", str(exc))
            self._dead_segments.append(segment)
            return False
        return True

    def _free(self, region: _Region, ptr: int) -> None:
        with self._lock:
            segment = region.segments.pop(ptr, None)
            region.host.pop(ptr, None)
            if segment is None or self.backend.closed:
                return
            self._tear_down(segment)

    def check_adoptable(self, tag: Any, call: str) -> str:
        """Raise :class:`hal.InvalidArgumentError` unless graphkit memory can sleep under ``tag``; the tag."""
        tag = self._check_tag(tag, "adopt")
        with self._lock:
            self._check_open("adopt")
            if tag in self._regions:
                raise hal.InvalidArgumentError(f"tag={tag!r} is a region; graphkit memory needs a tag of its own",
                                               backend=self.backend.name, call=call)
        return tag

    def adopt(self, sleeper: Sleeper, tag: str = GRAPHS) -> None:
        """Put graphkit's own memory under ``tag``: a :class:`SharedVMMAllocator` (graph memory, no
        backup) or an :class:`graphkit.ElasticBuffer` (backed up if it was made with ``backup``);
        anything that implements :class:`Sleeper`. Released now if the tag is paused."""
        if not isinstance(sleeper, Sleeper):
            raise self._bad(f"{sleeper!r} cannot sleep: it needs release_physical(), restore_physical(), "
                            "paused, footprint_bytes and backup", "adopt")
        tag = self.check_adoptable(tag, "MemorySaver.adopt")
        with self._lock:
            self._check_open("adopt")
            if tag in self._paused and not sleeper.paused:
                sleeper.release_physical()
            sleepers = self._sleepers.setdefault(tag, [])
            if not any(s is sleeper for s in sleepers):
                sleepers.append(sleeper)

    def forget(self, sleeper: Sleeper) -> None:
        """Stop managing ``sleeper`` (its owner closes it)."""
        with self._lock:
            for sleepers in self._sleepers.values():
                sleepers[:] = [s for s in sleepers if s is not sleeper]

    def check_awake(self, tag: str, call: str) -> None:
        """Raise :class:`hal.InvalidStateError` when ``tag`` is paused.

        A check, not a guard: a pause may start right after it returns. Hold
        :meth:`awake` around code that must not overlap a pause.
        """
        tag = self._check_tag(tag, "check_awake")
        if tag in self._paused:
            raise hal.InvalidStateError(self._paused_message(tag), backend=self.backend.name, call=call)

    def _paused_message(self, tag: str) -> str:
        return f"tag {tag!r} is paused: resume it first"

    @contextlib.contextmanager
    def awake(self, tag: str, call: str = "MemorySaver.awake") -> Iterator[None]:
        """A block during which ``tag`` stays awake: a pause of it waits for the block to end.

        Keep it short (one replay). :raises hal.InvalidStateError: ``tag`` is
        paused (the pause was first).
        """
        tag = self._check_tag(tag, "awake")
        with self._guard:
            self._guard.wait_for(lambda: self._pausing[tag] <= 0 or tag in self._held())
            if tag in self._paused:
                raise hal.InvalidStateError(self._paused_message(tag), backend=self.backend.name, call=call)
            self._users[tag] = self._users.get(tag, 0) + 1
        held = self._held()
        held.append(tag)
        try:
            yield
        finally:
            held.remove(tag)
            with self._guard:
                self._users[tag] -= 1
                self._guard.notify_all()

    def _held(self) -> list[str]:
        held = getattr(self._mine, "tags", None)
        if held is None:
            held = self._mine.tags = []
        return held

    @property
    def tags(self) -> list[str]:
        return [*self._regions, *self._sleepers]

    def is_paused(self, tag: str) -> bool:
        """Whether ``tag`` is paused (also: part of it stayed released after a pause or resume failed)."""
        return self._check_tag(tag, "is_paused") in self._paused

    def _select(self, tags: tuple[str, ...], call: str) -> list[str]:
        for tag in tags:
            self._check_tag(tag, call)
        known = self.tags
        unknown = [t for t in tags if t not in known]
        if unknown:
            raise self._bad(f"tags {unknown!r} are unknown (known: {known!r})", call)
        return list(dict.fromkeys(tags)) if tags else known

    def _members(self, tag: str) -> list[Sleeper]:
        region = self._regions.get(tag)
        return [region] if region is not None else list(self._sleepers.get(tag, []))

    # -- pause and resume --------------------------------------------------------------------

    def pause(self, *tags: str) -> int:
        """Release the physical memory of ``tags`` (all when none), backing up those made with backup.

        Idempotent per tag; all or nothing per tag. Returns the bytes
        released. Waits for :meth:`awake` blocks of the tags (runner calls)
        to end. Framework tensors of a paused tag must not be touched until
        it resumes.

        :raises hal.InvalidStateError: a :meth:`region` block of a tag is
            open, or this thread is inside an :meth:`awake` block of one.
        """
        with self._lock:
            self._check_open("pause")
            todo = self._select(tags, "pause")  # paused tags too: what a failed pause left mapped goes now
            self._check_pausable(todo)
            with self._guard:
                self._pausing.update(todo)
        try:
            # runner calls under way finish first (without the saver's lock: one may need it to allocate);
            # new ones wait, then see the tag paused
            with self._guard:
                self._guard.wait_for(lambda: not any(self._users.get(t, 0) for t in todo))
            with self._lock:
                self._check_open("pause")
                self._check_pausable(todo)
                self.backend.synchronize()
                if GRAPHS in todo:
                    _warn_nccl_graph_register()
                released = 0
                was_paused = {tag: tag in self._paused for tag in todo}
                for tag in todo:
                    t0 = time.perf_counter()
                    freed = self._pause_tag(tag)
                    released += freed
                    if freed or not was_paused[tag]:
                        self._times[tag] = (time.perf_counter() - t0, self._times.get(tag, (None, None))[1])
                        log.info("paused %r: %s released", tag, fmt_bytes(freed))
                return released
        finally:
            with self._guard:
                self._pausing.subtract(todo)
                self._guard.notify_all()

    def _check_pausable(self, tags: list[str]) -> None:
        for tag in tags:
            region = self._regions.get(tag)
            if region is not None and region.blocks:
                raise hal.InvalidStateError(
                    f"tag {tag!r} has a region() block open: leave it before pausing (the framework may "
                    "still hand out the region's memory inside it)", backend=self.backend.name,
                    call="MemorySaver.pause")
            if tag in self._held():
                raise hal.InvalidStateError(f"this thread is inside an awake({tag!r}) block: it cannot pause "
                                            "that tag", backend=self.backend.name, call="MemorySaver.pause")

    def _pause_tag(self, tag: str) -> int:
        """Release every sleeper of ``tag``, or none: a failure restores those released by this call."""
        members = self._members(tag)
        done: list[Sleeper] = []
        released = 0
        try:
            for sleeper in members:
                released += sleeper.release_physical()
                done.append(sleeper)
        except BaseException:
            for sleeper in reversed(done):
                try:
                    sleeper.restore_physical()
                except Exception as exc:  # noqa: BLE001 - the tag then stays paused, exactly as it is
                    log.error("pause %r failed and could not be rolled back fully (the tag stays paused; "
                              "resume it): %s", tag, str(exc))
            if any(s.paused for s in members):
                self._paused.add(tag)  # part of it is released: nothing may use it before a resume
            raise
        self._paused.add(tag)
        return released

    def resume(self, *tags: str, restore: bool = True) -> None:
        """Map new physical memory at the same addresses for ``tags`` (all when none); restore backups.

        Idempotent per tag. All or nothing per tag: a failure (out of
        memory, a driver fault) releases what it made, the tag stays paused,
        and resume can be called again.

        :param restore: ``False`` maps the memory back without copying the
            backups in: for weights about to be overwritten (an RL loop's
            weight update), which saves a host-to-device copy of the whole
            model. The backup buffers stay for the next pause.
        """
        if not isinstance(restore, bool):
            raise self._bad(f"restore={restore!r} must be a bool", "resume")
        with self._lock:
            self._check_open("resume")
            for tag in self._select(tags, "resume"):
                if tag not in self._paused:
                    continue
                t0 = time.perf_counter()
                members = self._members(tag)
                done: list[Sleeper] = []
                try:
                    for sleeper in members:
                        if sleeper.paused:
                            sleeper.restore_physical(restore=restore)
                            done.append(sleeper)
                except BaseException:
                    for sleeper in reversed(done):
                        try:
                            sleeper.release_physical()
                        except Exception as exc:  # noqa: BLE001 - the tag stays paused whatever is left
                            log.error("resume %r failed and could not be rolled back fully: %s", tag, str(exc))
                    raise
                self._paused.discard(tag)
                self._times[tag] = (self._times.get(tag, (None, None))[0], time.perf_counter() - t0)
            self.backend.synchronize()

    # -- figures and teardown -----------------------------------------------------------------

    def report(self) -> list[TagReport]:
        """Each tag: paused or not, its bytes, its host backup, the last pause and resume seconds."""
        with self._lock:
            out = []
            for tag in self.tags:
                pause_s, resume_s = self._times.get(tag, (None, None))
                members = self._members(tag)
                size = sum(s.footprint_bytes for s in members)
                host = sum(int(getattr(s, "host_bytes", 0)) for s in members)
                backup = any(s.backup for s in members)
                pin_s = sum(float(getattr(s, "pin_seconds", 0.0)) for s in members)
                out.append(TagReport(tag, tag in self._paused, backup, size, host, pause_s, resume_s, pin_s))
            return out

    def _check_open(self, call: str) -> None:
        if self._closed:
            raise hal.InvalidStateError("the MemorySaver is closed", backend=self.backend.name,
                                        call=f"MemorySaver.{call}")

    def close(self) -> None:
        """Resume nothing; release the regions' pools (their memory goes when the framework frees it). Idempotent.

        Goes on past failures and raises the first; ``close()`` again finishes.
        """
        with self._lock:
            if self._closed:
                return
            errors: list[BaseException] = []
            for region in self._regions.values():
                if region.pool is None:
                    continue
                try:
                    self.backend.release_pool(region.pool)
                except hal.HalError as exc:
                    errors.append(exc)
                else:
                    region.pool = None
            self._retry()
            if errors or self._zombies or self._dead_segments:
                first = errors[0] if errors else hal.InvalidStateError(
                    f"{len(self._zombies)} chunk(s) and {len(self._dead_segments)} segment(s) could not be "
                    "released yet", backend=self.backend.name, call="MemorySaver.close")
                log.error("MemorySaver.close: a step failed; close() again to finish: %s", str(first))
                raise first
            self._closed = True
            self._sleepers.clear()
            if self._owns_backend:
                self.backend.close()


def _nccl_graph_register_hazard() -> str | None:
    """Why sleeping graph memory may break NCCL collectives captured in graphs, or None.

    With ``NCCL_GRAPH_REGISTER`` on (NCCL's default), a collective captured in
    a graph registers its buffers by virtual address and keeps the physical
    pages they had at capture; a resume maps other pages at that address.
    """
    import os

    if os.environ.get("NCCL_GRAPH_REGISTER", "1") == "0":
        return None
    try:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return None
        uses_nccl = "nccl" in str(dist.get_backend()).lower()
    except (ImportError, RuntimeError, ValueError):
        return None
    if not uses_nccl:
        return None
    return ("pausing graph memory while torch.distributed uses NCCL with NCCL_GRAPH_REGISTER on: collectives "
            "captured in these graphs may keep moving data through the pages released now; set "
            "NCCL_GRAPH_REGISTER=0 before the graphs are captured (as vLLM does for its sleep mode)")


_nccl_warned = False


def _warn_nccl_graph_register() -> None:
    """Log the NCCL graph-registration hazard once per process, where it applies."""
    global _nccl_warned
    why = None if _nccl_warned else _nccl_graph_register_hazard()
    if why is not None:
        _nccl_warned = True
        log.warning("%s", why)
