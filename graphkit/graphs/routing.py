"""Which key's pool a capture the framework starts draws from: :func:`graphkit.graph_memory`'s router and the watcher.

The router gives every capture started inside ``graph_memory()`` a fresh key
(or the key of the current ``pools.group(key)``) and releases an automatic
key with its graph. The watcher sees captures into ``pools.pool(key)``
handles, so that they are verified too. Both decide which key a capture goes
to and hand the rest -- its start, its check, its end -- to the key table of one
:class:`graphkit.GraphPools` (:class:`Captures`, whose every verb is a whole step
under the table's lock).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import weakref
from collections.abc import Callable, Hashable, Iterator
from typing import Any

import hal
from graphkit.graphs.capture import framework_capturer
from graphkit.graphs.executables import Executables
from graphkit.graphs.keys import Capture, CaptureKey, Captures, KeyPool, PoolHandle, PoolKeys
from graphkit.memory.phases import CAPTURE_TIMES
from hal.types import Route, fmt_bytes

log = logging.getLogger(__name__)


class CaptureRouting:
    """The routing of one :class:`GraphPools`: handles, groups, graph_memory's router, the watcher of handles.

    :param keys: the pools' key table (it leases from the pools' strategy).
    :param captures: the captures into the keys (begun, checked and ended by the table).
    :param hygiene: log what a routed capture left allocated.
    :param watch: see the captures into handles from the first handle on (off where the owner captures into
        its keys itself: a :class:`graphkit.GraphRunner`).
    """

    def __init__(self, keys: PoolKeys, captures: Captures, *, hygiene: bool, watch: bool,
                 executables: Executables | None = None) -> None:
        self.keys, self.captures = keys, captures
        self.hygiene, self.watches = hygiene, watch
        self.executables = executables  # owns the executable forms of the graphs routed (None: the framework)
        self._groups = threading.local()
        self._auto = itertools.count(1)
        self._watching: contextlib.ExitStack | None = None
        self._watch_lock = threading.Lock()  # one watcher, however many threads ask for handles at once
        self._trees_logged = False

    def handle(self, key: Hashable) -> PoolHandle:
        """``key``'s handle, its pool made on first use (see :meth:`GraphPools.pool`); from the first one on,
        captures into handles are watched."""
        handle = self.keys.lease(key, "pool").handle
        if self.watches:
            self.watch_handles()
        return handle

    # -- the watcher ---------------------------------------------------------------------

    def watch_handles(self) -> None:
        """From now on until :meth:`stop`, see the captures into the pools' handles (where captures can be
        routed): the backend prepares their streams, and they are verified."""
        backend = self.keys.backend
        with self._watch_lock:
            if self._watching is None and not self.keys.closed and backend.supports("capture_routing"):
                self._watching = contextlib.ExitStack()
                self._watching.enter_context(backend.route_captures(_watcher(weakref.WeakMethod(self.watch))))

    def stop(self) -> None:
        with self._watch_lock:
            watching, self._watching = self._watching, None
        if watching is not None:
            watching.close()

    def watch(self, graph: Any, requested_pool: Any) -> Route | None:
        """The router of captures outside :func:`graph_memory`: verify those into one of these pools."""
        capture = self.captures.watched(requested_pool)
        if capture is None:
            return None

        def on_end(ok: bool) -> None:
            self.captures.end(capture, graph, ok)

        return self._route(capture, on_end)

    def _route(self, capture: Capture, on_end: Callable[[bool], None]) -> Route:
        """A capture's route; with an executables budget, its replays go through it (the graph keeps no
        executable of its own until it is replayed)."""
        captures, pool, inspect = self.captures, capture.entry.pool, capture.inspect

        def on_release(collected: bool) -> None:
            captures.released(capture, collected)

        if self.executables is None:
            return Route(pool, on_end, on_release, inspect=inspect)
        on_replay, forget = self.executables.serving()

        def released(collected: bool) -> None:
            forget(collected)
            on_release(collected)

        return Route(pool, on_end, released, inspect=inspect, on_replay=on_replay)

    # -- groups ---------------------------------------------------------------------------

    @contextlib.contextmanager
    def group(self, key: Hashable) -> Iterator[PoolHandle]:
        """See :meth:`GraphPools.group`."""
        handle = self.handle(key)
        stack = self._group_stack()
        stack.append(key)
        try:
            yield handle
        except BaseException:  # not an undo: the block's end, said after its own error
            stack.pop()
            try:
                self._group_ended(key, stack)
            except hal.HalError as exc:  # the block's own error is the one raised
                log.error("key %r: %s", key, str(exc))
            raise
        stack.pop()
        self._group_ended(key, stack)

    def _group_ended(self, key: Hashable, stack: list[Hashable]) -> None:
        """The block of ``key`` ended: unless an outer block of the same key keeps its space open, what its
        captures left gets bytes of its own (raises the fault where it cannot) and its space is sealed."""
        if key not in stack:
            self.captures.group_ended(key)

    def _group_stack(self) -> list[Hashable]:
        stack = getattr(self._groups, "stack", None)
        if stack is None:
            stack = self._groups.stack = []
        return stack

    # -- graph_memory's router -------------------------------------------------------------

    def route(self, graph: Any, requested_pool: Any) -> Route | None:
        """See :meth:`GraphPools.route`."""
        capturer = framework_capturer() if not isinstance(requested_pool, PoolHandle) else None
        if capturer == "graph_trees":
            if not self._trees_logged:
                self._trees_logged = True
                log.info("a capture of torch.compile's CUDA graph trees (mode='reduce-overhead'): left to torch, "
                         "which keeps one pool of its own for them and checks it; graph_memory routes the others")
            return None
        counted = CAPTURE_TIMES.start("routing")
        key, auto, fresh, grouped = self._key_for(capturer, requested_pool)
        capture = self.captures.routed(key, auto=auto, fresh=fresh, grouped=grouped, hygiene=self.hygiene)
        CAPTURE_TIMES.stop(counted)
        return self._route(capture, self._on_end(graph, capture))

    def _key_for(self, capturer: str | None, requested_pool: Any) -> tuple[Hashable, bool, bool, bool]:
        """The key a starting capture goes to: ``(key, auto, fresh, grouped)`` -- released with its graphs, a new
        key, shared with other captures."""
        stack = self._group_stack()
        if stack:
            return stack[-1], False, False, True
        if capturer == "graphed_callables":  # one key per call: the pool id it made for its graphs
            return ("make_graphed_callables", _pool_ident(requested_pool)), True, False, True
        return CaptureKey(next(self._auto)), True, True, False

    def _on_end(self, graph: Any, capture: Capture) -> Callable[[bool], None]:
        report = self._report_new_blocks if self.hygiene else None

        def on_end(ok: bool) -> None:
            counted = CAPTURE_TIMES.start("routing")
            try:
                self.captures.end(capture, graph, ok, report)
            finally:
                CAPTURE_TIMES.stop(counted)

        return on_end

    # -- hygiene ---------------------------------------------------------------------------

    def _blocks(self, entry: KeyPool) -> set[tuple[int, int]]:
        return set(self.keys.backend.pool_active_blocks(entry.pool))

    def _report_new_blocks(self, entry: KeyPool, before: frozenset[tuple[int, int]]) -> None:
        new = sorted(self._blocks(entry) - before)
        if not new:
            return
        alloc = self.keys.allocator
        space = alloc.spaces.get(entry.space_id) if alloc and entry.space_id else None
        outside = [b for b in new if space is not None and not space.contains(b[0])]
        if outside:
            log.warning("key %r: %d block(s) of the capture did not come from graphkit's space: the capture "
                        "allocated through the framework's own allocator", entry.key, len(outside))
        log.info("key %r: %d block(s), %s, allocated during the capture are still live after it (its outputs, "
                 "and anything it created and kept: a cache born in a capture lives in memory other graphs "
                 "overwrite; warm up first)", entry.key, len(new), fmt_bytes(sum(s for _, s in new)))


def _pool_ident(pool: Any) -> Any:
    """A hashable name of the pool a caller passed (a framework pool id, or the object's identity)."""
    if isinstance(pool, tuple):
        return tuple(pool)
    return id(pool) if pool is not None else None


def _watcher(ref: weakref.WeakMethod) -> Callable[[Any, Any], Route | None]:
    """The watcher of a routing held weakly (the backend's routing must not keep the pools alive)."""
    def watch(graph: Any, requested_pool: Any) -> Route | None:
        method = ref()
        return None if method is None else method(graph, requested_pool)
    return watch
