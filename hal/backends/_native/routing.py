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
exactly once, also long after the routing block ended.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from hal.types import CaptureRouter, Route

log = logging.getLogger("hal.routing")

_ROUTE = "_hal_route"  # attribute of a graph whose capture is being routed
UNROUTED = "_hal_unrouted"  # set on a graph the backend captures for itself (no router sees it)


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


class GraphClassRouting:
    """Routes the captures of one framework graph class, per device, to the active routers.

    :param graph_class: e.g. ``torch.cuda.CUDAGraph``.
    :param current_device: the device a capture starting now belongs to.
    :param pool_id: turns the backend pool a router chose into what ``capture_begin`` takes.
    """

    def __init__(self, graph_class: type, current_device: Callable[[], int],
                 pool_id: Callable[[Any], Any]) -> None:
        self.graph_class = graph_class
        self.current_device = current_device
        self.pool_id = pool_id
        self._lock = threading.Lock()
        self._routers: dict[int, list[CaptureRouter]] = {}
        self._originals: dict[str, Any] | None = None

    # -- activation -----------------------------------------------------------

    @contextlib.contextmanager
    def activate(self, device: int, router: CaptureRouter) -> Iterator[None]:
        """Route the captures started on ``device`` to ``router`` inside the block."""
        with self._lock:
            self._routers.setdefault(device, []).append(router)
            if self._originals is None:
                self._patch()
        try:
            yield
        finally:
            with self._lock:
                stack = self._routers[device]
                stack.remove(router)
                if not stack:
                    del self._routers[device]
                if not self._routers:
                    self._unpatch()

    def routers_for(self, device: int) -> list[CaptureRouter]:
        """The active routers of ``device``, innermost first."""
        with self._lock:
            return list(reversed(self._routers.get(device, ())))

    def _patch(self) -> None:
        cls: Any = self.graph_class  # a framework's graph class: routable() checked its two methods; patched here
        self._originals = {name: cls.__dict__.get(name) for name in ("capture_begin", "capture_end")}
        begin, end = cls.capture_begin, cls.capture_end
        routing = self

        def capture_begin(graph: Any, pool: Any = None, *args: Any, **kwargs: Any) -> Any:
            if getattr(graph, _ROUTE, None) is None and not getattr(graph, UNROUTED, False):
                chosen = routing.begin(graph, pool, routing.current_device())
                if chosen is not None:
                    pool = routing.pool_id(chosen)
            try:
                return begin(graph, pool, *args, **kwargs)
            except BaseException:
                routing.end(graph, False)
                raise

        def capture_end(graph: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                result = end(graph, *args, **kwargs)
            except BaseException:
                routing.end(graph, False)
                raise
            routing.end(graph, True)
            return result

        cls.capture_begin = capture_begin
        cls.capture_end = capture_end
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
        if route is None:
            return None
        setattr(graph, _ROUTE, route)
        return route.pool

    def end(self, graph: Any, ok: bool) -> None:
        """The routed capture of ``graph`` ended (``ok``) or failed; idempotent."""
        route: Route | None = graph.__dict__.pop(_ROUTE, None) if hasattr(graph, "__dict__") else None
        if route is None:
            return
        route.on_end(ok)
        if ok:
            watch_release(graph, route.on_release)


def choose_route(routers: list[CaptureRouter], graph: Any, requested_pool: Any) -> Route | None:
    """The route of the innermost router that takes the capture (a router returns None to pass it on)."""
    for router in routers:
        route = router(graph, requested_pool)
        if route is None:
            continue
        if not isinstance(route, Route):
            raise TypeError(f"a capture router must return a hal.types.Route or None, not {type(route).__name__}")
        return route
    return None


_by_class: dict[type, GraphClassRouting] = {}
_by_class_lock = threading.Lock()


def routing_for(graph_class: type, current_device: Callable[[], int],
                pool_id: Callable[[Any], Any]) -> GraphClassRouting:
    """The one :class:`GraphClassRouting` of ``graph_class`` in this process."""
    with _by_class_lock:
        routing = _by_class.get(graph_class)
        if routing is None:
            routing = _by_class[graph_class] = GraphClassRouting(graph_class, current_device, pool_id)
        return routing


def routable(graph_class: Any) -> bool:
    """Whether captures of ``graph_class`` can be routed (it is a class with capture_begin and capture_end)."""
    return isinstance(graph_class, type) and all(callable(getattr(graph_class, m, None))
                                                 for m in ("capture_begin", "capture_end"))
