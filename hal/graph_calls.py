"""The graph, stream, pool and capture calls of :class:`hal.Backend`.

An engine loop on any backend is written with them (``fake`` on a CPU, ``cuda`` on a GPU)::

    be = hal.get_backend()
    stream = be.create_stream()
    graphs, inputs, outputs = {}, {}, {}
    for n in (64, 32, 16, 8):                          # largest first
        inputs[n] = torch.zeros(n, 256, device=be.torch_device())
        graphs[n] = be.create_graph()
        with be.capture(graphs[n], stream=stream):     # memory from a pool of its own (pool=None)
            outputs[n] = model(inputs[n])
    inputs[8][:5].copy_(batch)                         # a batch of 5 in the graph of size 8
    be.replay(graphs[8])                               # outputs[8][:5] holds its result
    for graph in graphs.values():
        be.release_graph(graph)

:class:`GraphCalls` remembers each pool (paused, released) and the pool
each graph was captured into, routed or not, so that :meth:`GraphCalls.replay`
refuses a graph whose memory is gone or asleep.

Graphs, pools and streams are objects of the backend's own (what
``create_graph``, ``create_pool``, ``create_stream`` return); a call given a
plain value instead (``None`` where one is required, a number, a string, a
container) raises :class:`hal.InvalidArgumentError` naming the argument before
the plugin sees it (:meth:`GraphCalls._check_object`), and a router must be
callable and return a :class:`hal.types.Route` or ``None``.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from hal import api, routing
from hal.errors import CaptureError, InvalidArgumentError, InvalidStateError, PluginValidationError
from hal.hook_calls import ADDRESS_LIMIT
from hal.stream_calls import StreamCalls
from hal.types import ON_REPLAY, CaptureRouter, GraphAddresses, Route


#: what a graph, pool or stream never is: plain values (a pool given as its number, a stream as its name...)
class GraphCalls(StreamCalls):
    """Streams, pools, captures, routing and replays through the plugin; owns what a replay checks of the pool
    a graph was captured into (:meth:`_init_graphs` makes it)."""

    def _init_graphs(self) -> None:
        self._local = threading.local()
        self._pools = _ByIdentity()  # pool -> its _PoolState (paused, released)
        self._graph_pool = _ByIdentity()  # graph -> the _PoolState of the pool it was captured into, or _RELEASED

    # -- pools ------------------------------------------------------------

    def create_pool(self, alloc: api.AllocFn | None = None, free: api.FreeFn | None = None, *,
                    paused: Callable[[], bool] | None = None) -> Any:
        """A memory pool for captures; with ``alloc``/``free``, its segments come from them.

        :param paused: with callbacks: tells whether the memory behind them is
            released for now (asleep); :meth:`replay` of a graph captured into
            the pool raises :class:`InvalidStateError` while it says ``True``.
        :raises UnsupportedError: callbacks given but the backend lacks ``"custom_pool"``.

        >>> pool = be.create_pool()                   # the device's own allocator
        >>> with be.capture(g1, pool=pool): ...       # two graphs share one pool (never replayed at once)
        >>> with be.capture(g2, pool=pool): ...
        >>> custom = be.create_pool(alloc, free)      # alloc(size) -> ptr, free(ptr, size): graphkit's vmm pools
        """
        if (alloc is None) != (free is None):
            raise self._err(InvalidArgumentError, "create_pool", "give both alloc and free, or neither")
        if paused is not None and (alloc is None or not callable(paused)):
            raise self._err(InvalidArgumentError, "create_pool",
                            f"paused={paused!r} must be a callable, given with alloc and free")
        if alloc is not None:
            self._refuse_without("custom_pool", "create_pool",
                                 "no pools over custom allocator callbacks on this backend")
        pool = self._graph_call("create_pool", alloc=alloc, free=free)
        self._pools.put(pool, _PoolState(paused))
        return pool

    def use_pool(self, pool: Any) -> AbstractContextManager[None]:
        """Context manager: the framework's allocations on this thread inside it come from ``pool``.

        :raises UnsupportedError: the backend lacks ``"use_pool"``.

        >>> pool = be.create_pool(alloc, free)
        >>> with be.use_pool(pool):
        ...     weights = torch.empty(1 << 20, device=be.torch_device())   # its memory comes from alloc
        """
        self._refuse_without("use_pool", "use_pool", "this backend cannot direct the framework's allocations to a pool")
        pool = backend_pool(pool)
        self._check_object("use_pool", "pool", pool)
        return self._graph_call("use_pool", pool=pool)

    def tensor_at(self, ptr: int, nbytes: int, owner: Any = None) -> Any:
        """A ``torch.uint8`` tensor over ``nbytes`` of device memory at ``ptr`` (no copy, not owning it).

        The tensor and its views keep ``owner`` alive.
        """
        self._check_ptr("tensor_at", ptr)
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or not 0 <= nbytes < ADDRESS_LIMIT - ptr:
            raise self._err(InvalidArgumentError, "tensor_at",
                            f"nbytes={nbytes!r} must be an int >= 0 that keeps ptr + nbytes below 2**64")
        return self._graph_call("tensor_at", ptr=ptr, nbytes=nbytes, owner=owner)

    def pool_paused(self, pool: Any) -> bool:
        """Whether the memory behind ``pool`` is released for now (see ``create_pool(paused=...)``)."""
        state = self._pools.get(backend_pool(pool))
        return bool(state is not None and state.paused is not None and state.paused())

    def pool_active_blocks(self, pool: Any) -> list[tuple[int, int]]:
        """``(address, nbytes)`` of every block of ``pool`` still in use."""
        self._check_object("pool_active_blocks", "pool", pool)
        return list(self._graph_call("pool_active_blocks", pool=pool))

    def release_pool(self, pool: Any) -> None:
        """Drop a pool; its segments go back where they came from (once their tensors die).

        A graph captured into it can no longer replay (:meth:`replay` raises).

        >>> be.release_graph(graph)          # graphs first
        >>> be.release_pool(pool)
        """
        self._check_object("release_pool", "pool", pool)
        self._graph_call("release_pool", pool=pool)
        state = self._pools.get(pool)
        if state is not None:
            state.released = True  # the graphs captured into it hold the state
            self._pools.pop(pool)

    # -- graphs -----------------------------------------------------------

    def create_graph(self, *, lazy: bool = False) -> Any:
        """A new, empty graph (capture into it with :meth:`capture`).

        ``lazy=True`` (needs ``"lazy_graphs"``): instantiated at its first replay, not at its capture's end.

        >>> graph = be.create_graph()
        >>> rare = be.create_graph(lazy=True)   # instantiated only if it is ever replayed
        """
        if not isinstance(lazy, bool):
            raise self._err(InvalidArgumentError, "create_graph", f"lazy={lazy!r} must be True or False")
        if lazy:
            self._refuse_without("lazy_graphs", "create_graph",
                                 "lazy=True: this backend instantiates every graph at the end of its capture")
        return self._graph_call("create_graph", lazy=lazy)

    def capture(self, graph: Any, pool: Any = None, stream: Any = None,
                capture_error_mode: str | None = None, *, inspect: bool = False) -> AbstractContextManager[Any]:
        """Context manager that captures the work done inside it into ``graph``.

        ``capture_error_mode=None`` uses the backend's default mode.
        ``inspect=True`` records what :meth:`graph_addresses` reports (needs
        ``"graph_addresses"``). Work done inside runs once, as it is recorded; a host sync
        (``.item()``, printing a tensor) inside raises, as it does on CUDA.

        >>> graph, x = be.create_graph(), torch.zeros(8, 256, device=be.torch_device())
        >>> with be.capture(graph, pool=pool, stream=stream):
        ...     y = torch.relu(x @ w)          # y lives in the pool's memory
        >>> x.copy_(new_input); be.replay(graph)   # y holds relu(new_input @ w)
        """
        if capture_error_mode not in (None, "global", "thread_local", "relaxed"):
            raise self._err(InvalidArgumentError, "capture",
                            f"capture_error_mode={capture_error_mode!r} must be global, thread_local or relaxed")
        if inspect:
            self._refuse_without("graph_addresses", "capture",
                                 "inspect=True: this backend cannot tell which addresses a graph uses")
        owner = getattr(pool, "__hal_backend__", None)  # a graphkit pool handle: the backend of its pools
        if owner is not None and (owner.name, owner.device) != (self.name, self.device):
            raise self._err(CaptureError, "capture", f"pool={pool!r} belongs to {owner.name}:{owner.device}, not "
                            f"to this backend ({self.name}:{self.device}): capture through the backend of the pools")
        pool = backend_pool(pool)
        self._check_object("capture", "graph", graph)
        self._check_object("capture", "pool", pool, optional=True)
        self._check_object("capture", "stream", stream, optional=True)
        inner = self._graph_call("capture", graph=graph, pool=pool, stream=stream,
                                 capture_error_mode=capture_error_mode, inspect=bool(inspect))
        return self._tracking(graph, pool, inner)

    @contextlib.contextmanager
    def _tracking(self, graph: Any, pool: Any, inner: AbstractContextManager[Any]) -> Iterator[Any]:
        """Run ``inner`` (a capture of ``graph``) and remember the pool it drew from, routed or not."""
        stack = self._capturing()
        chosen_pools = [pool]  # a router that chooses another pool appends it, a process router too
        stack.append(chosen_pools)
        try:
            with routing.noting_routes(lambda route: chosen_pools.append(route.pool)), inner as captured:
                yield captured
        finally:
            chosen = stack.pop()[-1]
        state = None if chosen is None else self._pools.get(chosen)
        if state is not None:
            self._graph_pool.put(graph, state)
        else:
            self._graph_pool.pop(graph)

    def _capturing(self) -> list[list[Any]]:
        stack = getattr(self._local, "capturing", None)
        if stack is None:
            stack = self._local.capturing = []
        return stack

    def route_captures(self, router: CaptureRouter) -> AbstractContextManager[None]:
        """Context manager: every capture started inside it takes the pool ``router`` chooses.

        See :func:`hal.api.route_captures`.

        :raises UnsupportedError: the backend lacks ``"capture_routing"``.

        >>> from hal.types import Route
        >>> def router(graph, requested_pool):   # None: the capture keeps the pool it asked for
        ...     return Route(my_pool)
        >>> with be.route_captures(router):
        ...     engine.capture_all()            # its torch.cuda.graph(...) captures draw from my_pool
        """
        if not callable(router):
            raise self._err(InvalidArgumentError, "route_captures", f"router={router!r} must be callable")
        self._refuse_without("capture_routing", "route_captures", "this backend cannot route the framework's captures")
        return self._graph_call("route_captures", router=routing.noted_router(router, self._note_route))

    def _note_route(self, route: Route) -> None:
        """A router of this device chose ``route``: a capture through this facade draws from its pool, which
        replay checks."""
        stack = self._capturing()
        if stack:
            stack[-1].append(route.pool)

    def graph_addresses(self, graph: Any) -> GraphAddresses:
        """The memory ``graph``'s replay reads or writes, read from the graph (see :func:`hal.api.graph_addresses`).

        :raises UnsupportedError: the backend lacks ``"graph_addresses"``.
        """
        self._refuse_without("graph_addresses", "graph_addresses",
                             "this backend cannot tell which addresses a graph uses")
        self._check_object("graph_addresses", "graph", graph)
        found = self._graph_call("graph_addresses", graph=graph)
        if not isinstance(found, GraphAddresses):
            raise self._err(PluginValidationError, "graph_addresses",
                            f"the backend returned {type(found).__name__}, not a hal.types.GraphAddresses")
        return found

    def replay(self, graph: Any) -> None:
        """Launch a captured graph (through its router where a route owns its replays: ``Route.on_replay``).

        :raises InvalidStateError: the graph was released, the pool it was captured into was released, or
            that pool's memory is paused (see ``create_pool(paused=...)``).

        >>> x.copy_(batch)                   # the static input the graph was captured with
        >>> be.replay(graph)                 # its outputs hold the result (until the next replay)
        """
        (getattr(graph, ON_REPLAY, None) or self.launch)(graph)

    def launch(self, graph: Any) -> None:
        """:meth:`replay` without a router's say: ``graph``'s executable as it is now (after
        ``update_graph(graph, source)``, ``source``'s work; a lazy graph's own at its first launch)."""
        self.check_replayable(graph)
        direct = self._direct_replay()
        if direct is not None:
            self._check_open("replay")
            direct(graph)
            return
        self._graph_call("replay", graph=graph)

    def check_replayable(self, graph: Any) -> None:
        """Raise what :meth:`replay` raises before it launches ``graph`` (its memory released or paused)."""
        self._check_open("replay")  # a closed backend released every graph: it says so, not "released"
        state = self._graph_pool.get(graph)
        if state is None:  # not captured through this facade: at least a graph (a captured one is known)
            self._check_object("replay", "graph", graph)
        elif state.released or (state.paused is not None and state.paused()):
            raise self._err(InvalidStateError, "replay", state.why_not())

    def _release_graphs(self, collect: Callable[[], AbstractContextManager[None]]) -> tuple[int, int]:
        """Close's graph steps: release the graphs still live, then their pools (each inside ``collect()``,
        which keeps a failure and goes on), and forget what was collected unreleased; how many of each."""
        graphs, pools = self.accounting.graphs.alive(), self.accounting.pools.alive()
        for graph in graphs:  # graphs first: they hold their pools' memory
            with collect():
                self.release_graph(graph)
        for pool in pools:
            with collect():
                self.release_pool(pool)
        self.accounting.graphs.clear()  # what was collected unreleased is gone with the backend
        self.accounting.pools.clear()
        return len(graphs), len(pools)

    def update_graph(self, graph: Any, source: Any) -> None:
        """``graph``'s launches run ``source``'s work (see :func:`hal.api.update_graph`; ``"graph_update"``)."""
        for kind, value in (("graph", graph), ("source", source)):
            self._check_object("update_graph", kind, value)
        self._refuse_without("graph_update", "update_graph", "this backend cannot update an executable graph")
        released = [name for name, g in (("graph", graph), ("source", source)) if self._graph_pool.get(g) is _RELEASED]
        if released:
            raise self._err(InvalidStateError, "update_graph", f"{released[0]} was released")
        self._graph_call("update_graph", graph=graph, source=source)
        state = self._graph_pool.get(source)  # graph's replays use source's memory from now on
        if state is None:
            self._graph_pool.pop(graph)
        else:
            self._graph_pool.put(graph, state)

    def release_graph(self, graph: Any) -> None:
        """Destroy a graph (its pool's memory stays with the pool); a later :meth:`replay` of it raises.

        >>> be.release_graph(graph)
        """
        self._check_object("release_graph", "graph", graph)
        self._graph_call("release_graph", graph=graph)
        self._graph_pool.put(graph, _RELEASED, weak_only=True)


@dataclass(eq=False)
class _PoolState:
    """What :meth:`Backend.replay` checks of the pool a graph was captured into (shared with the graph)."""

    paused: Callable[[], bool] | None = None
    released: bool = False

    def why_not(self) -> str:
        if self is _RELEASED:
            return "the graph was released (release_graph); capture a new graph to replay this work"
        if self.released:
            return ("the pool the graph was captured into was released (release_pool, or graphkit's "
                    "pools.release(key) / close()), so the memory its replay reads and writes is gone; capture "
                    "the graph again into a live pool (release graphs before their pools)")
        return "the graph's memory is paused (released while asleep): resume it before replaying"


#: the state of a released graph's pool: nothing replays it
_RELEASED = _PoolState(released=True)


class _ByIdentity:
    """A map keyed by object identity that forgets an object when it dies (objects need not be hashable)."""

    def __init__(self) -> None:
        self._items: dict[int, tuple[Callable[[], Any], Any]] = {}
        self._lock = threading.Lock()

    def put(self, obj: Any, value: Any, *, weak_only: bool = False) -> None:
        """Map ``obj`` to ``value``; ``weak_only``: forget ``obj`` instead where it cannot be weakly referred
        to (a mark that must not keep it alive)."""
        key = id(obj)
        items = self._items

        def forget(_: object) -> None:
            items.pop(key, None)

        try:
            ref: Callable[[], Any] = weakref.ref(obj, forget)
        except TypeError:  # not weakly referable: held until popped
            if weak_only:
                self.pop(obj)
                return
            ref = functools.partial(_same, obj)
        with self._lock:
            self._items[key] = (ref, value)

    def get(self, obj: Any) -> Any:
        item = self._items.get(id(obj))
        return item[1] if item is not None and item[0]() is obj else None

    def pop(self, obj: Any) -> None:
        with self._lock:
            item = self._items.get(id(obj))
            if item is not None and item[0]() is obj:
                del self._items[id(obj)]


def _same(obj: Any) -> Any:
    return obj


def backend_pool(pool: Any) -> Any:
    """The backend pool behind ``pool``: objects that stand for one (a graphkit pool handle) say so
    through a ``__hal_pool__`` attribute, which raises a :class:`hal.HalError` once that pool is gone."""
    unwrap = getattr(type(pool), "__hal_pool__", None)
    return pool if unwrap is None else pool.__hal_pool__


