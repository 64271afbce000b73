"""Stand-ins for torch_npu / torch_mlu (and torch.cuda), to test the backends' torch glue on a CPU.

Each has the attributes the glue uses, records every call in ``stub.calls``,
and can fail a capture the way a device would (``stub.fail_capture`` on entering
``graph(...)``, ``stub.fail_end`` once, on leaving it). Inject an
:func:`extension_stub` with ``monkeypatch.setitem(sys.modules, stub.__name__,
stub)``; hand a :func:`cuda_stub` to ``CudaGlue(device, ext=stub)``.

The extension stand-ins come in the generations of the real releases
(:data:`GENERATIONS`), and ``stub.allocate(nbytes)`` takes memory the way that
generation's caching allocator does: from a pool's custom allocator (calling
the C callbacks handed to ``_npu_customAllocator`` / ``_mlu_customAllocator``)
or from the extension's own memory, recorded as ``("own_alloc", nbytes, why)``.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.machinery
import itertools
import os
import types
from typing import Any

#: name -> the keyword arguments of :func:`extension_stub` that make one generation of a real release
GENERATIONS: dict[str, dict[str, Any]] = {
    # torch_npu 2.5.1-7.0.0: MemPool, but a pool's allocator is used only inside use_mem_pool; no pool ids in
    # the memory snapshot
    "torch_npu 2.5.1": {"name": "torch_npu", "version": "2.5.1.post1", "pool_ids_in_snapshot": False},
    # torch_npu 2.12: as 2.5.1, with pool ids in the snapshot
    "torch_npu 2.12.0": {"name": "torch_npu", "version": "2.12.0"},
    # torch_npu 2.13 and later: a pool's own allocator takes its segments, captures included
    "torch_npu 2.13.0": {"name": "torch_npu", "version": "2.13.0"},
    "torch_npu 2.14.0": {"name": "torch_npu", "version": "2.14.0"},
    # the public torch_mlu branches: no MemPool
    "torch_mlu 1.24": {"name": "torch_mlu", "version": "1.24.1+torch2.1.0", "mempool": False},
    # torch-mlu 1.27 and later (torch 2.7): torch.mlu.memory.MemPool and use_mem_pool
    "torch_mlu 1.27": {"name": "torch_mlu", "version": "1.27.0+torch2.7.0", "mempool": True},
}

#: the allocator config variables each extension reads
_ALLOC_CONF = {"torch_npu": ("PYTORCH_NPU_ALLOC_CONF", "PYTORCH_ALLOC_CONF"), "torch_mlu": ("PYTORCH_MLU_ALLOC_CONF",)}


def generation(label: str, **overrides: Any) -> types.ModuleType:
    """The stand-in of generation ``label`` (a key of :data:`GENERATIONS`)."""
    kwargs = {**GENERATIONS[label], **overrides}
    return extension_stub(kwargs.pop("name"), **kwargs)


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
        self.stub.capturing = self.graph.pool_id  # the pool capture_begin got (a router may have chosen it)
        return self.graph

    def __exit__(self, *exc: object) -> None:
        self.stub.capturing = None
        self.graph.capture_end()


class _GraphContext:
    def __init__(self, stub: types.ModuleType, graph: Any, kwargs: dict) -> None:
        self.stub, self.graph, self.kwargs = stub, graph, kwargs

    def __enter__(self) -> Any:
        self.stub.calls.append(("graph", self.graph, self.kwargs, gc.isenabled()))
        if self.stub.fail_capture is not None:
            raise self.stub.fail_capture
        self.stub.capturing = self.kwargs.get("pool")
        return self.graph

    def __exit__(self, *exc: object) -> None:
        self.stub.capturing = None
        failure, self.stub.fail_end = self.stub.fail_end, None  # the next capture fails at its end
        if failure is not None:
            raise failure
        self.stub.calls.append(("capture_end", self.graph))


def _expandable_segments(name: str) -> bool:
    for var in _ALLOC_CONF[name]:
        if var in os.environ:
            return "expandable_segments:True" in os.environ[var].split(",")
    return False


def _allocate(stub: types.ModuleType, nbytes: int) -> int:
    """Memory for ``nbytes`` as the caching allocator of this generation takes it (see the module docstring)."""
    from hal.backends._native.callbacks import ALLOC_FN

    def own(why: str) -> int:
        stub.calls.append(("own_alloc", nbytes, why))
        stub.own_bytes += nbytes
        return 0x5EED0000 + stub.own_bytes

    if _expandable_segments(stub.__name__):
        return own("expandable segments")
    if stub.routes_pools:  # a pool's own allocator: the capture's pool, else the use_mem_pool one
        pool_id = stub.capturing if stub.capturing is not None else stub.active_pool
    else:  # only while use_mem_pool is active
        pool_id = stub.active_pool
    mempool = stub.mempools.get(pool_id) if pool_id is not None else None
    if mempool is None or mempool.allocator is None:
        return own("no pool with a custom allocator")
    _, alloc_ptr, _ = mempool.allocator
    ptr = ALLOC_FN(alloc_ptr)(nbytes, 0, None) or 0
    stub.calls.append(("pool_alloc", pool_id, ptr, nbytes))
    return ptr


def extension_stub(name: str, *, version: str | None = None, mempool: bool = True, snapshot: bool = True,
                   capture_api: bool = False, pool_ids_in_snapshot: bool = True) -> types.ModuleType:
    """A module object named ``name`` ("torch_npu" or "torch_mlu") with a device namespace.

    :param version: ``__version__``; by default the newest generation's (torch_npu 2.14.0, torch_mlu
        1.27.0 with MemPool, 1.24.1 without). torch_npu before 2.13 hands segments to a pool's
        allocator only inside ``use_mem_pool``, has ``_npu_endAllocateCurrentStreamToPool`` and a
        ``memory_snapshot()`` without arguments; later ones route a graph pool's segments to its
        allocator, have ``_npu_endAllocateToPool`` and ``memory_snapshot(mempool_id=None)``.
    :param mempool: whether the build has ``MemPool`` and ``use_mem_pool`` (the custom-allocator entry
        point is always there); torch_mlu has them under ``torch.mlu.memory``.
    :param snapshot: whether ``memory_snapshot`` (and ``MemPool.snapshot``) exist.
    :param capture_api: the graph class has ``capture_begin``/``capture_end`` and ``graph(...)`` calls
        them, as torch's does (a class of its own per stub, so routing one stub leaves others alone).
    :param pool_ids_in_snapshot: False drops ``segment_pool_id`` from the snapshot (torch_npu 2.5.1).
    """
    npu = name == "torch_npu"
    if version is None:
        version = "2.14.0" if npu else ("1.27.0+torch2.7.0" if mempool else "1.24.1+torch2.1.0")
    release = tuple(int(p) for p in version.split("+")[0].split(".")[:2])
    stub = types.ModuleType(name)
    stub.__spec__ = importlib.machinery.ModuleSpec(name, None)
    stub.__version__ = version
    stub.calls = []
    stub.fail_capture = stub.fail_end = None
    stub.segments = []  # what memory_snapshot() returns
    stub.mempools = {}  # pool id -> MemPool
    stub.capturing = stub.active_pool = None
    stub.own_bytes = 0
    stub.routes_pools = release >= (2, 13) if npu else mempool  # a graph pool's segments go to its allocator
    stub.allocate = lambda nbytes: _allocate(stub, nbytes)
    ns = types.SimpleNamespace()
    calls, has_snapshot = stub.calls, snapshot

    def visible(segments: list[dict]) -> list[dict]:
        if pool_ids_in_snapshot:
            return list(segments)
        return [{k: v for k, v in s.items() if k != "segment_pool_id"} for s in segments]

    class MemPool:
        def __init__(self, allocator: Any = None) -> None:
            self.allocator = allocator
            self.id = ("mempool", id(self))
            stub.mempools[self.id] = self
            calls.append(("MemPool", allocator))

        if has_snapshot:
            def snapshot(self) -> list[dict]:
                return visible([s for s in stub.segments if s.get("segment_pool_id") == self.id])

    @contextlib.contextmanager
    def use_mem_pool(pool: MemPool, device: Any = None) -> Any:
        calls.append(("use_mem_pool", pool, device))
        previous, stub.active_pool = stub.active_pool, pool.id
        try:
            yield
        finally:
            stub.active_pool = previous

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
    if snapshot and (not npu or release >= (2, 13)):
        ns.memory_snapshot = lambda mempool_id=None: visible(
            [s for s in stub.segments if mempool_id is None or s.get("segment_pool_id") == mempool_id])
    elif snapshot:
        ns.memory_snapshot = lambda: visible(stub.segments)
    entry = "_npu_customAllocator" if npu else "_mlu_customAllocator"
    internals = types.SimpleNamespace(**{entry: lambda alloc, free: ("allocator", alloc, free)})
    end = "_npu_endAllocateToPool" if not npu or release >= (2, 13) else "_npu_endAllocateCurrentStreamToPool"
    setattr(internals, end if npu else "_mlu_endAllocateToPool",
            lambda device, pool_id: calls.append(("endAllocateToPool", device, pool_id)))
    setattr(internals, "_npu_releasePool" if npu else "_mlu_releasePool",
            lambda device, pool_id: calls.append(("releasePool", device, pool_id)))
    if mempool and npu:
        ns.MemPool, ns.use_mem_pool = MemPool, use_mem_pool
    elif mempool:  # torch.mlu.memory.MemPool
        ns.memory = types.SimpleNamespace(MemPool=MemPool, use_mem_pool=use_mem_pool)
    setattr(stub, "_C" if npu else "_MLUC", internals)
    setattr(stub, "npu" if npu else "mlu", ns)
    return stub


class _CudaStream:
    def __init__(self, stub: types.ModuleType, index: int) -> None:
        import torch

        self.stub, self.device = stub, torch.device("cuda", index)
        self.cuda_stream = 0x5000 + id(self) % 0x1000  # a made-up CUstream

    def wait_stream(self, other: _CudaStream) -> None:
        self.stub.calls.append(("wait_stream", self, other))

    def synchronize(self) -> None:
        self.stub.calls.append(("synchronize", self))


def cuda_stub(*, allocator_backend: str = "native", keep_graph: bool = False) -> types.ModuleType:
    """A stand-in for torch itself with the ``torch.cuda`` the cuda glue uses, to test that glue on a CPU.

    Pass it as ``CudaGlue(device, ext=stub)``. Like torch, ``cuda.graph`` makes the capture stream
    current on entry and leaves it current when ``capture_begin`` or ``capture_end`` raises (set
    ``stub.fail_begin`` / ``stub.fail_end`` to fail the next capture). ``stub.calls`` records what
    the glue did. ``keep_graph=True``: ``CUDAGraph`` takes ``keep_graph`` (torch >= 2.7), and a kept
    graph records its instantiation at its first replay.
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
            self.keep_graph, self.instantiated = False, False

        def instantiate(self) -> None:
            self.instantiated = True
            if self.keep_graph:  # the instantiation of a kept graph is the one a test looks for
                calls.append(("instantiate", self))

        def replay(self) -> None:
            if not self.instantiated:  # a kept graph is instantiated at its first replay, as torch does (in C++,
                CUDAGraph.instantiate(self)  # past an instantiate set on the instance)
            _CapturingGraph.replay(self)

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
            if not self.keep_graph:
                self.instantiate()

    class KeptCUDAGraph(CUDAGraph):
        def __init__(self, keep_graph: bool = False) -> None:
            CUDAGraph.__init__(self)
            self.keep_graph = keep_graph

        def raw_cuda_graph(self) -> int:  # the kept cudaGraph_t: a made-up address
            return 0x1000 + id(self) % 0x1000 * 0x10

        def raw_cuda_graph_exec(self) -> int:
            return 0x9000 + id(self) % 0x1000 * 0x10 if self.instantiated else 0

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
    cuda.CUDAGraph, cuda.graph, cuda.MemPool = KeptCUDAGraph if keep_graph else CUDAGraph, graph, MemPool
    cuda.use_mem_pool = lambda pool, device=None: contextlib.nullcontext(calls.append(("use_mem_pool", pool, device)))
    stub._C = types.SimpleNamespace(
        _cuda_customAllocator=lambda alloc, free: ("allocator", alloc, free),
        _cuda_endAllocateToPool=lambda device, pool_id: calls.append(("endAllocateToPool", device, pool_id)),
        _cuda_releasePool=lambda device, pool_id: calls.append(("releasePool", device, pool_id)))
    stub.cuda = cuda
    return stub
