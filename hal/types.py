"""Small value types shared by the facade, the backends and graphkit."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

ALLOCATION_ALIGNMENT = 512
"""Bytes every framework block starts on and is a multiple of (torch's caching allocator rounds to it).

graphkit's bump allocator aligns pool segments to it and the fake device's
block pool rounds blocks to it, so both place tensors where a device would.
"""

#: A device stream: the framework's stream object (``torch.cuda.Stream``...) or the backend's stand-in.
Stream = Any
#: A memory pool graph captures draw from: an object of the backend's own (``hal.Backend.create_pool``).
Pool = Any
#: A graph: an object of the backend's own (``hal.Backend.create_graph``).
Graph = Any
# None of the three is ever a plain value (a number, a string, a list...): the facade refuses one naming the argument,
# before the backend sees it; only a framework's pool id (a tuple, ``torch.cuda.graph_pool_handle()``) passes as a pool.


@dataclass(frozen=True)
class MemInfo:
    """Device memory as the driver reports it, in bytes."""

    free: int
    total: int

    @property
    def used(self) -> int:
        return self.total - self.free


@dataclass(frozen=True)
class BackendInfo:
    """One entry of :func:`hal.list_backends`."""

    name: str
    available: bool
    reason: str
    """Why the backend is unavailable ("" when it is available)."""
    origin: str
    """``"built-in"`` or the distribution that provides it (``"name version"``)."""
    priority: int
    """Lower is preferred when no backend is named."""


@dataclass(frozen=True)
class MappedRange:
    """One live mapping recorded by the facade: ``size`` bytes at ``ptr`` backed by ``handle``."""

    ptr: int
    size: int
    handle: object


@dataclass(frozen=True)
class GraphAddresses:
    """The device memory one captured graph's replay reads or writes, as the graph itself says.

    ``spans`` are ``(address, nbytes)``; a backend that finds pointers but not
    the sizes behind them (arguments of device kernels) reports ``nbytes=1``.
    ``nodes`` counts what was inspected (ops of a recording, nodes of a device
    graph); ``missed`` how many of those could not be read (a kernel whose
    argument layout is unknown): the answer is complete when it is 0.
    """

    spans: tuple[tuple[int, int], ...]
    nodes: int = 0
    missed: int = 0
    seconds: float = 0.0  # time the backend spent reading the graph

    @property
    def complete(self) -> bool:
        return self.missed == 0


#: the attribute of a backend graph object whose replays a router owns: ``graph.on_replay(graph)`` runs it
#: (set by the backend from :attr:`Route.on_replay`; see :meth:`hal.Backend.replay`)
ON_REPLAY = "on_replay"


def _nothing(*_: Any) -> None:
    return None


@dataclass
class Route:
    """Where one routed capture draws its memory from, and whom to tell what became of it.

    A router (see :func:`hal.api.route_captures`) returns one per capture.
    The backend calls ``on_end(True)`` once the capture ended well and
    ``on_end(False)`` when it failed (the graph is then empty: ``on_release``
    is never called); after a good end it calls ``on_release(collected)``
    exactly once when the graph is destroyed: reset or released
    (``collected=False``) or garbage-collected (``collected=True``: the
    callback runs inside the garbage collector and must only take note).

    ``on_end(True)`` may refuse the graph by raising a :class:`hal.HalError`
    (graphkit does when the graph reads memory it must not): the backend
    then empties the graph, as after a failed capture (its caller releases
    it as usual), lets the error through, and never calls ``on_release``. With ``inspect`` set, a backend
    with ``"graph_addresses"`` records the graph's addresses before it calls
    ``on_end(True)``, so the router can ask for them there.

    With ``on_replay`` set, the router owns the graph's executable form: a
    backend with ``"lazy_graphs"`` leaves the graph uninstantiated at the end
    of its capture and hands every later replay of it -- :meth:`hal.Backend.replay`
    and the framework's own ``graph.replay()`` alike -- to ``on_replay(graph)``,
    ``graph`` being the backend's graph object (what ``create_graph`` returns;
    for a graph the framework made, one the backend made for it). The router
    then runs it with :meth:`hal.Backend.launch`, after :meth:`hal.Backend.update_graph`
    where it wants another executable to run this graph's work. Where the
    backend cannot leave the graph uninstantiated (no ``"lazy_graphs"``, a
    framework graph made before routing began), ``on_replay`` is never called
    and the graph replays as usual.
    """

    pool: Any
    on_end: Callable[[bool], None] = field(default=_nothing)
    on_release: Callable[[bool], None] = field(default=_nothing)
    inspect: bool = False
    on_replay: Callable[[Any], None] | None = None


#: ``router(graph, requested_pool) -> Route | None``: chooses the pool of a capture that is starting,
#: or passes it on (None) to the next router out; a capture no router takes runs as the caller asked.
#: ``graph`` is the framework's graph object (``torch.cuda.CUDAGraph``...) or the backend's;
#: ``requested_pool`` is whatever the caller passed (None, a pool id, a backend pool).
CaptureRouter = Callable[[Any, Any], "Route | None"]


def round_up(n: int, multiple: int) -> int:
    """Round ``n`` up to a multiple of ``multiple``."""
    return -(-n // multiple) * multiple


def fmt_bytes(n: float) -> str:
    """Human-readable bytes: ``fmt_bytes(3 << 20) == '3.0 MiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
