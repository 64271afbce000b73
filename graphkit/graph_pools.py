"""Vmm graph memory for engines that own their capture loop: :class:`GraphPools` and :func:`graph_memory`.

Two ways in, for a loop that calls ``torch.cuda.graph(g, pool=...)`` itself:

* **one changed line**: ``pool=pools.pool(batch_size)`` -- a handle that the
  framework's capture API, ``torch.npu.graph`` and :meth:`hal.Backend.capture`
  all take; one fresh virtual space per key over chunks shared by all keys;
* **no changed line**: ``with graphkit.graph_memory() as pools:`` around the
  loop -- every capture started inside draws from a fresh space, whatever
  pool the engine passes; ``pools.group(key)`` keeps the captures of one
  batch (the pieces of a piecewise graph) in one space.

graphkit keeps every pool alive (the framework silently falls back to a
private pool when a pool id outlives its pool object); a handle used after
its pool was released raises :class:`hal.InvalidStateError`.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import logging
import threading
import weakref
from collections import deque
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import hal
from graphkit import isolation
from graphkit.allocator import SharedVMMAllocator
from graphkit.capture import CaptureHygieneError, framework_capturer, leftover_blocks, report_leftovers
from graphkit.closing import Closable, raise_first_failure
from graphkit.isolation import IsolationError
from graphkit.pools import Lease, vmm_or_shared
from graphkit.report import KeyReport, PoolsReport
from graphkit.saver import GRAPHS, MemorySaver
from hal.types import Route, fmt_bytes

log = logging.getLogger("graphkit.graph_pools")

Kind = Literal["vmm", "shared"]
_serial = itertools.count(1)
_ALLOCATOR_OPTIONS = frozenset({"reserve_bytes", "max_physical_bytes", "capacity", "arena_bytes"})


class CaptureKey(tuple):
    """The key :func:`graph_memory` gives a capture outside any group: ``('capture', n)``.

    It prints like the tuple but equals only another :class:`CaptureKey`:
    an engine's own key ``('capture', 1)`` never meets it.
    """

    def __new__(cls, serial: int) -> CaptureKey:
        return super().__new__(cls, ("capture", serial))

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

    _owner: GraphPools
    _key: Hashable

    def __new__(cls, ident: tuple[int, int], owner: GraphPools, key: Hashable) -> PoolHandle:
        handle = super().__new__(cls, ident)
        handle._owner, handle._key = owner, key
        return handle

    @property
    def key(self) -> Hashable:
        return self._key

    @property
    def released(self) -> bool:
        entry = self._owner._entries.get(self._key)
        return entry is None or entry.handle is not self

    @property
    def __hal_pool__(self) -> Any:
        """The backend pool (what :meth:`hal.Backend.capture` uses); raises once released."""
        return self._owner._live(self._key, self, "capture").pool

    def __getitem__(self, index: Any) -> Any:
        self._owner._live(self._key, self, "capture")
        return tuple.__getitem__(self, index)

    def __iter__(self) -> Iterator[int]:
        self._owner._live(self._key, self, "capture")
        return tuple.__iter__(self)

    def __repr__(self) -> str:
        state = " released" if self.released else ""
        return f"<graphkit pool {self._key!r} id={tuple.__repr__(self)}{state}>"

    def __reduce__(self) -> Any:  # a handle is tied to a live process
        raise TypeError("a graphkit pool handle cannot be pickled")


@dataclass(eq=False)
class _Entry:
    key: Hashable
    handle: PoolHandle
    pool: Any  # the backend pool
    space_id: int | None  # None for the shared pool
    auto: bool = False  # made by graph_memory for one capture: released with its graph
    graphs: int = 0  # routed captures alive in it


def _abandoned(backend_name: str, entries: dict) -> None:
    if entries:
        log.warning("a GraphPools on %s with %d live key(s) was garbage-collected without close(): its memory "
                    "stays mapped for the graphs that may still use it (call close() when they are gone)",
                    backend_name, len(entries))


class GraphPools(Closable):
    """Graph memory pools keyed by the engine's own keys (batch sizes, batch descriptors).

    ``pool(key)`` returns one handle per key: a fresh virtual space over
    chunks every key shares, so N keys cost the physical memory of the
    largest. graphkit holds every pool until ``release(key)``, ``close()`` or
    the end of the ``with`` block.

    :param backend: a :class:`hal.Backend`; default ``hal.get_backend()``
        (then owned and closed with the pools).
    :param kind: ``"vmm"`` (default) or ``"shared"`` (one pool drawn from
        the device's own allocator for every key: the engines' usual set-up).
        ``"vmm"`` falls back to ``"shared"``, with a warning, on a backend
        without pools over custom allocators.
    :param hygiene: after each capture routed by :func:`graph_memory`, log
        the allocations it made that outlive it (a cache or workspace born
        inside a capture lands in memory other graphs overwrite).
    :param saver: a :class:`graphkit.MemorySaver`: the pools' chunks sleep
        and wake with its tag ``"graphs"`` (graphs replay after a resume
        without recapture; nothing of theirs may run while paused).
    :param verify: after every capture into a key's pool (routed by
        :func:`graph_memory`, or passed ``pools.pool(key)``), read the
        addresses the graph uses from the graph and refuse it with an
        :class:`graphkit.IsolationError` when one lies in another key's
        space (keys share physical memory: such a read gives wrong
        results). Needs the backend's ``"graph_addresses"`` capability (the
        check is skipped with one log line without it); ``pools.pool(key)``
        captures are seen through ``"capture_routing"``.
    :param allocator_options: options of :class:`SharedVMMAllocator`
        (``reserve_bytes``, ``max_physical_bytes``, ``arena_bytes``).
    """

    def __init__(self, backend: hal.Backend | None = None, kind: Kind = "vmm", *, hygiene: bool = False,
                 saver: MemorySaver | None = None, verify: bool = True, **allocator_options: Any) -> None:
        if backend is not None and not isinstance(backend, hal.Backend):
            raise hal.InvalidArgumentError(f"backend={backend!r} must be a hal.Backend", call="GraphPools")
        unknown = sorted(set(allocator_options) - _ALLOCATOR_OPTIONS)
        if unknown:
            raise hal.InvalidArgumentError(f"unknown option(s) {', '.join(unknown)}; GraphPools takes kind, hygiene, "
                                           f"saver and {', '.join(sorted(_ALLOCATOR_OPTIONS))}",
                                           backend=getattr(backend, "name", None), call="GraphPools")
        if saver is not None and not isinstance(saver, MemorySaver):
            raise hal.InvalidArgumentError(f"saver={saver!r} must be a graphkit.MemorySaver",
                                           backend=getattr(backend, "name", None), call="GraphPools")
        self._owns_backend = backend is None
        self.backend = be = backend if backend is not None else hal.get_backend(requires=("graphs",))
        if kind not in ("vmm", "shared"):
            raise hal.InvalidArgumentError(f"kind={kind!r} must be 'vmm' or 'shared'", backend=be.name,
                                           call="GraphPools")
        if kind == "vmm":
            kind = vmm_or_shared(be, "GraphPools")
        self.kind: Kind = kind
        self.hygiene = hygiene
        self.allocator = SharedVMMAllocator(be, **allocator_options) if kind == "vmm" else None
        self.saver = saver
        if saver is not None:
            if self.allocator is None:
                raise hal.UnsupportedError("a shared pool is drawn from the framework's allocator and cannot sleep "
                                           "with a MemorySaver (needs 'custom_pool')", backend=be.name,
                                           call="GraphPools")
            try:
                saver.adopt(self.allocator, GRAPHS)
            except BaseException:
                self.allocator.close()
                raise
        self._shared_pool: Any = None
        self._entries: dict[Hashable, _Entry] = {}
        self._lock = threading.RLock()
        self._dead: deque[_Entry] = deque()  # routed graphs collected: released at the next safe point
        self._groups = threading.local()
        self._auto = itertools.count(1)
        self._closed = False
        self._close_done = False
        self._unreleased_spaces: list[int] = []  # spaces of released keys whose release failed: retried
        self._undropped: list[_Entry] = []  # keys of dead routed graphs whose release failed: retried
        be.synchronize()
        self._used_at_start = be.mem_info().used
        self.verify_stats = isolation.VerifyStats()
        self._verifying = bool(verify) and self.allocator is not None and isolation.readable(be, [])
        self._watching: contextlib.ExitStack | None = None  # sees captures into pools.pool(key) handles
        self._trees_logged = False
        self._finalizer = weakref.finalize(self, _abandoned, be.name, self._entries)

    # -- keys -----------------------------------------------------------------------

    def pool(self, key: Hashable) -> PoolHandle:
        """The handle of ``key``'s pool: the same handle for the same key until it is released.

        With ``verify``, captures into handles are watched from the first
        call until :meth:`close` (the framework's graph class is wrapped
        meanwhile, where the backend routes captures).
        """
        with self._lock:
            self._check_open("pool")
            if self._watching is None and self._verifying and self.backend.supports("capture_routing"):
                self._watching = contextlib.ExitStack()
                self._watching.enter_context(self.backend.route_captures(_watcher(weakref.ref(self))))
            return self._handle(key)

    def _handle(self, key: Hashable) -> PoolHandle:
        with self._lock:
            self._check_open("pool")
            self._settle()
            entry = self._lookup(key, "pool") or self._new_entry(key, auto=False)
            return entry.handle

    def _lookup(self, key: Hashable, call: str) -> _Entry | None:
        """The entry of ``key`` or None; a key that cannot be hashed or compared is a hal error."""
        try:
            return self._entries.get(key)
        except Exception as exc:  # noqa: BLE001 - whatever the key's __hash__ or __eq__ raises
            raise hal.InvalidArgumentError(f"key={key!r} must be hashable and comparable ({type(exc).__name__}: "
                                           f"{exc})", backend=self.backend.name, call=f"GraphPools.{call}") from None

    def _new_entry(self, key: Hashable, auto: bool) -> _Entry:
        be = self.backend
        if self.allocator is None:
            if self._shared_pool is None:
                self._shared_pool = be.create_pool()
            pool, space = self._shared_pool, None
        else:
            allocator = self.allocator
            space = allocator.switch_to_new_virtual_space()
            try:
                pool = be.create_pool(*allocator.pool_callbacks(space), paused=lambda: allocator.paused)
            except BaseException:
                self.allocator.release_virtual_space(space)
                raise
        entry = _Entry(key, PoolHandle(self._ident(pool), self, key), pool, space, auto=auto)
        self._entries[key] = entry
        return entry

    def _ident(self, pool: Any) -> tuple[int, int]:
        """The framework's id of ``pool`` (what its capture API takes); a made-up one where it has none."""
        ident = getattr(pool, "id", None)
        if isinstance(ident, tuple) and len(ident) == 2:
            return tuple(ident)
        if pool is self._shared_pool:
            self._shared_ident = getattr(self, "_shared_ident", None) or (0, next(_serial))
            return self._shared_ident
        return (0, next(_serial))

    def _live(self, key: Hashable, handle: PoolHandle, call: str) -> _Entry:
        entry = self._entries.get(key)
        if entry is None or entry.handle is not handle:
            why = "the GraphPools was closed" if self._closed else f"key {key!r} was released"
            raise hal.InvalidStateError(f"pool handle of key {key!r} used after release ({why}): ask "
                                        "pools.pool(key) for a live one", backend=self.backend.name, call=call)
        return entry

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    @property
    def keys(self) -> list[Hashable]:
        return list(self._entries)

    def release(self, key: Hashable) -> None:
        """Give the memory of ``key`` back; its handle raises from now on.

        Release a key after its graphs are reset: the space's addresses stay
        reserved until the framework frees the last block in it.
        """
        with self._lock:
            self._check_open("release")
            entry = self._lookup(key, "release")
            if entry is None:
                raise hal.InvalidStateError(f"key={key!r} has no pool (released twice?)", backend=self.backend.name,
                                            call="GraphPools.release")
            self._drop(entry)
            self._settle()

    def _drop(self, entry: _Entry) -> None:
        """Release the key's pool, then its space; a failed pool release keeps the key, to release again."""
        if entry.space_id is None:  # a key of the shared pool: the pool stays for the others
            del self._entries[entry.key]
            return
        assert self.allocator is not None
        self.backend.release_pool(entry.pool)
        del self._entries[entry.key]
        try:
            self.allocator.release_when_idle(entry.space_id)
        except hal.HalError:
            self._unreleased_spaces.append(entry.space_id)  # retried at the next safe point
            raise

    def _try_drop(self, entry: _Entry) -> None:
        """Drop a key whose graphs are gone; one that fails is kept and dropped again at the next safe point."""
        try:
            self._drop(entry)
        except hal.HalError as exc:
            log.error("key %r: its pool could not be released yet (retried at the next call): %s", entry.key,
                      str(exc))
            if self._entries.get(entry.key) is entry:
                self._undropped.append(entry)

    def _settle(self) -> None:
        """Release what routed graphs that died left behind (a safe point: no allocator call is running)."""
        retry, self._undropped = self._undropped, []
        for entry in retry:
            if self._entries.get(entry.key) is entry:
                self._try_drop(entry)
        while self._dead:
            entry = self._dead.popleft()
            entry.graphs -= 1
            if entry.auto and entry.graphs <= 0 and self._entries.get(entry.key) is entry:
                self._try_drop(entry)
        if self.allocator is not None and not self.allocator.closed:
            spaces, self._unreleased_spaces = self._unreleased_spaces, []
            for space_id in spaces:
                if space_id in self.allocator.spaces:
                    try:
                        self.allocator.release_when_idle(space_id)
                    except hal.HalError as exc:
                        log.error("a released key's space could not be released yet (retried): %s", str(exc))
                        self._unreleased_spaces.append(space_id)
            self.allocator.reap()

    def collect(self) -> None:
        """Release now what graphs that were garbage-collected left behind (done at every call anyway)."""
        with self._lock:
            if not self._closed:
                self._settle()

    # -- graph_memory's router ------------------------------------------------------

    @contextlib.contextmanager
    def group(self, key: Hashable) -> Iterator[PoolHandle]:
        """Inside :func:`graph_memory`: the captures started in this block (this thread) share ``key``'s space.

        For piecewise graphs: piece k's output feeds piece k + 1, so the
        pieces of one batch must never share physical bytes with each other.
        """
        handle = self._handle(key)
        stack = self._group_stack()
        stack.append(key)
        try:
            yield handle
        finally:
            stack.pop()
            if key not in stack:  # an outer group of the same key keeps its space open
                with self._lock:
                    entry = self._entries.get(key)
                    if entry is not None and entry.space_id is not None and self.allocator is not None \
                            and not self.allocator.closed and entry.space_id in self.allocator.spaces:
                        self.allocator.seal(entry.space_id)

    def _group_stack(self) -> list[Hashable]:
        stack = getattr(self._groups, "stack", None)
        if stack is None:
            stack = self._groups.stack = []
        return stack

    def route(self, graph: Any, requested_pool: Any) -> Route | None:
        """The router :func:`graph_memory` installs: a fresh space per capture, or the current group's.

        Two captures of torch's own are special: torch.compile's CUDA graph
        trees keep one pool of their own and check it, so their captures are
        left to torch (logged once); the forward and backward graphs of one
        ``torch.cuda.make_graphed_callables`` call share one space, as they
        share one pool without graphkit (backward reads forward's memory).
        """
        capturer = framework_capturer() if not isinstance(requested_pool, PoolHandle) else None
        if capturer == "graph_trees":
            if not self._trees_logged:
                self._trees_logged = True
                log.info("a capture of torch.compile's CUDA graph trees (mode='reduce-overhead'): left to torch, "
                         "which keeps one pool of its own for them and checks it; graph_memory routes the others")
            return None
        with self._lock:
            self._check_open("graph_memory")
            self._settle()
            stack = self._group_stack()
            grouped = bool(stack) or capturer == "graphed_callables"
            if stack:
                entry = self._entries.get(stack[-1]) or self._new_entry(stack[-1], auto=False)
            elif capturer == "graphed_callables":  # one key per call: the pool id it made for its graphs
                key = ("make_graphed_callables", _pool_ident(requested_pool))
                entry = self._entries.get(key) or self._new_entry(key, auto=True)
            else:
                entry = self._new_entry(CaptureKey(next(self._auto)), auto=True)
            entry.graphs += 1
            before = self._blocks(entry) if self.hygiene else set()

        def on_end(ok: bool) -> None:
            with self._lock:
                if ok and self._verifying:
                    try:
                        self._verify(graph, entry)
                    except BaseException:  # refused: the backend releases the graph, never to report it again
                        self._dead.append(entry)
                        self._settle()
                        raise
                if not ok:
                    self._dead.append(entry)
                    self._settle()
                    return
                if self.hygiene:
                    self._report_new_blocks(entry, before)
                if not grouped and entry.space_id is not None and self.allocator is not None:
                    self.allocator.seal(entry.space_id)

        def on_release(collected: bool) -> None:
            self._dead.append(entry)  # deque.append is atomic: safe from the garbage collector
            if not collected and self._lock.acquire(blocking=False):
                try:
                    if not self._closed:
                        self._settle()
                finally:
                    self._lock.release()

        return Route(entry.pool, on_end, on_release, inspect=self._verifying)

    def _watch(self, graph: Any, requested_pool: Any) -> Route | None:
        """The router of captures outside :func:`graph_memory`: verify those into one of these pools."""
        entry = self._entry_of(requested_pool)
        if entry is None or self._closed:
            return None

        def on_end(ok: bool) -> None:
            if ok:
                with self._lock:
                    self._verify(graph, entry)

        return Route(entry.pool, on_end, inspect=True)

    def _entry_of(self, pool: Any) -> _Entry | None:
        """The live entry whose handle or backend pool ``pool`` is."""
        if isinstance(pool, PoolHandle):
            entry = self._entries.get(pool.key) if pool._owner is self else None
            return entry if entry is not None and entry.handle is pool else None
        if pool is None or isinstance(pool, tuple):
            return None
        return next((e for e in list(self._entries.values()) if e.pool is pool and e.space_id is not None), None)

    def _verify(self, graph: Any, entry: _Entry) -> None:
        """Refuse ``graph`` (of ``entry``) when it uses memory in another key's space."""
        alloc = self.allocator
        if alloc is None or entry.space_id is None:
            return
        keys = {e.space_id: e.key for e in self._entries.values() if e.space_id is not None}
        fix = ("Put the captures that pass tensors to each other (the pieces of one batch) in one space: "
               "`with pools.group(key):` around them" if entry.auto else
               "Use one key for the captures that pass tensors to each other (the pieces of one batch): "
               "the same pools.pool(key), or `with pools.group(key):` around them")
        pools = {e.space_id: e.pool for e in self._entries.values() if e.space_id is not None}

        def live_blocks(space_id: int) -> list[tuple[int, int]] | None:
            pool = pools.get(space_id)
            return None if pool is None else self.backend.pool_active_blocks(pool)

        isolation.verify(self.backend, graph, self.verify_stats, alloc.spaces, entry.space_id, entry.key, keys.get,
                         fix, live_blocks)

    def _blocks(self, entry: _Entry) -> set[tuple[int, int]]:
        return set(self.backend.pool_active_blocks(entry.pool))

    def _report_new_blocks(self, entry: _Entry, before: set[tuple[int, int]]) -> None:
        new = sorted(self._blocks(entry) - before)
        if not new:
            return
        space = self.allocator.spaces.get(entry.space_id) if self.allocator and entry.space_id else None
        outside = [b for b in new if space is not None and not space.contains(b[0])]
        if outside:
            log.warning("key %r: %d block(s) of the capture did not come from graphkit's space: the capture "
                        "allocated through the framework's own allocator", entry.key, len(outside))
        log.info("key %r: %d block(s), %s, allocated during the capture are still live after it (its outputs, "
                 "and anything it created and kept: a cache born in a capture lives in memory other graphs "
                 "overwrite; warm up first)", entry.key, len(new), fmt_bytes(sum(s for _, s in new)))

    # -- hygiene helpers ----------------------------------------------------------------

    def warm_up(self, fn: Callable[..., Any], *args: Any, runs: int = 1, stream: Any = None,
                **kwargs: Any) -> Any:
        """Run ``fn(*args, **kwargs)`` ``runs`` times on the stream captures use, wait, return the last result.

        ``stream`` defaults to the stream the framework's capture API uses
        when given none (``torch.cuda.graph``'s side stream), so lazily
        created state (cuBLAS workspaces, caches) is born outside the capture.
        """
        be = self.backend
        if not callable(fn):
            raise hal.InvalidArgumentError(f"fn={fn!r} must be callable", backend=be.name, call="GraphPools.warm_up")
        if not isinstance(runs, int) or isinstance(runs, bool) or runs < 0:
            raise hal.InvalidArgumentError(f"runs={runs!r} must be an int >= 0", backend=be.name,
                                           call="GraphPools.warm_up")
        stream = stream if stream is not None else be.default_capture_stream()
        result = None
        with be.use_stream(stream):
            for _ in range(runs):
                result = fn(*args, **kwargs)
        be.synchronize(stream)
        return result

    def leftovers(self, key: Hashable, outputs: Any, strict: bool = False) -> list[tuple[int, int]]:
        """Blocks of ``key``'s pool still allocated that hold none of ``outputs``; logged (raised when ``strict``).

        :raises CaptureHygieneError: ``strict`` and something other than the outputs is left.
        """
        with self._lock:
            entry = self._lookup(key, "leftovers")
            if entry is None:
                raise hal.InvalidStateError(f"key={key!r} has no pool", backend=self.backend.name,
                                            call="GraphPools.leftovers")
            found = leftover_blocks(self.backend, Lease(entry.pool, entry.space_id), outputs)
        report_leftovers(self.backend, found, f"key {key!r}", strict=strict)
        return found

    # -- figures --------------------------------------------------------------------------

    def report(self) -> PoolsReport:
        """Per-key and total bytes: chunks, spaces, and device memory as the driver measures it."""
        with self._lock:
            self._check_open("report")
            self._settle()
            alloc = self.allocator
            spaces = alloc.spaces if alloc is not None else {}
            g = alloc.granularity if alloc is not None else 0
            keys = []
            for entry in self._entries.values():
                space = spaces.get(entry.space_id) if entry.space_id is not None else None
                keys.append(KeyReport(entry.key, space.offset if space else 0, space.mapped * g if space else 0,
                                      space.size if space else 0, entry.graphs))
            self.backend.synchronize()
            stats = self.verify_stats
            report = PoolsReport(self.backend.name, self.kind, keys,
                                 alloc.physical_bytes if alloc else 0, alloc.reserved_bytes if alloc else 0,
                                 alloc.arena_reserved_bytes if alloc else 0,
                                 self.backend.mem_info().used - self._used_at_start,
                                 alloc.map_calls if alloc else 0, alloc.map_seconds if alloc else 0.0,
                                 stats.graphs, stats.nodes, stats.missed, stats.seconds)
        return report

    # -- teardown -------------------------------------------------------------------------

    def _check_open(self, call: str) -> None:
        if self._closed:
            raise hal.InvalidStateError("the GraphPools is closed", backend=self.backend.name,
                                        call=f"GraphPools.{call}")

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Release every pool, unmap every space, release the chunks. Idempotent.

        Reset (or drop) the graphs captured with these pools first: their
        memory is gone after this. Goes on past failures and raises the
        first; ``close()`` again finishes the job.
        """
        with self._lock:
            if self._close_done:
                return
            self._closed = True  # from here on every call raises InvalidStateError
            self._finalizer.detach()
            if self._watching is not None:
                watching, self._watching = self._watching, None
                watching.close()
            errors: list[BaseException] = []
            try:
                self.backend.synchronize()
            except hal.HalError as exc:
                errors.append(exc)
            gc.collect()  # framework tensors of these pools caught in reference cycles go while the pools exist
            for entry in list(self._entries.values()):
                try:
                    self._drop(entry)
                except hal.HalError as exc:
                    errors.append(exc)
            self._dead.clear()
            self._undropped.clear()  # dropped above with every other key
            self._unreleased_spaces.clear()  # the allocator's close takes them down
            if self._shared_pool is not None:
                try:
                    self.backend.release_pool(self._shared_pool)
                except hal.HalError as exc:
                    errors.append(exc)
                else:
                    self._shared_pool = None
            if self.allocator is not None:
                if self.saver is not None:
                    self.saver.forget(self.allocator)
                if not self._entries:  # a key whose pool would not go keeps its space for the retry
                    try:
                        self.allocator.close()
                    except hal.HalError as exc:
                        errors.append(exc)
            raise_first_failure(log, errors, "GraphPools.close")
            self._close_done = True
            if self._owns_backend:
                self.backend.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._entries)} key(s)"
        return f"<graphkit.GraphPools {self.backend.name} {self.kind} {state}>"


def _pool_ident(pool: Any) -> Any:
    """A hashable name of the pool a caller passed (a framework pool id, or the object's identity)."""
    if isinstance(pool, tuple):
        return tuple(pool)
    return id(pool) if pool is not None else None


def _watcher(ref: weakref.ref[GraphPools]) -> Callable[[Any, Any], Route | None]:
    """``GraphPools._watch`` of a GraphPools held weakly (the routing must not keep it alive)."""
    def watch(graph: Any, requested_pool: Any) -> Route | None:
        pools = ref()
        return None if pools is None else pools._watch(graph, requested_pool)
    return watch


@contextlib.contextmanager
def graph_memory(backend: hal.Backend | None = None, *, pools: GraphPools | None = None, kind: Kind = "vmm",
                 hygiene: bool = False, verify: bool = True, **allocator_options: Any) -> Iterator[GraphPools]:
    """Every capture started inside the block draws from a fresh vmm space of the yielded :class:`GraphPools`.

    Whatever pool the engine passes -- none, its own shared pool, or
    ``graph.pool()`` of an earlier graph -- is replaced; ``pools.group(key)``
    puts the captures inside it into one space (the pieces of one batch).
    A space lives as long as its graph: it is released when the graph is
    reset or garbage-collected. The pools outlive the block (the graphs
    replay after it); close them when the graphs are gone. Leaving the
    block restores the framework's capture API exactly, also on errors.

    :param pools: use these pools instead of new ones (then ``backend``,
        ``kind``, ``hygiene``, ``verify`` and the allocator options are theirs).
    :param verify: refuse a graph that uses another capture's space (see
        :class:`GraphPools`): a piecewise forward captured without
        ``pools.group(key)`` fails loudly instead of replaying wrong results.
    :raises hal.UnsupportedError: the backend cannot route the framework's captures.
    """
    if pools is not None and not isinstance(pools, GraphPools):
        raise hal.InvalidArgumentError(f"pools={pools!r} must be a graphkit.GraphPools", call="graph_memory")
    if backend is not None and not isinstance(backend, hal.Backend):
        raise hal.InvalidArgumentError(f"backend={backend!r} must be a hal.Backend (hal.get_backend(...))",
                                       call="graph_memory")
    if pools is None:
        chosen = backend if backend is not None else hal.get_backend(requires=("graphs", "capture_routing"))
        pools = GraphPools(chosen, kind, hygiene=hygiene, verify=verify, **allocator_options)
        pools._owns_backend = backend is None
    with pools.backend.route_captures(pools.route):
        yield pools


__all__ = ["CaptureHygieneError", "CaptureKey", "GraphPools", "IsolationError", "KeyReport", "PoolHandle",
           "PoolsReport", "graph_memory"]
