"""The keys of a :class:`graphkit.GraphPools` and the handles capture APIs take for them.

:class:`PoolKeys` is the table: each key's :class:`KeyPool` (the key, the
lease its pool strategy gave -- the backend pool, and for ``vmm`` its virtual
space -- and the :class:`PoolHandle` engines pass as ``pool=``), under one
lock. :class:`CaptureKey` is the key :func:`graphkit.graph_memory` makes for a
capture outside any group.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Protocol, TypeVar

import hal
from graphkit.graphs.strategies import Lease, PoolStrategy
from graphkit.memory.allocator import SharedVMMAllocator
from graphkit.memory.closing import close_step
from graphkit.memory.survivors import checked_blocks
from hal.transaction import Transaction

log = logging.getLogger(__name__)

_serial = itertools.count(1)  # made-up pool ids, unique in the process
T = TypeVar("T")


class CaptureKey(tuple):
    """The key :func:`graph_memory` gives a capture outside any group: ``('capture', n)``.

    It prints like the tuple but equals only another :class:`CaptureKey`:
    an engine's own key ``('capture', 1)`` never meets it.
    """

    automatic = True  # a key graphkit chose: reports print it as ``capture N``

    def __new__(cls, serial: int) -> CaptureKey:
        return super().__new__(cls, ("capture", serial))

    def __str__(self) -> str:
        return f"capture {self[1]}"

    def __eq__(self, other: object) -> bool:
        return type(other) is CaptureKey and tuple.__eq__(self, other)

    def __ne__(self, other: object) -> bool:
        return not self == other

    def __hash__(self) -> int:
        return hash((CaptureKey, tuple(self)))


class PoolHandle(tuple):
    """The pool of one key of a :class:`GraphPools`, in the form capture APIs take.

    A tuple equal to the framework's pool id (what ``torch.cuda.graph(pool=...)``
    and ``graph.pool()`` deal in) that also keeps its :class:`GraphPools`
    alive. Once the key is released or the pools closed, reading it --
    which every capture API does -- raises :class:`hal.InvalidStateError`.
    """

    _owner: Any  # the GraphPools, kept alive by its handles
    _keys: PoolKeys
    _key: Hashable

    def __new__(cls, ident: tuple[int, int], keys: PoolKeys, key: Hashable) -> PoolHandle:
        handle = super().__new__(cls, ident)
        handle._owner, handle._keys, handle._key = keys.owner, keys, key
        return handle

    @property
    def key(self) -> Hashable:
        return self._key

    @property
    def released(self) -> bool:
        entry = self._keys.entries.get(self._key)
        return entry is None or entry.handle is not self

    @property
    def __hal_backend__(self) -> hal.Backend:
        """The backend of the pools (a capture through another backend is refused by hal)."""
        return self._keys.backend

    @property
    def __hal_pool__(self) -> Any:
        """The backend pool (what :meth:`hal.Backend.capture` uses); raises once released."""
        return self._live("capture").pool

    def __getitem__(self, index: Any) -> Any:
        self._live("capture", framework=True)
        return tuple.__getitem__(self, index)

    def __iter__(self) -> Iterator[int]:
        self._live("capture", framework=True)
        return tuple.__iter__(self)

    def _live(self, call: str, framework: bool = False) -> KeyPool:
        """The entry this handle stands for, for a capture; a released key, closed or paused pools are hal errors.

        :param framework: the framework's capture API reads the handle: a capture starting on another device
            than the pools' is refused (it would silently take a private pool of that device).
        """
        keys, key = self._keys, self._key
        entry = keys.entries.get(key)
        if entry is None or entry.handle is not self:
            why = f"the {keys.name} was closed" if keys.closed else f"key {key!r} was released"
            raise hal.InvalidStateError(f"pool handle of key {key!r} used after release ({why}): ask "
                                        "pools.pool(key) for a live one", backend=keys.backend.name, call=call)
        if framework and entry.lease.space_id is not None:
            device = keys.backend.current_device()
            if device != keys.backend.device:
                raise hal.CaptureError(
                    f"the pool handle of key {key!r} belongs to graph pools on {keys.backend.name}:"
                    f"{keys.backend.device}, but the capture starts on device {device}: its memory would not come "
                    f"from graphkit. Make the pools on the device that captures ({keys.name}() takes the current "
                    f"device: create it after the device is set), or pass backend=hal.get_backend(device={device})",
                    backend=keys.backend.name, call=call)
        keys.check_awake(entry, call)
        return entry

    def __repr__(self) -> str:
        state = " released" if self.released else ""
        return f"<graphkit pool {self._key!r} id={tuple.__repr__(self)}{state}>"

    def __reduce__(self) -> Any:  # a handle is tied to a live process
        raise TypeError("a graphkit pool handle cannot be pickled")


@dataclass(eq=False)
class KeyPool:
    """One key's pool: its handle and the lease it draws from.

    Its counts are written by its :class:`PoolKeys` alone (through the table's verbs); others read them.
    """

    key: Hashable
    handle: PoolHandle
    lease: Lease
    auto: bool = False  # made by graph_memory for one capture: released with its graph
    #: blocks of its pool allocated at the end of its last capture (None: unknown): a bound of what it holds
    #: later, since nothing allocates in a key's space outside its captures
    live: tuple[tuple[int, int], ...] | None = ()
    _graphs: int = field(default=0, init=False)  # routed captures alive in it
    #: blocks its owner reads only right after its own replay (replay-scoped outputs): they stay on shared memory
    _shared: frozenset[tuple[int, int]] = field(default=frozenset(), init=False)
    #: its space holds granules of their own (given back once their blocks are freed)
    _survivors: bool = field(default=False, init=False)
    _capturing: int = field(default=0, init=False)  # captures into it under way (begin_capture .. capture_closed)

    @property
    def graphs(self) -> int:
        """Routed captures alive in it (counted from their start until their graph is released)."""
        return self._graphs

    @property
    def capturing(self) -> bool:
        """Whether a capture into it is under way now (on any thread): its space must not be remapped."""
        return self._capturing > 0

    @property
    def pool(self) -> Any:
        """The backend pool."""
        return self.lease.pool

    @pool.setter
    def pool(self, pool: Any) -> None:
        self.lease.pool = pool

    @property
    def space_id(self) -> int | None:
        """The key's virtual space (vmm), else None."""
        return self.lease.space_id


class KeptMemory:
    """What the captures into the keys of one table left allocated, given bytes of its own at the same addresses
    (:meth:`PoolKeys.capture_ended`): at once, or -- while captures into other keys are under way -- once none is.

    Used by its :class:`PoolKeys` alone, under the table's lock.
    """

    def __init__(self, backend: hal.Backend, allocator: SharedVMMAllocator | None, outputs: str) -> None:
        self.backend, self.allocator, self.outputs = backend, allocator, outputs
        self._waiting: dict[int, KeyPool] = {}  # id(entry) -> entry whose promotion waits for the open captures

    def keep(self, entry: KeyPool) -> None:
        """Give the blocks ``entry``'s pool holds now (but its shared ones) granules of their own, and the granules
        of blocks freed since back to the shared chunks; raises the driver's fault (all or nothing)."""
        alloc = self.allocator
        if alloc is None or entry.space_id is None or self.outputs == "replay" or alloc.closed:
            return
        blocks = [b for b in self.backend.pool_active_blocks(entry.pool) if b not in entry._shared]
        alloc.keep_private(entry.space_id, blocks)
        entry._survivors = bool(blocks)

    def promote(self, entry: KeyPool) -> None:
        """:meth:`keep` now, tried twice (driver faults are often transient); the second fault raises."""
        self._waiting.pop(id(entry), None)
        try:
            self.keep(entry)
        except hal.HalError as exc:
            log.warning("key %r: giving its memory bytes of its own failed, trying again: %s", entry.key, str(exc))
            try:
                self.keep(entry)
            except hal.HalError as again:
                raise again.led_by(f"key {entry.key!r}: the memory its capture left allocated (its outputs) could "
                                   "not be given bytes of its own, so another key's replay would overwrite it; the "
                                   "capture is not kept") from again

    def wait(self, entry: KeyPool, open_captures: int) -> None:
        """``entry``'s promotion waits for the ``open_captures`` under way (:meth:`promote_waiting`)."""
        self._waiting[id(entry)] = entry
        log.debug("key %r: its memory gets bytes of its own once the %d capture(s) under way end", entry.key,
                  open_captures)

    def promote_waiting(self, live: Mapping[Hashable, KeyPool]) -> None:
        """The promotions that waited for the captures under way (none is now): each done, or left waiting with
        its fault logged, to be done at the next safe point. ``live``: the table's entries."""
        for key, entry in list(self._waiting.items()):
            if live.get(entry.key) is not entry:
                del self._waiting[key]
                continue
            try:
                self.keep(entry)
            except hal.HalError as exc:
                log.error("key %r: the memory its capture left allocated could not be given bytes of its own yet "
                          "(another key's replay may overwrite it until then; tried again at every safe point): "
                          "%s", entry.key, str(exc))
            else:
                del self._waiting[key]

    def share_back(self, entries: Iterable[KeyPool]) -> None:
        """Survivors that died since: their granules map the shared chunks again (a safe point, no capture under
        way); a fault leaves them as they are, tried again at the next one."""
        alloc = self.allocator
        if alloc is None or alloc.closed:
            return
        for entry in list(entries):
            if entry._survivors and id(entry) not in self._waiting:
                try:
                    self.keep(entry)
                except hal.HalError as exc:
                    log.warning("key %r: granules its freed memory held could not go back to the shared chunks yet "
                                "(tried again at the next safe point): %s", entry.key, str(exc))

    def forget(self) -> None:
        """The table closes: nothing waits any more."""
        self._waiting.clear()


def _ident(pool: Any, entries: Iterable[KeyPool]) -> tuple[int, int]:
    """The framework's id of ``pool`` (what its capture API takes); else that of a live key over the same
    pool (the keys of one shared pool), else a made-up one."""
    ident = getattr(pool, "id", None)
    if isinstance(ident, tuple) and len(ident) == 2:
        return tuple(ident)
    same = next((entry.handle for entry in entries if entry.pool is pool), None)
    if same is not None:
        return tuple.__getitem__(same, 0), tuple.__getitem__(same, 1)
    return 0, next(_serial)


class PoolKeys:
    """The keys of one :class:`graphkit.GraphPools`: each key's pool, leased from the pools' strategy.

    Its state (the entries, the routed graphs that died, the captures under way, the closed flag) is written by
    its own verbs alone: :meth:`lease`, :meth:`get` and :meth:`new` make keys; :meth:`begin_capture`,
    :meth:`capture_closed`, :meth:`capture_ended` and :meth:`graph_released` follow a capture and its graph
    (:class:`Captures` makes them whole steps: a capture's start, check and end); :meth:`note_live` notes what a
    key holds; :meth:`seal` trims a key's space; :meth:`settle` is the safe point; :meth:`release`,
    :meth:`drop`, :meth:`closing`, :meth:`forget` and :meth:`close` end keys. Every verb runs under the table's
    lock, which no other module takes (:meth:`step` runs an owner's several reads as one step);
    :attr:`entries` is a read-only view.
    """

    def __init__(self, backend: hal.Backend, strategy: PoolStrategy, owner: Any, name: str,
                 outputs: str = "kept") -> None:
        """:param owner: the GraphPools, which every handle keeps alive; ``name`` names it in errors.
        :param outputs: ``"kept"``: memory still allocated when a key's capture ends gets bytes of its own
            (:meth:`capture_ended`); ``"replay"``: the owner reads what its graphs leave only right after their own
            replay, so it stays on the shared chunks."""
        self.backend, self.strategy, self.owner, self.name = backend, strategy, owner, name
        self.outputs = outputs
        self.allocator: SharedVMMAllocator | None = strategy.allocator
        self._entries: dict[Hashable, KeyPool] = {}
        self._lock = threading.RLock()
        self._closed = False
        self._dead: deque[KeyPool] = deque()  # routed graphs destroyed: accounted for at the next safe point
        self._pending: list[KeyPool] = []  # automatic keys whose release failed: dropped again at the next one
        self._under_way = 0  # captures under way into any key, on any thread (begin_capture .. capture_closed)
        #: what the captures left allocated, given bytes of its own (a promotion remaps granules of other spaces:
        #: never under an open capture, so it waits for the captures under way)
        self._kept = KeptMemory(backend, self.allocator, outputs)

    @property
    def lock(self) -> threading.RLock:
        """The table's lock (reentrant), read only: its verbs take it, and no other module does (each verb is a
        whole step; :meth:`step` runs an owner's several reads as one)."""
        return self._lock

    @property
    def entries(self) -> Mapping[Hashable, KeyPool]:
        """The live keys' entries, read only (a view: iterate a copy, or inside a verb)."""
        return MappingProxyType(self._entries)

    @property
    def closed(self) -> bool:
        """Whether the owner closes or closed (:meth:`closing`): every call raises from then on."""
        return self._closed

    def check_open(self, call: str) -> None:
        if self._closed:
            raise hal.InvalidStateError(f"the {self.name} is closed", backend=self.backend.name,
                                        call=f"{self.name}.{call}")

    def lookup(self, key: Hashable, call: str) -> KeyPool | None:
        """The entry of ``key`` or None; a key that cannot be hashed or compared is a hal error."""
        try:
            with self._lock:
                return self._entries.get(key)
        except Exception as exc:  # noqa: BLE001 - whatever the key's __hash__ or __eq__ raises
            raise hal.InvalidArgumentError(f"key={key!r} must be hashable and comparable ({type(exc).__name__}: "
                                           f"{exc})", backend=self.backend.name, call=f"{self.name}.{call}") from None

    def lease(self, key: Hashable, call: str) -> KeyPool:
        """``key``'s entry, made on first use, after the safe point; ``call`` names the caller in errors."""
        with self._lock:
            self.check_open(call)
            self.settle()
            return self.lookup(key, call) or self.new(key, auto=False)

    def get(self, key: Hashable, auto: bool) -> KeyPool:
        """``key``'s entry, made on first use (``auto``: released with its graphs), within a step that already
        passed the safe point (a routed capture's start)."""
        with self._lock:
            return self._entries.get(key) or self.new(key, auto)

    def new(self, key: Hashable, auto: bool) -> KeyPool:
        """A lease from the strategy for ``key``; ``auto``: made by graph_memory, released with its graph."""
        lease = self.strategy.lease()
        entry = KeyPool(key, PoolHandle(_ident(lease.pool, list(self._entries.values())), self, key), lease, auto=auto)
        with self._lock:
            self._entries[key] = entry
        return entry

    def check_awake(self, entry: KeyPool, call: str) -> None:
        """Refuse a capture into ``entry`` while its memory sleeps: its pool would hand out unmapped memory."""
        allocator = self.allocator
        if allocator is not None and allocator.paused and not allocator.closed:
            raise hal.InvalidStateError(f"key {entry.key!r}: the graph memory of the {self.name} is paused: resume "
                                        "it (MemorySaver.resume('graphs')) before capturing into it",
                                        backend=self.backend.name, call=call)

    def drop(self, entry: KeyPool) -> None:
        """Give the key's lease back; a failed pool release keeps the key, to drop again."""
        with self._lock:
            self.strategy.give_back(entry.lease)
            del self._entries[entry.key]

    def entry_of(self, pool: Any) -> KeyPool | None:
        """The live key whose handle or backend pool ``pool`` is."""
        if isinstance(pool, PoolHandle):
            entry = self._entries.get(pool.key) if pool._keys is self else None
            return entry if entry is not None and entry.handle is pool else None
        if pool is None or isinstance(pool, tuple):
            return None
        return next((e for e in list(self._entries.values()) if e.pool is pool and e.space_id is not None), None)

    def note_live(self, entry: KeyPool) -> bool:
        """Note what ``entry``'s pool holds now (after its capture, or again before another key's, since outputs
        die after their capture ends); whether it may hold anything (unknown where it cannot be read)."""
        with self._lock:
            try:
                entry.live = tuple(self.backend.pool_active_blocks(entry.pool))
            except hal.HalError as exc:
                log.debug("key %r: its live blocks could not be read (%s): later captures are read", entry.key, exc)
                entry.live = None
            return entry.live != ()

    def owners(self) -> dict[int, KeyPool]:
        """The live keys with a space of their own, by space id (a snapshot)."""
        with self._lock:
            return {e.space_id: e for e in self._entries.values() if e.space_id is not None}

    def owned(self, key: Hashable, call: str) -> KeyPool:
        """``key``'s entry; closed pools or a key without a pool are hal errors naming ``call``."""
        with self._lock:
            self.check_open(call)
            entry = self.lookup(key, call)
            if entry is None:
                raise hal.InvalidStateError(f"key={key!r} has no pool", backend=self.backend.name,
                                            call=f"{self.name}.{call}")
            return entry

    # -- a capture and its graph ------------------------------------------------------------

    def begin_capture(self, entry: KeyPool, call: str) -> None:
        """A routed capture into ``entry`` begins: refused while its memory sleeps; its graph counts in the
        key's report (and keeps an automatic key) until :meth:`graph_released`, and the capture counts as under
        way until :meth:`capture_closed` (called once, whatever its end)."""
        with self._lock:
            self.check_awake(entry, call)
            entry._graphs += 1
            entry._capturing += 1
            self._under_way += 1

    @property
    def open_captures(self) -> int:
        """Captures under way into these keys now, on any thread."""
        return self._under_way

    def capture_closed(self, entry: KeyPool) -> None:
        """A capture :meth:`begin_capture` counted is over (ended, failed or refused): no longer under way. When it
        was the last one, the promotions that waited for it are done (see :meth:`capture_ended`)."""
        with self._lock:
            entry._capturing = max(entry._capturing - 1, 0)
            self._under_way = max(self._under_way - 1, 0)
            if not self._under_way and not self._closed:
                self._kept.promote_waiting(self._entries)

    def graph_released(self, entry: KeyPool, collected: bool = False) -> None:
        """A routed graph of ``entry`` is gone (released, garbage-collected, or its capture failed or was refused):
        accounted for at the next safe point, now where the lock is free.

        :param collected: called from the garbage collector: only noted (``deque.append`` is atomic), never
            waiting for the lock.
        """
        self._dead.append(entry)
        if not collected and self._lock.acquire(blocking=False):
            try:
                if not self._closed:
                    self.settle()
            finally:
                self._lock.release()

    def capture_ended(self, entry: KeyPool, shared: Iterable[tuple[int, int]] = ()) -> None:
        """A capture into ``entry`` ended well: the memory still allocated in its space (outputs kept, caches
        made in the capture) gets physical memory of its own, so that no other key's replay overwrites it and
        any graph may read it. Nothing for a key released or pools closed meanwhile.

        That promotion remaps the granules of the other spaces that map those chunks, which is never done under
        a capture: while captures into other keys are under way (other threads), it waits, and the last of them
        to close does it (:meth:`capture_closed`). Done now, it either completes -- a driver fault is retried
        once at once -- or raises the fault: the key's memory is never left on the shared chunks unsaid.

        :param shared: blocks the owner reads only right after this key's own replay (a runner's outputs,
            copied out at each call): they stay on the shared chunks.
        """
        with self._lock:
            if self._closed or self._entries.get(entry.key) is not entry:
                return
            entry._shared = entry._shared | frozenset(shared)
            if self._under_way:
                self._kept.wait(entry, self._under_way)
            else:
                self._kept.promote(entry)

    def seal(self, entry: KeyPool, why: str) -> None:
        """No more captures go to ``entry``'s space: it takes the address space it used, no more (``why`` is
        logged, and named by a later out-of-memory error)."""
        alloc = self.allocator
        with self._lock:
            if (entry.space_id is not None and alloc is not None and not alloc.closed
                    and entry.space_id in alloc.spaces):
                alloc.seal(entry.space_id, why)

    def release(self, key: Hashable) -> None:
        """Give ``key``'s lease back (see :meth:`graphkit.GraphPools.release`), then the safe point."""
        with self._lock:
            self.check_open("release")
            entry = self.lookup(key, "release")
            if entry is None:
                raise hal.InvalidStateError(f"key={key!r} has no pool (released twice?)", backend=self.backend.name,
                                            call="GraphPools.release")
            self.drop(entry)
            self.strategy.settle()  # a space that would not go is kept by the strategy, to release again
            self.settle()

    def collect(self) -> None:
        """The safe point, where the table is open."""
        with self._lock:
            if not self._closed:
                self.settle()

    def step(self, run: Callable[[], T]) -> T:
        """``run()`` as one step of the table: no verb of it runs meanwhile (the owner's report and close)."""
        with self._lock:
            return run()

    # -- the safe point --------------------------------------------------------------------

    def settle(self) -> None:
        """Release what routed graphs that died left behind, give the granules of survivors that died back to
        the shared chunks (a safe point: no allocator call is running). Nothing while a capture into a key is under
        way on any thread: each of these steps unmaps after a device-wide wait, which a capture must not see
        (the next safe point with none under way does them)."""
        with self._lock:
            if self._under_way:
                return
            self._release_dead()
            self._kept.promote_waiting(self._entries)
            self._kept.share_back(self._entries.values())
            try:
                self.strategy.settle()
            except hal.HalError as exc:
                log.error("a released key's space could not be released yet (retried): %s", str(exc))
            if self.allocator is not None and not self.allocator.closed:
                self.allocator.reap()

    def _release_dead(self) -> None:
        """Count the routed graphs that died; release the automatic keys left without one."""
        retry, self._pending = self._pending, []
        for entry in retry:
            if self._entries.get(entry.key) is entry:
                self._try_drop(entry)
        while self._dead:
            entry = self._dead.popleft()
            entry._graphs -= 1
            if entry.auto and entry._graphs <= 0 and self._entries.get(entry.key) is entry:
                self._try_drop(entry)

    def _try_drop(self, entry: KeyPool) -> None:
        """Drop a key whose graphs are gone; one that fails is kept and dropped again at the next safe point."""
        try:
            self.drop(entry)
        except hal.HalError as exc:
            log.error("key %r: its pool could not be released yet (retried at the next call): %s", entry.key,
                      str(exc))
            if self._entries.get(entry.key) is entry:
                self._pending.append(entry)

    # -- the end ----------------------------------------------------------------------------

    def closing(self) -> None:
        """The owner closes: from now on every call raises :class:`hal.InvalidStateError` (then :meth:`close`)."""
        with self._lock:
            self._closed = True

    def forget(self) -> None:
        """Forget every key without releasing it: the backend's close released every pool and space."""
        with self._lock:
            self._entries.clear()

    def close(self, errors: list[BaseException]) -> None:
        """Drop every key (the pools close; the routed graphs that died go with the others); a key whose pool
        would not go stays, its error in ``errors``."""
        with self._lock:
            for entry in list(self._entries.values()):
                close_step(errors, self.drop, entry)
            self._dead.clear()
            self._pending.clear()
            self._kept.forget()


# -- the captures into the keys ------------------------------------------------------------------------------


class Check(Protocol):
    """The isolation check of captures into one key (:class:`graphkit.graphs.isolation.KeyCheck`)."""

    read: bool

    def __call__(self, graph: Any) -> None: ...

    def accepted(self, graph: Any) -> None: ...

    def done(self) -> None: ...


class Checker(Protocol):
    """The isolation verifier of a table's keys (:class:`graphkit.graphs.isolation.Verifier`)."""

    def check(self, entry: KeyPool, fix: str | None = None) -> Check | None: ...


@dataclass(eq=False)
class Capture:
    """One capture under way into a key, begun by :meth:`Captures.routed` or :meth:`Captures.watched` and ended
    once by :meth:`Captures.end`."""

    entry: KeyPool
    check: Check | None
    #: its key is a group's: what it leaves gets bytes of its own, and the space is sealed, when the group ends
    grouped: bool = False
    #: why its key's space is sealed when it ends well (None: it is not)
    seal: str | None = None
    #: the blocks of its key's pool when it began (where its hygiene is reported)
    before: frozenset[tuple[int, int]] = frozenset()

    @property
    def inspect(self) -> bool:
        """Whether its graph is recorded so that the check can read it."""
        return self.check is not None and self.check.read


class Captures:
    """The captures into the keys of one table, each a whole step under the table's lock: begun
    (:meth:`routed`, :meth:`watched`; :meth:`owned_check` for an owner that captures into its keys itself),
    ended (:meth:`end`, :meth:`group_ended`, :meth:`owned_ended`): verified, what they left given bytes of its
    own (:meth:`_kept`, the one place that does it) and their space sealed; their graphs released
    (:meth:`released`)."""

    def __init__(self, table: PoolKeys, verifier: Checker) -> None:
        self.table, self.verifier = table, verifier

    def routed(self, key: Hashable, *, auto: bool, fresh: bool, grouped: bool, hygiene: bool) -> Capture:
        """A capture :func:`graph_memory` routes begins into ``key`` (``fresh``: a new automatic key; ``auto``:
        released with its graphs; ``grouped``: shared with other captures, promoted and sealed with its group);
        the safe point comes first. Refused captures leave their key as a failed one does."""
        table = self.table
        with table._lock:
            table.check_open("graph_memory")
            table.settle()
            entry = table.new(key, auto=True) if fresh else table.get(key, auto=auto)
            table.begin_capture(entry, "graph_memory")
            with Transaction() as tx:  # the capture does not start: its key goes as after a failed one
                tx.append(lambda: self._refused(entry))
                before = frozenset(table.backend.pool_active_blocks(entry.pool)) if hygiene else frozenset()
                check = self.verifier.check(entry)
                tx.commit()
        return Capture(entry, check, grouped, None if grouped else "when its capture ended", before)

    def watched(self, pool: Any) -> Capture | None:
        """A capture into a handle of the table begins (None: ``pool`` is none of its keys', or it is closed)."""
        table = self.table
        entry = table.entry_of(pool)
        if entry is None or table.closed:
            return None
        with table._lock:
            table.begin_capture(entry, "capture")  # the key's report counts it until its graph is released
            with Transaction() as tx:
                tx.append(lambda: self._refused(entry))
                check = self.verifier.check(entry)
                tx.commit()
        return Capture(entry, check)

    def end(self, capture: Capture, graph: Any, ok: bool,
            report: Callable[[KeyPool, frozenset[tuple[int, int]]], None] | None = None) -> None:
        """``capture`` ended (``ok``: well): checked, what it left given bytes of its own and its space sealed
        (unless its group does it); a failed or refused one is released. ``report``: the hygiene report of
        what it left, before the check notes what its key holds."""
        table, entry = self.table, capture.entry
        with table._lock:
            table.capture_closed(entry)
            if not ok:
                table.graph_released(entry)
                return
            with Transaction() as tx:  # refused: the backend releases the graph, never to report it again
                tx.append(lambda: table.graph_released(entry))
                if report is not None:
                    report(entry, capture.before)
                if capture.check is not None:
                    capture.check.accepted(graph)
                if not capture.grouped:
                    self._kept(entry)
                tx.commit()
            if capture.seal is not None:
                table.seal(entry, capture.seal)

    def released(self, capture: Capture, collected: bool) -> None:
        """The graph of ``capture`` is gone (see :meth:`PoolKeys.graph_released`)."""
        self.table.graph_released(capture.entry, collected)

    def group_ended(self, key: Hashable) -> None:
        """The outermost ``pools.group(key)`` block ended: what its captures left gets bytes of its own (raises
        the fault where it cannot) and its space is sealed."""
        table = self.table
        with table._lock:
            entry = table.entries.get(key)
            if entry is not None:
                try:
                    self._kept(entry)
                finally:
                    table.seal(entry, "when its pools.group() block ended")

    def owned_check(self, key: Hashable, fix: str | None, call: str) -> Check | None:
        """The isolation check of a capture an owner makes into ``key``'s lease itself (None: nothing to check)."""
        with self.table._lock:
            return self.verifier.check(self.table.owned(key, call), fix)

    def owned_ended(self, key: Hashable, shared: Iterable[tuple[int, int]], call: str,
                    seal: str | None = None) -> None:
        """An owner's captures into ``key``'s lease ended: what they left gets bytes of its own, except ``shared``
        blocks; its space is sealed where ``seal`` says why."""
        table = self.table
        with table._lock:
            entry = table.owned(key, call)
            self._kept(entry, shared)
            if seal is not None:
                table.seal(entry, seal)

    def owned_seal(self, key: Hashable, why: str, call: str) -> None:
        """No more captures go to ``key``'s space (see :meth:`PoolKeys.seal`)."""
        with self.table._lock:
            self.table.seal(self.table.owned(key, call), why)

    def _kept(self, entry: KeyPool, shared: Iterable[tuple[int, int]] = ()) -> None:
        """What the captures into ``entry`` left allocated gets bytes of its own: the one caller of
        :meth:`PoolKeys.capture_ended`."""
        self.table.capture_ended(entry, shared)

    def _refused(self, entry: KeyPool) -> None:
        """A capture counted by :meth:`PoolKeys.begin_capture` does not start: no longer under way, no graph."""
        self.table.capture_closed(entry)
        self.table.graph_released(entry)


class OwnedKeys:
    """The keys of pools whose owner captures into them itself (a :class:`graphkit.GraphRunner`), as the pools
    hand them to it: lease a key, check a capture into it, end its captures, seal it.

    :param call: the owner's name in errors (``GraphRunner``).
    """

    def __init__(self, table: PoolKeys, captures: Captures, call: str) -> None:
        self.table, self.captures, self.call = table, captures, call

    def lease(self, key: Hashable) -> Lease:
        """``key``'s lease, made on first use (after the safe point)."""
        return self.table.lease(key, "pool").lease

    def check(self, key: Hashable, fix: str | None = None) -> Check | None:
        """The isolation check of a capture into ``key``'s lease that starts now (None: nothing is checked)."""
        return self.captures.owned_check(key, fix, "isolation_check")

    def ended(self, key: Hashable, shared: Iterable[tuple[int, int]] = ()) -> None:
        """The captures into ``key``'s lease ended: what they left gets bytes of its own, but ``shared`` blocks."""
        self.table.check_open("capture_ended")
        blocks = checked_blocks(shared, self.table.backend.name, f"{self.call}.capture_ended", "shared")
        self.captures.owned_ended(key, blocks, "capture_ended")

    def seal(self, key: Hashable, why: str) -> None:
        """No more captures go to ``key``'s space."""
        self.captures.owned_seal(key, why, "seal")
