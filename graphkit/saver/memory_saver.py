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
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import hal
from graphkit.memory.backing import waited_for_device
from graphkit.memory.closing import Closable, after_backend, raise_first_failure
from graphkit.memory.host_backup import HostBacked
from graphkit.saver.nccl import warn_graph_register
from graphkit.saver.regions import Region, RegionMemory
from hal.transaction import Transaction
from hal.types import fmt_bytes

log = logging.getLogger(__name__)

GRAPHS = "graphs"


@dataclass
class TagReport:
    """The state of one tag."""

    tag: str
    paused: bool
    backup: bool
    footprint_bytes: int  # physical bytes the tag holds while awake (what a pause releases), paused or not
    host_bytes: int  # host memory holding its backup
    last_pause_s: float | None = None
    last_resume_s: float | None = None
    pin_s: float = 0.0  # time spent making its backup buffers (pinned host memory), mostly off the pause path

    def __str__(self) -> str:
        def seconds(value: float | None) -> str:
            return "-" if value is None else f"{value * 1e3:.1f} ms"

        backup = (f"host backup {fmt_bytes(self.host_bytes)} (pinned in {self.pin_s:.2f} s)" if self.backup
                  else "no backup")
        return (f"{self.tag:>12}  {'paused' if self.paused else 'awake':<6}  {fmt_bytes(self.footprint_bytes):>10}  "
                f"last pause {seconds(self.last_pause_s):>9}  resume {seconds(self.last_resume_s):>9}  {backup}")



def _tag_report(tag: str, members: list[Sleeper], paused: bool,
                times: tuple[float | None, float | None]) -> TagReport:
    """The report of ``tag`` over the sleepers it holds."""
    return TagReport(tag, paused, any(s.backup for s in members), sum(s.footprint_bytes for s in members),
                     sum(int(getattr(s, "host_bytes", 0)) for s in members), *times,
                     sum(float(getattr(s, "pin_seconds", 0.0)) for s in members))

class SaverReport(list[TagReport]):
    """What :meth:`MemorySaver.report` returns: the list of each tag's :class:`TagReport` (index it, iterate
    it), printed as a table with a header line, as the pools' and the runners' reports print."""

    def __init__(self, backend: str, tags: list[TagReport]) -> None:
        super().__init__(tags)
        self.backend = backend

    @property
    def footprint_bytes(self) -> int:
        """Device memory the tags hold while awake (what a pause of every tag gives back)."""
        return sum(r.footprint_bytes for r in self)

    def __str__(self) -> str:
        paused = sum(r.paused for r in self)
        header = (f"memory saver on {self.backend}: {len(self)} tag(s), {paused} paused; "
                  f"{fmt_bytes(self.footprint_bytes)} of device memory while awake, host backups "
                  f"{fmt_bytes(sum(r.host_bytes for r in self))}")
        lines = [header, *(f"  {r}" for r in self)]
        return "\n".join(lines)


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

    def release_physical(self, *, keep_backup: bool = False) -> int:
        """Unmap and release its physical memory (backing it up first where it keeps a backup); the bytes released.

        ``keep_backup=True`` is the rollback of a failed resume (of another sleeper of the tag): the backup the
        last pause made is still what the memory must wake with, so nothing is copied and it is kept.
        """
        ...

    def restore_physical(self, restore: bool = True) -> None:
        """Map fresh memory at the same addresses (and copy the backup back, unless ``restore`` is false)."""
        ...


def _back_to_sleep(sleeper: Sleeper) -> None:
    """Undo of a sleeper's resume: released again, with the backup of the pause it woke from (the fresh memory
    holds nothing of value)."""
    if sleeper.backup:
        sleeper.release_physical(keep_backup=True)
    else:
        sleeper.release_physical()


class _AwakeGuard:
    """Blocks that keep a tag awake and the pauses that wait for them: neither starts while the other runs.

    A pause marks its tags first, so that new blocks wait for it instead of
    starving it; a thread already holding a tag may hold it again.

    **Never a deadlock**: a wait that would close a circle of threads each
    waiting for the next (thread 1 inside ``awake("a")`` pauses ``"b"`` while
    thread 2 inside ``awake("b")`` pauses ``"a"``; or a pause of ``"a", "b"``
    waiting for a block of ``"a"`` whose thread opens a block of ``"b"``) is
    refused with :class:`hal.InvalidStateError` in the thread that would close
    it; the other threads go on once it has left its blocks.
    """

    def __init__(self, refused: Callable[[str, str], hal.HalError]) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._users: dict[str, int] = {}  # tag -> awake() blocks running now
        self._pausing: collections.Counter[str] = collections.Counter()  # tags with a pause under way
        self._held: dict[int, list[str]] = {}  # thread -> the tags it holds awake now (repeated when nested)
        self._pausers: dict[int, list[str]] = {}  # thread -> the tags of its pause under way
        self._waits: dict[int, tuple[str, list[str]]] = {}  # thread -> ("release" | "hold", the tags it waits on)
        self._refused = refused  # (call, why) -> the error to raise

    def held(self) -> list[str]:
        """The tags this thread holds awake now."""
        return list(self._held.get(threading.get_ident(), ()))

    def _waited_on(self, thread: int) -> set[int]:
        """The threads ``thread`` waits for now: holders of the tags its pause waits on, or the pausers of the
        tag its awake block waits to hold."""
        wait = self._waits.get(thread)
        if wait is None:
            return set()
        what, tags = wait
        owners = self._held if what == "release" else self._pausers
        return {t for t, mine in owners.items() if t != thread and any(tag in mine for tag in tags)}

    def _closes_circle(self, me: int) -> bool:
        """Whether a thread this one waits for waits, through others, for this one."""
        seen, todo = {me}, list(self._waited_on(me))
        while todo:
            thread = todo.pop()
            if thread == me:
                return True
            if thread not in seen:
                seen.add(thread)
                todo.extend(self._waited_on(thread))
        return False

    def _wait(self, me: int, what: str, tags: list[str], done: Callable[[], bool], call: str) -> None:
        """Wait (the condition held) until ``done()``; refuse a wait that would close a circle of waits."""
        if done():
            return
        self._waits[me] = (what, tags)
        self._cond.notify_all()  # a waiting thread looks again: this wait may close its circle
        try:
            while not done():
                if self._closes_circle(me):
                    held = ", ".join(repr(t) for t in dict.fromkeys(self._held.get(me, ()))) or "none"
                    raise self._refused(call, f"waiting for {', '.join(map(repr, tags))} here would deadlock: this "
                                              f"thread holds awake block(s) of {held}, and another thread waits for "
                                              "them while holding what this one waits for; pause outside awake() "
                                              "blocks (or pause the other tag from the thread that holds it)")
                self._cond.wait()
        finally:
            del self._waits[me]

    @contextlib.contextmanager
    def hold(self, tag: str, refuse: Callable[[], None]) -> Iterator[None]:
        """Hold ``tag`` awake for the block, once no pause of it is under way; ``refuse()`` runs then and may raise."""
        me = threading.get_ident()
        with self._cond:
            with Transaction() as tx:
                held = self._held.setdefault(me, [])
                tx.append(functools.partial(self._forget_holder, me))
                self._wait(me, "hold", [tag], lambda: self._pausing[tag] <= 0 or tag in held, "MemorySaver.awake")
                refuse()
                tx.commit()
            self._users[tag] = self._users.get(tag, 0) + 1
            held.append(tag)
        try:
            yield
        finally:
            with self._cond:
                held.remove(tag)
                self._forget_holder(me)
                self._users[tag] -= 1
                self._cond.notify_all()

    def _forget_holder(self, me: int) -> None:
        """Thread ``me`` holds no tag awake any more: its entry goes (it stays while it holds one)."""
        if not self._held.get(me):
            self._held.pop(me, None)

    def begin_pause(self, tags: list[str]) -> None:
        """Mark ``tags`` as pausing: new blocks of them wait until :meth:`end_pause`."""
        with self._cond:
            self._pausing.update(tags)
            self._pausers[threading.get_ident()] = list(tags)

    def wait_released(self, tags: list[str]) -> None:
        """Wait until no block holds any of ``tags``; :class:`hal.InvalidStateError` where that would deadlock."""
        with self._cond:
            self._wait(threading.get_ident(), "release", tags,
                       lambda: not any(self._users.get(t, 0) for t in tags), "MemorySaver.pause")

    def end_pause(self, tags: list[str]) -> None:
        """The pause of ``tags`` is over (done or failed): waiting blocks go on."""
        with self._cond:
            self._pausing.subtract(tags)
            self._pausers.pop(threading.get_ident(), None)
            self._cond.notify_all()


#: every saver of this process not closed yet (for :func:`saver_holding`)
_open_savers: weakref.WeakSet[MemorySaver] = weakref.WeakSet()


def saver_holding(sleeper: object) -> tuple[MemorySaver, str] | None:
    """The open saver that holds ``sleeper`` (an allocator, a buffer) and its tag, or None."""
    for saver in list(_open_savers):
        tag = saver.tag_of(sleeper)
        if tag is not None:
            return saver, tag
    return None


class MemorySaver(Closable):
    """Tags of device memory that pause (release physical memory) and resume (at the same addresses).

    :param backend: a :class:`hal.Backend` (default ``hal.get_backend()``, then owned).
    :param pin_backups: keep backups in pinned host memory where the device has it (the copies then run at
        the bus's speed); ``False`` for pageable memory.

    Each tag holds one or more :class:`Sleeper` objects; a pause or resume of a tag is all or nothing across
    them. Code that must not run while a tag sleeps (a graph replay) holds :meth:`awake` around it, and a
    pause waits for those blocks to end.
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
        self._paused: set[str] = set()
        self._memory = RegionMemory(self.backend, pin_backups)  # what region() hands out
        self._sleepers: dict[str, list[Sleeper]] = {}  # tag -> graphkit objects that sleep (allocators, buffers)
        self._times: dict[str, tuple[float | None, float | None]] = {}
        self._guard = _AwakeGuard(
            lambda call, why: hal.InvalidStateError(why, backend=self.backend.name, call=call))
        self._closed = False
        _open_savers.add(self)

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

    @property
    def _regions(self) -> dict[str, Region]:
        """Tag -> its region (read only)."""
        return self._memory.regions

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
            region = self._memory.enter(tag, backup)
        try:
            with self.backend.use_pool(region.pool):
                yield
        finally:
            self._memory.leave(region)

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

    def tag_of(self, sleeper: object) -> str | None:
        """The tag that holds ``sleeper``, or None."""
        with self._lock:
            return next((tag for tag, members in self._sleepers.items() if any(m is sleeper for m in members)), None)

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
        self._refuse_paused(self._check_tag(tag, "check_awake"), call)

    def _refuse_paused(self, tag: str, call: str) -> None:
        if tag in self._paused:
            raise hal.InvalidStateError(f"tag {tag!r} is paused: resume it first", backend=self.backend.name,
                                        call=call)

    @contextlib.contextmanager
    def awake(self, tag: str, call: str = "MemorySaver.awake") -> Iterator[None]:
        """A block during which ``tag`` stays awake: a pause of it waits for the block to end.

        Keep it short (one replay). :raises hal.InvalidStateError: ``tag`` is
        paused (the pause was first), or waiting for a pause of it under way would deadlock (that pause waits for
        a block this thread holds).
        """
        tag = self._check_tag(tag, "awake")
        with self._guard.hold(tag, lambda: self._refuse_paused(tag, call)):
            yield

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

    def wait_for_backups(self, *tags: str) -> None:
        """Wait for the host backups of ``tags`` (default: all) made in the background (after a ``region(...,
        backup=True)`` block, as an elastic buffer grows): the first pause then only copies."""
        with self._lock:
            members = [s for tag in self._select(tags, "wait_for_backups") for s in self._members(tag)]
        for sleeper in members:
            if isinstance(sleeper, HostBacked):
                sleeper.wait_for_backup()

    def _members(self, tag: str) -> list[Sleeper]:
        region = self._regions.get(tag)
        return [region] if region is not None else list(self._sleepers.get(tag, []))

    # -- pause and resume --------------------------------------------------------------------

    def pause(self, *tags: str) -> int:
        """Release the physical memory of ``tags`` (all when none), backing up those made with backup.

        Idempotent per tag; all or nothing per tag. Returns the bytes released. Waits for :meth:`awake` blocks
        of the tags (runner calls) to end. Framework tensors of a paused tag must not be touched until it resumes.

        :raises hal.InvalidStateError: a :meth:`region` block of a tag is
            open, or this thread is inside an :meth:`awake` block of one; or
            waiting would deadlock: this thread holds an awake block that
            another thread, itself holding a block of these tags, waits for
            (each pausing the other's tag) -- that pause is refused, and the
            other goes on once this thread leaves its blocks.
        """
        with self._lock:
            self._check_open("pause")
            todo = self._select(tags, "pause")  # paused tags too: what a failed pause left mapped goes now
            self._check_pausable(todo)
            self._guard.begin_pause(todo)
        try:
            # runner calls under way finish first (without the saver's lock: one may need it to allocate);
            # new ones wait, then see the tag paused
            self._guard.wait_released(todo)
            with self._lock:
                self._check_open("pause")
                self._check_pausable(todo)
                self.backend.synchronize()  # one wait for every tag: under the lock nothing new reaches their memory
                if GRAPHS in todo:
                    warn_graph_register()
                released = 0
                with waited_for_device(self.backend):
                    for tag in todo:
                        was_paused = tag in self._paused
                        t0 = time.perf_counter()
                        freed = self._pause_tag(tag)
                        released += freed
                        if freed or not was_paused:
                            self._times[tag] = (time.perf_counter() - t0, self._times.get(tag, (None, None))[1])
                            log.info("paused %r: %s released", tag, fmt_bytes(freed))
                return released
        finally:
            self._guard.end_pause(todo)

    def _check_pausable(self, tags: list[str]) -> None:
        for tag in tags:
            region = self._regions.get(tag)
            if region is not None and region.blocks:
                raise hal.InvalidStateError(
                    f"tag {tag!r} has a region() block open: leave it before pausing (the framework may "
                    "still hand out the region's memory inside it)", backend=self.backend.name,
                    call="MemorySaver.pause")
            if tag in self._guard.held():
                raise hal.InvalidStateError(f"this thread is inside an awake({tag!r}) block: it cannot pause "
                                            "that tag", backend=self.backend.name, call="MemorySaver.pause")

    def _pause_tag(self, tag: str) -> int:
        """Release every sleeper of ``tag``, or none: a failure restores those released by this call."""
        members = self._members(tag)
        released = 0
        try:
            with Transaction() as tx:  # a failure restores those released by this call
                for sleeper in members:
                    released += sleeper.release_physical()
                    tx.append(sleeper.restore_physical)
                tx.commit()
        except BaseException:  # not an undo: records a tag its rollback left part released, then re-raises
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
                self._resume_tag(tag, restore)
                self._times[tag] = (self._times.get(tag, (None, None))[0], time.perf_counter() - t0)

    def _resume_tag(self, tag: str, restore: bool) -> None:
        """Restore every paused sleeper of ``tag``, or none: a failure releases those restored by this call."""
        with Transaction() as tx:  # a failure puts those restored by this call back to sleep
            for sleeper in self._members(tag):
                if sleeper.paused:
                    sleeper.restore_physical(restore=restore)
                    tx.append(functools.partial(_back_to_sleep, sleeper))
            self.backend.synchronize()  # the tag reads awake once its memory is: a failure here rolls it back too
            tx.commit()
        self._paused.discard(tag)

    # -- figures and teardown -----------------------------------------------------------------

    def report(self) -> SaverReport:
        """Each tag: paused or not, its footprint, its host backup, the last pause and resume seconds (a list of
        :class:`TagReport` that prints as a table)."""
        with self._lock:
            return SaverReport(self.backend.name, [
                _tag_report(tag, self._members(tag), tag in self._paused, self._times.get(tag, (None, None)))
                for tag in self.tags])

    def _check_open(self, call: str) -> None:
        if self._closed:
            raise hal.InvalidStateError("the MemorySaver is closed", backend=self.backend.name,
                                        call=f"MemorySaver.{call}")

    def close(self) -> None:
        """Resume nothing; release the regions' pools (their memory goes when the framework frees it), each segment
        after the device's queued work. Idempotent; goes on past failures and raises the first; ``close()`` again
        finishes (after the backend's, it only forgets)."""
        with self._lock:
            if self._closed:
                return
            if not after_backend(self.backend, log, "MemorySaver"):  # else its close released the regions' pools
                raise_first_failure(log, self._memory.close(), "MemorySaver.close")
            self._closed = True
            _open_savers.discard(self)
            self._sleepers.clear()
            if self._owns_backend:
                self.backend.close()
