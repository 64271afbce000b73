"""Stand-ins for torch_npu / torch_mlu (and torch.cuda), to test the backends' torch glue on a CPU.

Each has the attributes the glue uses (per VENDOR_APIS.md), records every
call in ``stub.calls``, and can fail a capture the way a device would. Inject
an :func:`extension_stub` with ``monkeypatch.setitem(sys.modules,
stub.__name__, stub)``; hand a :func:`cuda_stub` to ``CudaGlue(device, ext=stub)``.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.machinery
import itertools
import types
from typing import Any


class _Graph:
    def __init__(self, calls: list) -> None:
        self.calls = calls

    def replay(self) -> None:
        self.calls.append(("replay", self))

    def reset(self) -> None:
        self.calls.append(("reset", self))


class _CapturingGraph(_Graph):
    """A graph class with the capture API of torch.cuda.CUDAGraph (capture_begin/capture_end/pool)."""

    def capture_begin(self, pool: Any = None, capture_error_mode: str = "global") -> None:
        self.pool_id = pool
        self.calls.append(("capture_begin", self, pool))

    def capture_end(self) -> None:
        self.calls.append(("capture_end", self))

    def pool(self) -> Any:
        return self.pool_id


class _CapturingContext:
    """``torch.<device>.graph`` as torch writes it: capture_begin on entry, capture_end on exit."""

    default_capture_stream = None

    def __init__(self, stub: types.ModuleType, graph: Any, pool: Any = None, stream: Any = None,
                 capture_error_mode: str = "global") -> None:
        self.stub, self.graph, self.pool, self.mode = stub, graph, pool, capture_error_mode

    def __enter__(self) -> Any:
        if self.stub.fail_capture is not None:
            raise self.stub.fail_capture
        self.graph.capture_begin(*(() if self.pool is None else (self.pool,)), capture_error_mode=self.mode)
        return self.graph

    def __exit__(self, *exc: object) -> None:
        self.graph.capture_end()


class _GraphContext:
    def __init__(self, stub: types.ModuleType, graph: Any, kwargs: dict) -> None:
        self.stub, self.graph, self.kwargs = stub, graph, kwargs

    def __enter__(self) -> Any:
        self.stub.calls.append(("graph", self.graph, self.kwargs, gc.isenabled()))
        if self.stub.fail_capture is not None:
            raise self.stub.fail_capture
        return self.graph

    def __exit__(self, *exc: object) -> None:
        self.stub.calls.append(("capture_end", self.graph))


def extension_stub(name: str, *, mempool: bool = True, snapshot: bool = True,
                   capture_api: bool = False) -> types.ModuleType:
    """A module object named ``name`` ("torch_npu" or "torch_mlu") with a device namespace.

    :param mempool: whether the build has ``MemPool`` (the custom-allocator entry point is always there).
    :param snapshot: whether ``memory_snapshot`` (and ``MemPool.snapshot``) exist.
    :param capture_api: the graph class has ``capture_begin``/``capture_end`` and ``graph(...)`` calls
        them, as torch's does (a class of its own per stub, so routing one stub leaves others alone).
    """
    npu = name == "torch_npu"
    stub = types.ModuleType(name)
    stub.__spec__ = importlib.machinery.ModuleSpec(name, None)
    stub.calls = []
    stub.fail_capture = None
    stub.segments = []  # what memory_snapshot() returns
    ns = types.SimpleNamespace()
    calls, has_snapshot = stub.calls, snapshot

    class MemPool:
        def __init__(self, allocator: Any = None) -> None:
            self.allocator = allocator
            self.id = ("mempool", id(self))
            calls.append(("MemPool", allocator))

        if has_snapshot:
            def snapshot(self) -> list[dict]:
                return [s for s in stub.segments if s.get("segment_pool_id") == self.id]

    ns.set_device = lambda device: calls.append(("set_device", device))
    ns.Stream = lambda device=None: ("stream", device)
    ns.current_stream = lambda device=None: ("current", device)
    ns.stream = contextlib.nullcontext
    ns.synchronize = lambda device=None: calls.append(("synchronize", device))
    ns.graph_pool_handle = lambda: ("handle", len(calls))
    ns.current_device = lambda: 0
    if capture_api:
        graph_cls = type("NPUGraph" if npu else "MLUGraph", (_CapturingGraph,), {})
        ns.graph = type("graph", (_CapturingContext,), {"__init__": lambda self, g, **kw: _CapturingContext.__init__(
            self, stub, g, **kw)})
        setattr(ns, graph_cls.__name__, lambda: graph_cls(calls))
        setattr(ns, graph_cls.__name__, graph_cls)
        graph_cls.__init__ = lambda self: _Graph.__init__(self, calls)  # type: ignore[method-assign]
    else:
        ns.graph = lambda g, **kwargs: _GraphContext(stub, g, kwargs)
        setattr(ns, "NPUGraph" if npu else "MLUGraph", lambda: _Graph(calls))
    if snapshot:
        ns.memory_snapshot = lambda: list(stub.segments)
    entry = "_npu_customAllocator" if npu else "_mlu_customAllocator"
    internals = types.SimpleNamespace(**{entry: lambda alloc, free: ("allocator", alloc, free)})
    if mempool:
        ns.MemPool = MemPool
    setattr(stub, "_C" if npu else "_MLUC", internals)
    setattr(stub, "npu" if npu else "mlu", ns)
    return stub


class _CudaStream:
    def __init__(self, stub: types.ModuleType, index: int) -> None:
        import torch

        self.stub, self.device = stub, torch.device("cuda", index)

    def wait_stream(self, other: _CudaStream) -> None:
        self.stub.calls.append(("wait_stream", self, other))

    def synchronize(self) -> None:
        self.stub.calls.append(("synchronize", self))


def cuda_stub(*, allocator_backend: str = "native") -> types.ModuleType:
    """A stand-in for torch itself with the ``torch.cuda`` the cuda glue uses, to test that glue on a CPU.

    Pass it as ``CudaGlue(device, ext=stub)``. Like torch, ``cuda.graph`` makes the capture stream
    current on entry and leaves it current when ``capture_begin`` or ``capture_end`` raises (set
    ``stub.fail_begin`` / ``stub.fail_end`` to fail the next capture). ``stub.calls`` records what
    the glue did.
    """
    stub = types.ModuleType("torch")
    stub.__version__ = "2.11.0+cu130"
    stub.calls, stub.segments = [], []
    stub.fail_begin = stub.fail_end = None
    calls, ids = stub.calls, itertools.count(1)
    state: dict[str, Any] = {"device": 0, "current": {}}
    cuda = types.SimpleNamespace()

    def current_stream(device: Any = None) -> _CudaStream:
        index = state["device"] if device is None else getattr(device, "index", device)
        return state["current"].setdefault(index, _CudaStream(stub, index))

    def set_stream(stream: _CudaStream) -> None:
        state["current"][stream.device.index] = stream

    @contextlib.contextmanager
    def device(index: int) -> Any:
        previous, state["device"] = state["device"], index
        try:
            yield
        finally:
            state["device"] = previous

    @contextlib.contextmanager
    def stream(s: _CudaStream) -> Any:
        previous = current_stream(s.device)
        set_stream(s)
        try:
            yield
        finally:
            set_stream(previous)

    class CUDAGraph(_CapturingGraph):
        def __init__(self) -> None:
            _Graph.__init__(self, calls)

        def capture_begin(self, pool: Any = None, capture_error_mode: str = "global") -> None:
            failure, stub.fail_begin = stub.fail_begin, None  # the next capture fails, later ones work
            if failure is not None:
                raise failure
            _CapturingGraph.capture_begin(self, pool, capture_error_mode)
            calls.append(("mode", capture_error_mode))

        def capture_end(self) -> None:
            failure, stub.fail_end = stub.fail_end, None
            if failure is not None:
                raise failure
            _CapturingGraph.capture_end(self)

    class graph:
        default_capture_stream = None

        def __init__(self, g: Any, pool: Any = None, stream: Any = None, capture_error_mode: str = "global") -> None:
            self.g, self.pool, self.mode = g, pool, capture_error_mode
            self.stream = stream if stream is not None else _CudaStream(stub, state["device"])

        def __enter__(self) -> Any:
            self.previous = current_stream(self.stream.device)
            set_stream(self.stream)  # left current when capture_begin raises, as torch leaves it
            self.g.capture_begin(*(() if self.pool is None else (self.pool,)), capture_error_mode=self.mode)
            return self.g

        def __exit__(self, *exc: object) -> None:
            self.g.capture_end()  # when it raises, the capture stream stays current, as in torch
            set_stream(self.previous)

    class MemPool:
        def __init__(self, allocator: Any = None) -> None:
            self.allocator, self.id = allocator, (1, next(ids))

    cuda.device, cuda.stream, cuda.current_stream, cuda.set_stream = device, stream, current_stream, set_stream
    cuda.Stream = lambda device=None: _CudaStream(stub, state["device"] if device is None else device.index)
    cuda.current_device = lambda: state["device"]
    cuda.synchronize = lambda device=None: calls.append(("synchronize", device))
    cuda.graph_pool_handle = lambda: (0, next(ids))
    cuda.get_allocator_backend = lambda: allocator_backend
    cuda.empty_cache = lambda: calls.append(("empty_cache",))
    cuda.memory_snapshot = lambda mempool_id=None, include_traces=True: [
        s for s in stub.segments if mempool_id is None or s["segment_pool_id"] == mempool_id]
    cuda.CUDAGraph, cuda.graph, cuda.MemPool = CUDAGraph, graph, MemPool
    cuda.use_mem_pool = lambda pool, device=None: contextlib.nullcontext(calls.append(("use_mem_pool", pool, device)))
    stub._C = types.SimpleNamespace(
        _cuda_customAllocator=lambda alloc, free: ("allocator", alloc, free),
        _cuda_endAllocateToPool=lambda device, pool_id: calls.append(("endAllocateToPool", device, pool_id)),
        _cuda_releasePool=lambda device, pool_id: calls.append(("releasePool", device, pool_id)))
    stub.cuda = cuda
    return stub
