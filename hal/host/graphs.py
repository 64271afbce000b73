"""The graph hooks of the hal contract for a device whose memory the host can address.

:class:`HostGraphs` is a mixin for a backend plugin class. Wired to the
device's own allocator, it implements every hook of the ``"graphs"``,
``"custom_pool"``, ``"capture_routing"``, ``"use_pool"``, ``"graph_addresses"``,
``"lazy_graphs"`` and ``"graph_update"`` capabilities (:data:`CAPABILITIES`) by
recording torch ops (:mod:`hal.host.tape`) into pools of blocks
(:class:`hal.host.pool.BlockPool`). A plugin declares more (a capability whose
hooks it adds) or less by overriding ``capabilities`` with ``@hal.hookimpl``
again: ``return super().capabilities() | {"memory_sharing"}``.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from hal.api import AllocFn, FreeFn, hookimpl
from hal.errors import CaptureError, InvalidArgumentError, PluginValidationError
from hal.host.inflight import InFlight
from hal.host.pool import BlockPool
from hal.routing import route_of, watch_release
from hal.transaction import Transaction
from hal.types import CaptureRouter, GraphAddresses

if TYPE_CHECKING:  # pragma: no cover
    from hal.host import tape

#: What :class:`HostGraphs` provides, as :func:`hal.api.capabilities` names it.
CAPABILITIES: frozenset[str] = frozenset({"graphs", "custom_pool", "capture_routing", "use_pool",
                                          "graph_addresses", "lazy_graphs", "graph_update"})


class HostStream:
    """A stand-in for a device stream: work on the host runs when it is issued."""

    _ids = itertools.count()

    def __init__(self) -> None:
        self.id = next(self._ids)

    def __repr__(self) -> str:
        return f"<host stream {self.id}>"


#: The stream work goes to when none is chosen (every :class:`HostGraphs` backend shares it).
DEFAULT_STREAM = HostStream()

_turns_lock = threading.Lock()
_turns: dict[tuple[str, int], threading.RLock] = {}


def capture_turn(name: str, device: int) -> threading.RLock:
    """The turn captures on host device ``device`` of backend ``name`` take, one at a time.

    A device capture records work and runs none of it; the host recorder runs every op while it records it,
    so a capture here is also a run of the graph. Captures into pools whose memory is shared (graphkit's
    spaces over one set of chunks) must not run at once, as replays must not: each capture of a host device,
    from its routing to its end, holds the device's turn (reentrant: a capture inside a capture on the same
    thread goes on), and captures from other threads wait for it.
    """
    with _turns_lock:
        turn = _turns.get((name, device))
        if turn is None:
            turn = _turns[(name, device)] = threading.RLock()
        return turn


class HostGraphs:
    """Mixin: graphs, pools and capture routing for a plugin whose memory the host can address.

    Call :meth:`init_host_graphs` from the plugin's constructor with the
    device's own allocator; the mixin's hooks do the rest::

        class MyBackend(hal.host.HostGraphs):
            def __init__(self, device: int = 0) -> None:
                self.init_host_graphs("mine", alloc=self.device_malloc, free=self.device_free,
                                      segment_size=2 << 20)

    Torch tensors live at the device's addresses through ``torch.frombuffer``,
    so the memory must be readable and writable by the host (the device is
    the CPU as torch sees it: ``torch_device()`` is ``cpu``). Override
    :meth:`capabilities` to declare more or less, marked ``@hal.hookimpl`` again
    (``super().capabilities() | {"memory_sharing"}`` with that capability's hooks).
    A hook called before :meth:`init_host_graphs` ran raises
    :class:`hal.PluginValidationError` saying to call it.
    """

    _host_name: str
    _host_alloc: AllocFn
    _host_free: FreeFn
    _host_segment: int
    _host_routers: list[CaptureRouter]
    _host_inflight: InFlight | None

    def init_host_graphs(self, name: str, *, alloc: AllocFn, free: FreeFn, segment_size: int,
                         asynchronous: bool = False) -> None:
        """Wire the hooks to the device's memory.

        :param name: the backend's name, for errors.
        :param alloc: ``alloc(nbytes) -> address``: the device's own allocator,
            for pools created without callbacks and the private pool of a
            capture given none; returns 0 (or raises
            :class:`hal.DeviceOutOfMemoryError`) when memory runs out. What it
            hands out must count as used in the ``mem_info`` hook (graphkit
            measures graph memory by it).
        :param free: ``free(address, nbytes)``, once per address ``alloc`` gave.
        :param segment_size: pools take memory from ``alloc`` (and from a custom
            pool's callbacks) in multiples of it: the device's granularity.
        :param asynchronous: behave as a device that runs behind the host: keep
            what queued work may still use until the next ``synchronize``
            (:class:`hal.host.inflight.InFlight`, in :attr:`in_flight`), for the
            plugin's ``unmap`` to refuse a range in use with
            ``self.in_flight.check_unmap(ptr, size)``.

        ``alloc`` and ``free`` run on whichever thread allocates or drops a
        tensor (the capturing thread, any thread inside ``use_pool``, the
        garbage collector, after the pool was released), and on several
        threads at once: make them thread-safe, and keep them short (a pool
        holds its lock around ``alloc``).
        """
        if not isinstance(segment_size, int) or segment_size <= 0:
            raise InvalidArgumentError(f"segment_size={segment_size!r} must be a positive int", backend=name,
                                       call="init_host_graphs")
        self._host_name = name
        self._host_alloc = alloc
        self._host_free = free
        self._host_segment = segment_size
        self._host_routers = []
        self._host_inflight = InFlight(name) if asynchronous else None

    if not TYPE_CHECKING:  # at run time only: type checkers keep seeing the declared attributes

        def __getattr__(self, name: str) -> Any:
            """Reached only when an attribute is missing: the mixin's before :meth:`init_host_graphs` ran."""
            if name.startswith("_host_"):
                raise PluginValidationError(
                    f"{type(self).__name__} inherits hal.host.HostGraphs, but its constructor did not call "
                    "self.init_host_graphs(name, alloc=..., free=..., segment_size=...): call it in __init__ with "
                    "the device's own allocator", backend=type(self).__name__, call="init_host_graphs")
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def in_flight(self) -> InFlight | None:
        """What queued work may still use (``asynchronous=True``); ``None`` when work is done when issued."""
        inflight: InFlight | None = vars(self).get("_host_inflight")  # read by pluggy at register, maybe before init
        return inflight

    def _pool(self, alloc: AllocFn, free: FreeFn, what: str) -> BlockPool:
        pool = BlockPool(alloc, free, self._host_segment, f"{self._host_name} {what}", backend=self._host_name)
        inflight = self._host_inflight
        if inflight is not None:
            name = pool.name
            pool.on_malloc = lambda ptr, nbytes: inflight.handed_out(ptr, nbytes, f"a block of the {name}")
        return pool

    # -- capabilities and streams ---------------------------------------------------------

    @hookimpl
    def capabilities(self) -> frozenset[str]:
        return CAPABILITIES

    @hookimpl
    def torch_device(self) -> Any:
        import torch

        return torch.device("cpu")

    @hookimpl
    def create_stream(self) -> HostStream:
        return HostStream()

    @hookimpl
    def current_stream(self) -> HostStream:
        return DEFAULT_STREAM

    @hookimpl
    def default_capture_stream(self) -> HostStream:
        return DEFAULT_STREAM

    @hookimpl
    def use_stream(self, stream: HostStream) -> AbstractContextManager[HostStream]:
        return contextlib.nullcontext(stream)

    @hookimpl
    def synchronize(self, stream: HostStream | None) -> None:
        """Host work is done when it is issued; an asynchronous device's queued work is done now (every stream
        is one queue here, so waiting for one waits for all). An asynchronous device refuses a wait inside a
        capture on this thread, as a GPU does (a wait there ends the capture): a caller asks ``capturing()``
        first."""
        inflight = self._host_inflight
        if inflight is None:
            return
        if inflight.capturing_here():
            raise CaptureError("synchronize() inside a capture on this thread: a device-wide wait would end the "
                               "capture (a capture runs nothing to wait for); ask Backend.capturing() first",
                               backend=self._host_name, call="synchronize")
        inflight.waited()

    # -- pools ------------------------------------------------------------------------------

    @hookimpl
    def create_pool(self, alloc: AllocFn | None, free: FreeFn | None) -> BlockPool:
        if alloc is None or free is None:
            return self._pool(self._host_alloc, self._host_free, "device pool")
        return self._pool(alloc, free, "custom pool")

    @hookimpl
    def use_pool(self, pool: BlockPool) -> AbstractContextManager[None]:
        from hal.host.tape import Placer

        return Placer(pool)

    @hookimpl
    def tensor_at(self, ptr: int, nbytes: int, owner: object) -> Any:
        import torch

        from hal.host import tape

        tensor, buf = tape.tensor_at(ptr, nbytes, torch.uint8, (nbytes,))
        if buf is not None:
            buf.owner = owner  # the tensor's storage holds the buffer, the buffer holds the owner
        if self._host_inflight is not None:
            self._host_inflight.handed_out(ptr, nbytes, "a tensor from tensor_at")
        return tensor

    @hookimpl
    def pool_active_blocks(self, pool: BlockPool) -> list[tuple[int, int]]:
        return pool.active_blocks()

    @hookimpl
    def release_pool(self, pool: BlockPool) -> None:
        pool.release()

    # -- graphs ------------------------------------------------------------------------------

    @hookimpl
    def create_graph(self, lazy: bool) -> tape.HostGraph:
        from hal.host.tape import HostGraph

        return HostGraph(backend=self._host_name, lazy=lazy)

    @hookimpl
    def capture(self, graph: tape.HostGraph, pool: BlockPool | None, stream: HostStream,
                capture_error_mode: str | None, inspect: bool) -> AbstractContextManager[tape.HostGraph]:
        # every mode is "thread_local" here: the recording sees only this thread's work;
        # the tape knows its addresses whether or not ``inspect`` asks for them
        return self._capture(graph, pool)

    @contextlib.contextmanager
    def _capture(self, graph: tape.HostGraph, pool: BlockPool | None) -> Iterator[tape.HostGraph]:
        from hal.host import tape

        tape.refuse_capture(graph)  # before a router or a private pool is asked for anything
        with capture_turn(self._host_name, getattr(self, "device", 0)):
            yield from self._captured(graph, pool)

    def _captured(self, graph: tape.HostGraph, pool: BlockPool | None) -> Iterator[tape.HostGraph]:
        """The capture of :meth:`_capture` (its turn taken): routed, recorded, ended or failed."""
        from hal.host import tape

        # this device's routers, innermost first, then the process's
        route = route_of(list(reversed(self._host_routers)), self._host_name, getattr(self, "device", 0), graph, pool)
        with Transaction() as tx:
            if route is not None:
                tx.append(functools.partial(route.on_end, False), retry=False)
                pool = route.pool
                if route.on_replay is not None:
                    graph.lazy = True  # its router owns its executable form: made at its first launch, if ever
            if pool is None:
                pool = graph.own_pool = self._pool(self._host_alloc, self._host_free, "private pool")
                tx.append(functools.partial(_drop_private_pool, graph, pool))
            with tape.capture(graph, pool), self._host_capturing():
                yield graph
            tx.commit()
        if route is not None:
            with Transaction() as refusal:
                refusal.append(graph.discard)  # refused by the router: empty, as after a failed capture
                route.on_end(True)  # the tape knows its addresses: nothing to record first
                refusal.commit()
            graph.on_release = watch_release(graph, route.on_release, reset_name=None)
            graph.on_replay = route.on_replay

    def _host_capturing(self) -> AbstractContextManager[None]:
        return self._host_inflight.capturing() if self._host_inflight is not None else contextlib.nullcontext()

    @hookimpl
    def update_graph(self, graph: tape.HostGraph, source: tape.HostGraph) -> None:
        from hal.host import tape

        tape.update(graph, source)
        if self._host_inflight is not None:
            self._host_inflight.updated(graph)

    @hookimpl
    def replay(self, graph: tape.HostGraph) -> None:
        graph.replay()
        if self._host_inflight is not None:
            self._host_inflight.replayed(graph)

    @hookimpl
    def release_graph(self, graph: tape.HostGraph) -> None:
        graph.release()

    @hookimpl
    def graph_addresses(self, graph: tape.HostGraph) -> GraphAddresses:
        return graph.addresses()

    @hookimpl
    def route_captures(self, router: CaptureRouter) -> AbstractContextManager[None]:
        return self._routing(router)

    @contextlib.contextmanager
    def _routing(self, router: Callable[[Any, Any], Any]) -> Iterator[None]:
        self._host_routers.append(router)
        try:
            yield
        finally:
            self._host_routers.remove(router)


def _drop_private_pool(graph: tape.HostGraph, pool: BlockPool) -> None:
    """Give back ``pool``, the private pool of a capture of ``graph`` that failed (a retry gets a fresh one)."""
    pool.release()
    graph.own_pool = None
