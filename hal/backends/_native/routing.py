"""Routing the captures a torch device extension starts (``torch.cuda.graph``, ``torch.npu.graph``).

Engines call ``torch.<device>.graph(g, pool=...)`` themselves. To give each
of those captures the pool a router chooses, :class:`GraphClassRouting`
wraps two methods of the framework's graph class while at least one router
is active -- ``capture_begin`` (every capture passes there: the ``graph``
context manager, ``make_graphed_callables`` and direct calls) and
``capture_end`` -- and puts the originals back when the last router leaves.

A graph that was routed learns to report its own end: its ``reset`` is
wrapped on the instance (the class is left alone) and a ``weakref.finalize``
covers a graph that is simply dropped, so a route's ``on_release`` runs
exactly once, also long after the routing block ended
(:func:`hal.routing.watch_release`). Which route a capture takes is
:mod:`hal.routing`'s choice: the device's routers, then the process's.

Where the backend can read a graph under construction (an *inspector*), a
route with ``inspect`` set has the graph's addresses recorded on the graph
object (attribute :data:`ADDRESSES`) just before the framework ends the
capture, so that the route's ``on_end(True)`` can check them. When
``on_end(True)`` raises, the graph is refused: it is reset, marked
(:data:`REFUSED`), its route's ``on_release`` is never called, the stream
that ``torch.<device>.graph`` made current is given back, and the error
leaves ``capture_end``.

A route with ``on_replay`` (:attr:`hal.types.Route.on_replay`) owns the
graph's executable form. Where the backend says how to make its graph object
for a framework graph (``adopt``) and the graph class takes ``keep_graph``,
graphs made while the class is routed keep their captured graph and are not
instantiated at the end of their capture (``__init__`` is wrapped to ask for
``keep_graph=True``): a served graph's ``replay`` and ``instantiate`` are
wrapped on the instance and its replays go to ``on_replay``; any other graph
made so is instantiated as soon as its capture ends, as the framework would
have done.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from hal.routing import choose_route, has_process_routers, on_process_routers_change, process_route, watch_release
from hal.types import CaptureRouter, GraphAddresses, Route

log = logging.getLogger("hal.routing")

_ROUTE = "_hal_route"  # attribute of a graph whose capture is being routed
UNROUTED = "_hal_unrouted"  # set on a graph the backend captures for itself (no router sees it)
#: attribute of a graph: what its last capture uses (GraphAddresses), or why that could not be read (str)
ADDRESSES = "_hal_addresses"
#: attribute of a graph whose route refused it in on_end(True) (the graph was reset)
REFUSED = "_hal_refused"

#: reads the graph being captured on the current stream: ``inspector(graph) -> GraphAddresses``
Inspector = Callable[[Any], GraphAddresses]
#: attribute of a framework graph that routing made with ``keep_graph=True`` in place of the caller's ``False``
KEPT = "_hal_kept"
#: attribute of a framework graph: a weak reference to the backend's graph object wrapping it (hal's own graphs)
RECORD = "_hal_record"
#: attribute of a framework graph whose replays a route serves: the backend graph object made for it
SERVED = "_hal_served"
#: ``adopt(framework_graph, device) -> backend graph``: the backend's graph object for a framework graph
Adopt = Callable[[Any, int], Any]


def takes_keep_graph(graph_class: Any) -> bool:
    """Whether ``graph_class(keep_graph=True)`` keeps the captured graph (``torch.cuda.CUDAGraph`` since 2.8)."""
    try:
        return "keep_graph" in inspect.signature(graph_class).parameters
    except (TypeError, ValueError):  # a signature the class does not expose
        return False


class GraphClassRouting:
    """Routes the captures of one framework graph class, per device, to the active routers.

    :param graph_class: e.g. ``torch.cuda.CUDAGraph``.
    :param current_device: the device a capture starting now belongs to.
    :param pool_id: turns the backend pool a router chose into what ``capture_begin`` takes.
    :param inspector: reads the addresses of the graph being captured on the current stream, called
        just before the framework's ``capture_end`` for routes with ``inspect`` set; None where the
        backend cannot (see also :meth:`set_inspector`).
    :param prepare: makes the lazily created library state of the current stream (cuBLAS workspaces),
        called before a routed capture begins (see :mod:`hal.backends._native.stream_state`).
    """

    def __init__(self, graph_class: type, current_device: Callable[[], int],
                 pool_id: Callable[[Any], Any], inspector: Inspector | None = None,
                 prepare: Callable[[], None] | None = None, backend: str | None = None,
                 adopt: Adopt | None = None) -> None:
        self.graph_class = graph_class
        self.current_device = current_device
        self.pool_id = pool_id
        self.inspector = inspector
        self.prepare = prepare
        self.backend = backend  # the backend whose captures these are, for the process's routers
        self.adopt = adopt  # where the backend can serve a route's on_replay (see the module's doc)
        self._keeps = takes_keep_graph(graph_class)
        self._lock = threading.Lock()
        self._routers: dict[int, list[CaptureRouter]] = {}
        self._originals: dict[str, Any] | None = None

    # -- activation -----------------------------------------------------------

    @contextlib.contextmanager
    def activate(self, device: int, router: CaptureRouter) -> Iterator[None]:
        """Route the captures started on ``device`` to ``router`` inside the block."""
        with self._lock:
            self._routers.setdefault(device, []).append(router)
            self._sync_patch()
        try:
            yield
        finally:
            with self._lock:
                stack = self._routers[device]
                stack.remove(router)
                if not stack:
                    del self._routers[device]
                self._sync_patch()

    def _sync_patch(self) -> None:
        """The class is patched exactly while a router of some device, or of the process, is active."""
        wanted = bool(self._routers) or (has_process_routers() and self.backend is not None)
        if wanted and self._originals is None:
            self._patch()
        elif not wanted and self._originals is not None:
            self._unpatch()

    def routers_for(self, device: int) -> list[CaptureRouter]:
        """The active routers of ``device``, innermost first."""
        with self._lock:
            return list(reversed(self._routers.get(device, ())))

    @property
    def serves_replays(self) -> bool:
        """Whether graphs made while the class is routed can have their replays served (see the module's doc)."""
        return self.adopt is not None and self._keeps

    def _patch(self) -> None:
        cls: Any = self.graph_class  # a framework's graph class: routable() checked its two methods; patched here
        names = ("capture_begin", "capture_end") + (("__init__",) if self.serves_replays else ())
        self._originals = {name: cls.__dict__.get(name) for name in names}
        begin, end, init = cls.capture_begin, cls.capture_end, cls.__init__
        routing = self

        def capture_begin(graph: Any, pool: Any = None, *args: Any, **kwargs: Any) -> Any:
            forget(graph, ADDRESSES, REFUSED)  # of an earlier capture of the same graph object
            if SERVED in getattr(graph, "__dict__", ()):  # captured again after a reset: replays as the class's
                forget(graph, SERVED, RECORD, "replay", "instantiate")
            if getattr(graph, _ROUTE, None) is None and not getattr(graph, UNROUTED, False):
                chosen = routing.begin(graph, pool, routing.current_device())
                if chosen is not None:
                    pool = routing.pool_id(chosen)
                    routing.prepare_stream(graph)
            try:
                return begin(graph, pool, *args, **kwargs)
            except BaseException:
                routing.end(graph, False)
                raise

        def capture_end(graph: Any, *args: Any, **kwargs: Any) -> Any:
            routing.inspect(graph)  # while the graph under construction can still be read
            try:
                result = end(graph, *args, **kwargs)
            except BaseException:
                routing.end(graph, False)
                raise
            try:
                routing.end(graph, True)
            finally:
                routing.instantiate_unserved(graph)
            return result

        def __init__(graph: Any, keep_graph: bool = False, *args: Any, **kwargs: Any) -> None:
            init(graph, True, *args, **kwargs)
            if not keep_graph:  # the caller's graph: instantiated at its capture's end unless a route serves it
                graph.__dict__[KEPT] = True

        cls.capture_begin = capture_begin
        cls.capture_end = capture_end
        if "__init__" in names:
            cls.__init__ = __init__
        log.debug("routing the captures of %s", cls.__qualname__)

    def _unpatch(self) -> None:
        assert self._originals is not None
        for name, original in self._originals.items():
            if original is None:  # inherited: drop our override
                delattr(self.graph_class, name)
            else:
                setattr(self.graph_class, name, original)
        self._originals = None
        log.debug("captures of %s no longer routed", self.graph_class.__qualname__)

    # -- one capture ------------------------------------------------------------

    def begin(self, graph: Any, requested_pool: Any, device: int) -> Any | None:
        """Ask the routers of ``device`` for the capture's pool; None when none routes it.

        The route is kept on the graph until :meth:`end`.
        """
        route = choose_route(self.routers_for(device), graph, requested_pool)
        if route is None and self.backend is not None:
            route = process_route(self.backend, device, graph, requested_pool)
        if route is None:
            return None
        setattr(graph, _ROUTE, route)
        return route.pool

    def prepare_stream(self, graph: Any) -> None:
        """Before the routed capture of ``graph`` begins: make the current stream's library state, so
        that it is not born inside the capture (ending the route when that fails)."""
        if self.prepare is None:
            return
        try:
            self.prepare()
        except BaseException:
            self.end(graph, False)
            raise

    def set_inspector(self, inspector: Inspector | None) -> None:
        """Read graphs with ``inspector`` from now on (one per graph class: every device's captures use it)."""
        self.inspector = inspector

    def inspect(self, graph: Any) -> None:
        """Record the addresses of ``graph``, being captured, when its route asks and nothing recorded them yet.

        A failed read is recorded as its reason (a ``str``), so that the route learns why there is none.
        """
        route: Route | None = getattr(graph, "__dict__", {}).get(_ROUTE)
        inspector = self.inspector
        if route is None or not route.inspect or inspector is None or ADDRESSES in graph.__dict__:
            return
        try:
            found: GraphAddresses | str = inspector(graph)
        except Exception as exc:  # noqa: BLE001 - the capture goes on; the route sees why nothing was read
            found = f"{type(exc).__name__}: {exc}"
            log.warning("the addresses of a routed capture could not be read: %s", found)
        graph.__dict__[ADDRESSES] = found

    def end(self, graph: Any, ok: bool) -> None:
        """The routed capture of ``graph`` ended (``ok``) or failed; idempotent.

        When the route's ``on_end(True)`` raises, the graph is refused (see :meth:`refuse`) and the
        error propagates.
        """
        route: Route | None = graph.__dict__.pop(_ROUTE, None) if hasattr(graph, "__dict__") else None
        if route is None:
            return
        if not ok:
            forget(graph, ADDRESSES)
            route.on_end(False)
            return
        try:
            route.on_end(True)
        except BaseException:
            self.refuse(graph)
            raise
        watch_release(graph, _forgetting(graph, route.on_release))
        if route.on_replay is not None:
            self.serve(graph, route.on_replay)

    def serve(self, graph: Any, on_replay: Callable[[Any], None]) -> None:
        """Hand the replays of ``graph`` (captured, kept uninstantiated) to ``on_replay``, where it can be done."""
        attrs = graph.__dict__
        ref = attrs.get(RECORD)
        record = ref() if ref is not None else None
        if record is not None:  # a backend graph captured through hal: the backend reads its on_replay
            record.on_replay = on_replay
            return
        if not attrs.get(KEPT) or self.adopt is None:
            return  # made before routing began (or by a caller that manages its own instantiation)
        record = self.adopt(graph, self.current_device())
        record.on_replay = on_replay

        def replay() -> None:
            record.on_replay(record)

        def instantiate() -> None:
            """Served: the owner of its replays instantiates it when it must."""

        attrs["replay"], attrs["instantiate"] = replay, instantiate
        attrs[RECORD] = weakref.ref(record)
        attrs[SERVED] = record  # the graph keeps its record alive (the record holds the graph weakly)

    def instantiate_unserved(self, graph: Any) -> None:
        """A graph that routing made to keep its captured graph, and no route serves: instantiated now, as
        the framework would have done at the end of its capture."""
        attrs = getattr(graph, "__dict__", {})
        if attrs.get(KEPT) and SERVED not in attrs and not attrs.get(REFUSED):
            try:
                type(graph).instantiate(graph)
            except Exception as exc:  # noqa: BLE001 - as the framework: its first replay instantiates it
                log.debug("instantiating an unserved graph at the end of its capture: %s", exc)

    def refuse(self, graph: Any) -> None:
        """Reset a graph whose route refused it, as after a failed capture, and mark it :data:`REFUSED`.

        The capture itself ended, so the stream the capture block made current is given back as the
        block would have (see :func:`leave_capture_block`).
        """
        forget(graph, ADDRESSES)
        graph.__dict__[REFUSED] = True
        try:
            type(graph).reset(graph)
        except Exception as exc:  # noqa: BLE001 - the refusal's own error is the one that matters
            log.debug("reset of a refused graph: %s", exc)
        leave_capture_block(graph)


#: how far up the stack :func:`leave_capture_block` looks for the capture block
_BLOCK_FRAMES = 8


def leave_capture_block(graph: Any) -> bool:
    """Undo the stream switch of the ``torch.<device>.graph`` block whose ``capture_end`` is raising.

    torch's graph context managers (``torch.cuda.graph``, and torch_npu's after it) make the
    capture stream current through a ``stream_ctx`` on entry and give it back after ``capture_end``
    returns; when ``capture_end`` raises they skip that, and the caller's later work would run on
    the capture stream, unordered with its own. After a refusal the capture has ended, so the block
    is found among the callers (an object holding ``graph`` and a ``stream_ctx``) and its stream
    context left. Returns whether one was found.
    """
    frame = sys._getframe(1)
    for _ in range(_BLOCK_FRAMES):
        frame = frame.f_back  # type: ignore[assignment]
        if frame is None:
            return False
        block = frame.f_locals.get("self")
        context = getattr(block, "stream_ctx", None)
        if context is not None and any(v is graph for v in getattr(block, "__dict__", {}).values()):
            try:
                context.__exit__(None, None, None)
            except Exception as exc:  # noqa: BLE001 - the refusal's own error is the one that matters
                log.debug("leaving the capture block of a refused graph: %s", exc)
                return False
            return True
    return False


def forget(graph: Any, *names: str) -> None:
    """Drop the instance attributes ``names`` of ``graph`` where it has them."""
    attrs = getattr(graph, "__dict__", None)
    if attrs is not None:
        for name in names:
            attrs.pop(name, None)


def _forgetting(graph: Any, on_release: Callable[[bool], None]) -> Callable[[bool], None]:
    """``on_release``, after dropping what the graph's capture recorded (a reset graph uses nothing)."""
    ref = weakref.ref(graph)

    def released(collected: bool) -> None:
        target = ref()
        if target is not None:
            forget(target, ADDRESSES)
            served = target.__dict__.get(SERVED)
            if served is not None:  # its replays raise from now on, as a reset graph's do
                served.released = True
        on_release(collected)

    return released


_by_class: dict[type, GraphClassRouting] = {}
_by_class_lock = threading.Lock()


def routing_for(graph_class: type, current_device: Callable[[], int], pool_id: Callable[[Any], Any],
                prepare: Callable[[], None] | None = None, backend: str | None = None,
                adopt: Adopt | None = None) -> GraphClassRouting:
    """The one :class:`GraphClassRouting` of ``graph_class`` in this process (patched at once while the
    process has routers, see :func:`hal.routing.add_process_router`)."""
    with _by_class_lock:
        routing = _by_class.get(graph_class)
        if routing is None:
            routing = _by_class[graph_class] = GraphClassRouting(graph_class, current_device, pool_id,
                                                                 prepare=prepare, backend=backend, adopt=adopt)
        else:
            routing.prepare = routing.prepare or prepare
            routing.backend = routing.backend or backend
            routing.adopt = routing.adopt or adopt
        with routing._lock:
            routing._sync_patch()
        return routing


def _resync() -> None:
    """The process's routers changed: patch or unpatch every graph class hal knows."""
    with _by_class_lock:
        routings = list(_by_class.values())
    for routing in routings:
        with routing._lock:
            routing._sync_patch()


on_process_routers_change(_resync)


def routable(graph_class: Any) -> bool:
    """Whether captures of ``graph_class`` can be routed (it is a class with capture_begin and capture_end)."""
    return isinstance(graph_class, type) and all(callable(getattr(graph_class, m, None))
                                                 for m in ("capture_begin", "capture_end"))
