"""Everything hal does to intercept a capture: choose its route, patch a framework's graph class, watch the end.

**The choice.** A backend whose captures can be routed (``"capture_routing"``)
asks, for each capture that starts, :func:`route_of`: its device's routers
(those of :meth:`hal.Backend.route_captures`, innermost first,
:func:`choose_route`) and, where none takes it, the process's routers
(:func:`route_every_capture`, :func:`process_route`). A router given to
:func:`route_every_capture` is asked, as ``router(backend, device, graph,
requested_pool)``, for every capture that no router of its device takes:
captures the framework starts (``torch.cuda.graph``, ``torch.npu.graph``...)
and captures through :meth:`hal.Backend.capture` of any backend. It may
return a :class:`hal.types.Route` or None, as a device's router does. Nothing
here opens a device or initialises a driver.

**The framework's graph class.** Engines call ``torch.<device>.graph(g,
pool=...)`` themselves. To give each of those captures the pool a router
chooses, :class:`GraphClassRouting` wraps two methods of the framework's graph
class (which class is the backend's to say: :func:`routing_for`) while at
least one router of a device or of the process is active --
``capture_begin`` (every capture passes there: the ``graph`` context manager,
``make_graphed_callables`` and direct calls) and ``capture_end`` -- and puts
the originals back when the last router leaves. The classes of extensions not
imported yet are patched when hal first sees them: call :func:`patch_imported`
again once a later one is imported (torch_npu, say).

**The end.** A graph whose routed capture ended well reports its end once
through :func:`watch_release`: its ``reset`` is wrapped on the instance (the
class is left alone) and a ``weakref.finalize`` covers a graph that is simply
dropped, so a route's ``on_release`` runs exactly once, also long after the
routing block ended.

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
import importlib
import inspect
import logging
import sys
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from hal.errors import InvalidArgumentError
from hal.transaction import Transaction
from hal.types import CaptureRouter, GraphAddresses, Route

log = logging.getLogger("hal.routing")

# -- the choice: a device's routers, then the process's --------------------------------------------------

#: ``router(backend, device, graph, requested_pool) -> Route | None``: asked for every capture no router of
#: its device takes, whatever the backend (by name) and device
ProcessRouter = Callable[[str, int, Any, Any], Route | None]

_process_routers: list[ProcessRouter] = []
_listeners: list[Callable[[], None]] = []
_lock = threading.Lock()
_noting = threading.local()  # ``stack``: what each capture under way on this thread is told of its process route


def _checked(route: Any) -> Route | None:
    if route is not None and not isinstance(route, Route):
        raise InvalidArgumentError(f"a capture router returned {route!r}: it must return a hal.types.Route or None "
                                   "(None passes the capture on)", call="route_captures")
    return route


def _first(routes: Iterable[Any]) -> Route | None:
    """The first route that is not None (routers are asked lazily, in order)."""
    for route in routes:
        if _checked(route) is not None:
            return route
    return None


def choose_route(routers: list[CaptureRouter], graph: Any, requested_pool: Any) -> Route | None:
    """The route of the innermost router that takes the capture (a router returns None to pass it on)."""
    return _first(router(graph, requested_pool) for router in routers)


def process_route(backend: str, device: int, graph: Any, requested_pool: Any) -> Route | None:
    """The route of the innermost process router that takes a capture of ``backend`` on ``device``."""
    with _lock:
        routers = list(reversed(_process_routers))
    route = _first(router(backend, device, graph, requested_pool) for router in routers)
    noters = getattr(_noting, "stack", None)
    if route is not None and noters:
        noters[-1](route)
    return route


def route_of(routers: list[CaptureRouter], backend: str | None, device: int, graph: Any,
             requested_pool: Any) -> Route | None:
    """The route of a capture of ``backend`` on ``device``: the innermost of ``routers`` (the device's, innermost
    first) that takes it, else the innermost process router that does (none asked where ``backend`` is None)."""
    route = choose_route(routers, graph, requested_pool)
    if route is None and backend is not None:
        route = process_route(backend, device, graph, requested_pool)
    return route


@contextlib.contextmanager
def noting_routes(note: Callable[[Route], None]) -> Iterator[None]:
    """Inside the block, on this thread, ``note(route)`` hears of the route :func:`process_route` chooses (the
    innermost block only): a facade learns which pool its capture drew from when a process router chose it."""
    stack = _noting.__dict__.setdefault("stack", [])
    stack.append(note)
    try:
        yield
    finally:
        stack.pop()


def noted_router(router: CaptureRouter, note: Callable[[Route], None]) -> CaptureRouter:
    """``router``, with ``note(route)`` told of each route it chooses (a facade learns which pool a capture
    through it draws from when a router of its device chose it)."""

    def noted(graph: Any, requested_pool: Any) -> Route | None:
        route = router(graph, requested_pool)
        if isinstance(route, Route):  # anything else is refused by the choice (see choose_route)
            note(route)
        return route

    return noted


def has_process_routers() -> bool:
    """Whether a router of the process is active (see :func:`add_process_router`)."""
    return bool(_process_routers)


def add_process_router(router: ProcessRouter) -> None:
    """Ask ``router`` for every capture no router of its device takes (the backends' graph classes known now
    are patched at once, later ones when hal first sees them)."""
    if not callable(router):
        raise InvalidArgumentError(f"router={router!r} must be callable as router(backend, device, graph, "
                                   "requested_pool) -> hal.types.Route | None", call="route_every_capture")
    with _lock:
        _process_routers.append(router)
    _changed()


def remove_process_router(router: ProcessRouter) -> None:
    """Stop asking ``router`` (added by :func:`add_process_router`)."""
    with _lock:
        _process_routers.remove(router)
    _changed()


def on_process_routers_change(listener: Callable[[], None]) -> None:
    """Call ``listener()`` after each router of the process is added or removed (a backend that patches a
    framework's graph class only while some router is active)."""
    with _lock:
        _listeners.append(listener)


def _changed() -> None:
    with _lock:
        listeners = list(_listeners)
    for listener in listeners:
        listener()


# -- the process's routers, whatever the backend and device (what graphkit's switch uses) ------------------

#: the built-in backends over a torch extension, and the module of their torch glue
FRAMEWORKS = (("cuda", "hal.backends.cuda.torch_glue"), ("ascend", "hal.backends.ascend.torch_glue"),
              ("mlu", "hal.backends.mlu.torch_glue"))


def patch_imported() -> list[str]:
    """Route the captures of every framework graph class whose extension is imported now; the backends' names."""
    found = []
    for name, module in FRAMEWORKS:
        if importlib.import_module(module).EXTENSION.class_routing(name) is not None:
            found.append(name)
    return found


@contextlib.contextmanager
def route_every_capture(router: ProcessRouter) -> Iterator[None]:
    """Inside the block, ``router`` is asked for every capture of the process that no device's router takes."""
    add_process_router(router)
    try:
        patch_imported()
        yield
    finally:
        remove_process_router(router)


# -- the end: a routed graph reports its release once ------------------------------------------------------


class _Once:
    """Calls ``on_release`` the first time it is called; later calls do nothing."""

    def __init__(self, on_release: Callable[[bool], None]) -> None:
        self._fn: Callable[[bool], None] | None = on_release
        self._lock = threading.Lock()

    def __call__(self, collected: bool) -> None:
        with self._lock:
            fn, self._fn = self._fn, None
        if fn is not None:
            try:
                fn(collected)
            except Exception as exc:  # noqa: BLE001 - a graph's teardown must not fail because of its router
                log.error("on_release of a routed graph failed: %s: %s", type(exc).__name__, exc)


def watch_release(graph: Any, on_release: Callable[[bool], None],
                  reset_name: str | None = "reset") -> Callable[[bool], None]:
    """Call ``on_release(collected)`` once, when ``graph`` is reset or garbage-collected.

    Returns the once-only callable, for a backend that destroys graphs by
    other means (call it with ``False`` then).
    """
    once = _Once(on_release)
    weakref.finalize(graph, once, True)
    if reset_name is None:
        return once
    original = getattr(type(graph), reset_name)
    ref = weakref.ref(graph)

    def reset(*args: Any, **kwargs: Any) -> Any:
        target = ref()  # a weak reference: the wrapper must not keep its graph alive
        try:
            # None: the graph was collected while ``graph.reset`` was looked up (``tmp().reset()``);
            # its destructor already did what reset does
            return None if target is None else original(target, *args, **kwargs)
        finally:
            once(False)

    setattr(graph, reset_name, reset)
    return once


# -- a framework's graph class, patched while a router is active ---------------------------------------

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
            with Transaction() as tx:
                tx.append(lambda: routing.end(graph, False))
                result = begin(graph, pool, *args, **kwargs)
                tx.commit()
            return result

        def capture_end(graph: Any, *args: Any, **kwargs: Any) -> Any:
            routing.inspect(graph)  # while the graph under construction can still be read
            with Transaction() as tx:
                tx.append(lambda: routing.end(graph, False))
                result = end(graph, *args, **kwargs)
                tx.commit()
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
        route = route_of(self.routers_for(device), self.backend, device, graph, requested_pool)
        if route is None:
            return None
        setattr(graph, _ROUTE, route)
        return route.pool

    def prepare_stream(self, graph: Any) -> None:
        """Before the routed capture of ``graph`` begins: make the current stream's library state, so
        that it is not born inside the capture (ending the route when that fails)."""
        if self.prepare is None:
            return
        with Transaction() as tx:
            tx.append(lambda: self.end(graph, False))
            self.prepare()
            tx.commit()

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
        with Transaction() as refusal:
            refusal.append(lambda: self.refuse(graph), retry=False)
            route.on_end(True)
            refusal.commit()
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


#: how far up the stack :func:`leave_capture_block` looks for the capture block (the refusal runs as the
#: undo step of a :class:`hal.transaction.Transaction`: three frames more between it and ``capture_end``)
_BLOCK_FRAMES = 12


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
    process has routers, see :func:`add_process_router`)."""
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


__all__ = ["ADDRESSES", "FRAMEWORKS", "GraphClassRouting", "KEPT", "ProcessRouter", "RECORD", "REFUSED", "SERVED",
           "UNROUTED", "add_process_router", "choose_route", "forget", "has_process_routers", "leave_capture_block",
           "noted_router", "noting_routes", "on_process_routers_change", "patch_imported", "process_route",
           "remove_process_router", "routable", "route_every_capture", "route_of", "routing_for", "takes_keep_graph",
           "watch_release"]
