"""Choosing the pool of a capture: the routers of its device, innermost first, then the process's.

A backend whose captures can be routed (``"capture_routing"``) asks, for each
capture that starts, :func:`choose_route` over its device's routers (those of
:meth:`hal.Backend.route_captures`, innermost first) and, where none takes it,
:func:`process_route` over the process's routers (:func:`hal.route_every_capture`).
A graph whose routed capture ended well reports its end once through
:func:`watch_release`. Device-specific routing (patching a framework's graph
class) stays with the backends; it learns of the process's routers through
:func:`on_process_routers_change`.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from hal.errors import InvalidArgumentError
from hal.types import CaptureRouter, Route

log = logging.getLogger("hal.routing")

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


__all__ = ["ProcessRouter", "add_process_router", "choose_route", "has_process_routers", "noting_routes",
           "on_process_routers_change", "process_route", "remove_process_router", "watch_release"]
