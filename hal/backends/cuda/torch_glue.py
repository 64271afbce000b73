"""torch.cuda behind the graph, stream and pool hooks of the cuda backend.

The plumbing is shared with torch_npu and torch_mlu
(:mod:`hal.backends._native.torch_glue`): streams, pools over the allocator
callbacks of :mod:`hal.backends._native.callbacks`, memory snapshots, capture
routing, and the capture itself (:mod:`hal.backends._native.capture`). What
is cuda's own is here: the names, the ``"global"`` capture mode, a device
entered around every call (one process drives several GPUs, and a backend
must not change the current one), the conditions under which a
``torch.cuda.MemPool`` takes segments from Python callbacks, and the graphs
of :mod:`hal.backends.cuda.graph`: checked before a capture, given a pool id
of their own when captured without a pool, replayed on their capture stream
and keeping the addresses read at their capture where the backend gives the
glue an inspector (:meth:`CudaGlue.use_inspector`). torch is imported only
when a glue is created.
"""

from __future__ import annotations

import inspect
import logging
import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, ClassVar

from hal.backends._native import torch_compat as compat
from hal.backends._native.capture import BODY, Phase, first_line
from hal.backends._native.torch_glue import TorchExtension, TorchGlue, TorchPool
from hal.backends.cuda.errors import NAME
from hal.backends.cuda.graph import CudaGraph, addresses, adopt
from hal.errors import CaptureError, InvalidArgumentError, InvalidStateError, UnsupportedError
from hal.routing import ADDRESSES, RECORD, forget
from hal.types import GraphAddresses

log = logging.getLogger("hal.cuda")

EXTENSION = TorchExtension(module="torch", device_type="cuda", graph_class="CUDAGraph", scoped=True, adopt=adopt)


class CudaGlue(TorchGlue):
    """The torch side of one NVIDIA GPU."""

    backend = NAME
    extension = EXTENSION
    default_capture_mode = "global"  # torch.cuda.graph's own default
    no_custom_pool = "this torch has no torch.cuda.MemPool over a custom allocator"

    def __init__(self, device: int, ext: Any = None) -> None:
        """:param ext: a stand-in for the torch module (tests); torch itself by default."""
        super().__init__(device, ext)
        self._capture_stream: Any = None
        self._random_said = False  # graphs drawing random numbers keep their executables: said once

    # -- what this torch offers ---------------------------------------------------------------

    def find_capabilities(self) -> frozenset[str]:
        """The shared ones, plus ``"lazy_graphs"`` where ``torch.cuda.CUDAGraph`` takes ``keep_graph`` (and
        ``"graph_update"`` where it also hands out its executable form) and ``"use_pool"`` wherever
        ``"custom_pool"`` works."""
        problem = self.custom_pool_problem()
        caps = super().find_capabilities()
        if "graphs" in caps and self.keeps_graphs():
            caps = caps | {"lazy_graphs"}
            if hasattr(self.ns.CUDAGraph, "raw_cuda_graph_exec"):  # the executable form an update changes
                caps = caps | {"graph_update"}
        if problem is not None:
            log.warning("cuda: no pools over allocator callbacks: %s", problem)
            return caps
        return caps | {"use_pool"}

    def custom_pool_problem(self) -> str | None:
        """Also: torch before 2.8 does not route a graph pool's segments to a MemPool's allocator, and
        only the native caching allocator (not cudaMallocAsync) takes segments from one."""
        torch = self.torch
        if compat.torch_version(torch) < compat.MIN_TORCH_FOR_CUSTOM_POOL:
            return (f"torch {torch.__version__} is older than 2.8: its graph pools do not route "
                    "segment allocations to a custom allocator")
        missing = super().custom_pool_problem()
        if missing is not None:
            return missing
        backend = self.ns.get_allocator_backend()
        if backend != "native":
            return (f"torch's CUDA allocator backend is {backend!r} (PYTORCH_CUDA_ALLOC_CONF); its pools "
                    "cannot take segments from a custom allocator: use the native backend")
        return None

    # -- pools ---------------------------------------------------------------------------------

    def release_device_pool(self, pool: TorchPool) -> None:
        self.ns.empty_cache()  # a handle-only pool's segments are freed with the device's cache

    def use_pool(self, pool: TorchPool) -> AbstractContextManager[None]:
        """The framework's allocations on this thread inside the block come from ``pool``'s MemPool."""
        if pool.mempool is None:
            raise UnsupportedError(f"{pool!r} is not a torch.cuda.MemPool", backend=NAME, call="use_pool")
        return self.ns.use_mem_pool(pool.mempool, device=self.device)

    def tensor_at(self, ptr: int, nbytes: int, owner: Any) -> Any:
        """A ``torch.uint8`` tensor over ``nbytes`` at ``ptr``; its storage keeps ``owner`` alive."""

        class _Memory:  # what torch.as_tensor reads; the tensor's storage keeps this object (and owner) alive
            __cuda_array_interface__: ClassVar[dict[str, Any]] = {
                "shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3, "strides": None}

        memory = _Memory()
        memory.owner = owner  # type: ignore[attr-defined]
        return self.torch.as_tensor(memory, device=self.torch_device())

    # -- graphs: the shared capture, with cuda's graph record, stream, private pool ids and errors ---------

    def keeps_graphs(self) -> bool:
        """Whether ``torch.cuda.CUDAGraph(keep_graph=True)`` exists: a graph instantiated at its first replay."""
        try:
            return "keep_graph" in inspect.signature(self.ns.CUDAGraph).parameters
        except (TypeError, ValueError):  # a signature torch does not expose
            return False

    def create_graph(self, lazy: bool = False) -> CudaGraph:
        """A graph instantiated at the end of its capture, or with ``lazy`` at its first replay.

        Where torch keeps the captured ``cudaGraph_t`` (``keep_graph=True``) every graph is made so, and one
        that is not lazy is instantiated by :meth:`captured` -- unless its route took its replays
        (:attr:`hal.types.Route.on_replay`), which leaves it lazy.
        """
        if not self.keeps_graphs():
            if lazy:
                raise UnsupportedError(f"lazy=True: torch {self.torch.__version__}'s CUDAGraph has no keep_graph "
                                       "(a newer torch has)", backend=NAME, call="create_graph")
            return CudaGraph(super().create_graph(), self.device)
        with self.on_device():
            graph = CudaGraph(self.ns.CUDAGraph(keep_graph=True), self.device, lazy=lazy)
        graph.torch_graph.__dict__[RECORD] = weakref.ref(graph)  # routing finds the graph object it wraps
        return graph

    def capture(self, graph: CudaGraph, pool: TorchPool | None, stream: Any, capture_error_mode: str | None,
                inspect: bool = False) -> AbstractContextManager[CudaGraph]:
        """The shared capture, on a stream of this backend's own when given none."""
        if stream is None:
            if self._capture_stream is None:
                self._capture_stream = self.create_stream()
            stream = self._capture_stream
        return super().capture(graph, pool, stream, capture_error_mode, inspect)

    def torch_graph_of(self, graph: CudaGraph) -> Any:
        """The ``torch.cuda.CUDAGraph`` of ``graph``."""
        return graph.torch_graph

    def check_capture(self, graph: CudaGraph, stream: Any) -> None:
        """Refuse a graph captured or released before, and a stream of another device."""
        if graph.captured or graph.released:
            raise InvalidStateError(f"{graph!r} cannot be captured again", backend=NAME, call="capture")
        if stream is None or stream.device != self.torch.device("cuda", graph.device):
            raise InvalidArgumentError(f"stream={stream!r} is not a stream of device {graph.device}",
                                       backend=NAME, call="capture")
        graph.addresses = None

    def capture_pool_id(self, pool: TorchPool | None) -> Any:
        """A capture without a pool gets an id of its own, so that its failure can be undone."""
        return pool.id if pool is not None else tuple(self.ns.graph_pool_handle())

    def captured(self, graph: CudaGraph, stream: Any, pool: TorchPool | None) -> None:
        """Record the capture; a graph neither lazy nor served by its route is instantiated now (torch kept
        its captured graph, see :meth:`create_graph`)."""
        tg = graph.torch_graph
        graph.stream, graph.pool, graph.captured = stream, pool, True
        graph.addresses = tg.__dict__.get(ADDRESSES)  # ours, or what a route asked for
        if pool is not None:
            pool.graphs += 1
        if graph.on_replay is not None:
            graph.lazy = True
        if not graph.lazy and not graph.instantiated and RECORD in tg.__dict__:
            with self.ns.device(graph.device):
                type(tg).instantiate(tg)
        graph.instantiated = not graph.lazy

    def capture_error(self, exc: BaseException, phase: Phase) -> CaptureError | None:
        """Inside the block, torch's errors about the capture (not its out-of-memory error)."""
        if phase != BODY or not isinstance(exc, RuntimeError) or isinstance(exc, self.torch.OutOfMemoryError):
            return None
        if "captur" not in str(exc).lower():
            return None
        return CaptureError(f"the work inside the block could not be captured: {first_line(exc)}",
                            backend=NAME, call="capture")

    def graph_addresses(self, graph: Any) -> GraphAddresses:
        """What ``graph`` (a :class:`~hal.backends.cuda.graph.CudaGraph` or a ``torch.cuda.CUDAGraph``)
        uses, as recorded at its capture."""
        return addresses(graph)

    def replay(self, graph: CudaGraph) -> None:
        """Launch ``graph`` on its capture stream, ordered after (and before) the current stream's work; a graph
        the framework made (:class:`~hal.backends.cuda.graph.FrameworkGraph`) on the current stream, as torch's
        own replay does. A lazy graph's first replay instantiates it and tells whether it draws random numbers
        (torch's replay then advances the device's generator)."""
        cuda = self.ns
        tg = graph.torch_graph
        if not graph.captured or graph.released or tg is None:
            raise InvalidStateError(f"{graph!r} cannot be replayed: "
                                    + ("it was released (reset), so its executable is gone" if graph.captured
                                       else "it was never captured"), backend=NAME, call="replay")
        launch = type(tg).replay  # the class's: a served graph's own replay goes to its route
        with cuda.device(graph.device):
            first = None if graph.instantiated or graph.draws_random is not None else self._rng_offset(graph.device)
            current = cuda.current_stream()
            stream = graph.stream
            if stream is None or current == stream:
                launch(tg)
            else:
                stream.wait_stream(current)
                with cuda.stream(stream):
                    launch(tg)
                current.wait_stream(stream)
            if first is not None:
                after = self._rng_offset(graph.device)
                graph.draws_random = None if after is None else after != first
        graph.instantiated = True  # a lazy graph's first replay instantiated it

    def _rng_offset(self, device: int) -> int | None:
        """The offset of ``device``'s default random generator (torch's replay advances it by what the graph
        draws), or None where it cannot be read (inside a capture, a torch without it)."""
        try:
            return int(self.ns.default_generators[device].get_offset())
        except Exception:  # noqa: BLE001 - then whether the graph draws random numbers stays unknown
            return None

    def update_graph(self, graph: CudaGraph, source: CudaGraph,
                     exec_update: Callable[[int, int, int], None]) -> None:
        """Update ``graph``'s executable form with ``source``'s captured graph through
        ``exec_update(graph_exec, source_graph, stream)`` (instantiating ``graph`` first where it was not; the
        stream it launches on: its capture stream, or the current one for a framework's graph)."""
        for name, g in (("graph", graph), ("source", source)):
            if not g.captured or g.released or g.torch_graph is None:
                raise InvalidStateError(f"{name}={g!r} is not captured", backend=NAME, call="update_graph")
        random = next((name for name, g in (("graph", graph), ("source", source)) if g.draws_random), None)
        if random is not None and graph is not source:
            if not self._random_said:
                self._random_said = True
                log.info("cuda: graphs that draw random numbers keep executable graphs of their own: torch's "
                         "replay advances the random generators by what each graph drew, per graph")
            raise InvalidArgumentError(f"{random} draws random numbers: torch's replay of a graph advances the "
                                       "random generators by what that graph drew, so another graph's "
                                       "executable cannot run its work; it keeps one of its own",
                                       backend=NAME, call="update_graph")
        if not source.lazy:
            raise InvalidArgumentError(f"source={source!r} was not created with create_graph(lazy=True): only a "
                                       "lazy graph keeps the captured graph an update reads", backend=NAME,
                                       call="update_graph")
        if source.device != graph.device:
            raise InvalidArgumentError(f"source={source!r} is not on device {graph.device}", backend=NAME,
                                       call="update_graph")
        tg = graph.torch_graph
        with self.ns.device(graph.device):
            if not graph.instantiated:
                type(tg).instantiate(tg)  # the class's: a served graph's own instantiate waits for its route
                graph.instantiated = True
            stream = graph.stream if graph.stream is not None else self.ns.current_stream()
            exec_update(int(tg.raw_cuda_graph_exec()), int(source.torch_graph.raw_cuda_graph()),
                        int(stream.cuda_stream))
        graph.addresses = source.addresses  # what its replays use from now on

    def release_graph(self, graph: CudaGraph) -> None:
        """Wait for the graph's last replay, then destroy it; idempotent."""
        if graph.released:
            return
        graph.released = True
        if graph.pool is not None:  # before the reset: a routed graph's reset may release its pool
            graph.pool.graphs -= 1
            graph.pool = None
        tg = graph.torch_graph
        with self.ns.device(graph.device):
            if graph.captured and graph.stream is not None:
                graph.stream.synchronize()
            elif graph.captured:  # a framework graph replays on the caller's streams
                self.ns.synchronize()
            if tg is not None:
                tg.reset()
        if tg is not None:
            forget(tg, ADDRESSES)
        graph.addresses = None
        graph.torch_graph = None
        graph.stream = None
