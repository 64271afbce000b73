"""A stand-in for torch_npu / torch_mlu, to test the backends' torch glue on a CPU.

It has the attributes the glue uses (per VENDOR_APIS.md), records every call
in ``stub.calls``, and can fail a capture the way a device would. Inject it
with ``monkeypatch.setitem(sys.modules, stub.__name__, stub)``.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.machinery
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
