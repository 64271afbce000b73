"""Reading the addresses a CUDA graph uses, before torch ends its capture.

On a CPU: the word scanner, the readers of ``kernelParams`` and ``extra``,
the walk over a stand-in driver, the inspection and refusal of routed
captures (a stand-in graph class and torch.cuda). On a GPU: the pointers of
an elementwise kernel and of cuBLAS GEMMs, routed captures, a refused graph,
and the cost and node coverage of the walk on a bf16 decoder step (logged;
saved as JSON under ``$HAL_INTROSPECT_OUT`` when that is set).
"""

from __future__ import annotations

import ctypes
import enum
import gc
import json
import logging
import os
import struct
import time
import types
from typing import Any, ClassVar

import pytest
import torch

import hal
from hal.backends.cuda import introspect
from hal.backends.cuda.introspect import GraphWalker, candidates, read_extra, read_params
from hal.backends.cuda.torch_glue import CudaGlue
from hal.routing import ADDRESSES, REFUSED, GraphClassRouting
from hal.types import GraphAddresses, Route
from tests.sim.torch_stub import cuda_stub

log = logging.getLogger("tests.introspect")

PTR_A, PTR_B, PTR_C = 0x7F3A_1200_0000, 0x7F3A_1200_0400, 0x7F3A_5600_0010


def addr(obj: Any) -> int:
    return ctypes.addressof(obj)


# -- the scanner and the argument readers -----------------------------------------------------------


def test_candidates_are_the_aligned_words_that_look_like_device_addresses() -> None:
    buf = (struct.pack("<QQQQ", PTR_A, 7, 0, 1 << 60)  # a pointer, a small int, zero, above any address
           + struct.pack("<ii", 4096, 4096)  # two ints packed in one word: a (false) candidate
           + b"\0" * 4 + struct.pack("<Q", PTR_B) + b"\0" * 4  # a pointer straddling two words: not one
           + struct.pack("<Q", PTR_C) + b"\x01\x02\x03")  # a trailing partial word is ignored
    assert candidates(buf) == [(4096 << 32) | 4096, PTR_A, PTR_C]  # distinct and sorted
    assert candidates(struct.pack("<QQQ", PTR_A, 0, PTR_A)) == [PTR_A]
    assert candidates(b"") == [] and candidates(b"\xff" * 7) == []


def test_the_extra_buffer_of_a_launch_is_read() -> None:
    payload = struct.pack("<QiiQ", PTR_A, 5, 0, PTR_B)
    buf, size = ctypes.create_string_buffer(payload, len(payload)), ctypes.c_size_t(len(payload))
    extra = (ctypes.c_void_p * 5)(1, addr(buf), 2, addr(size), 0)
    assert read_extra(addr(extra)) == payload
    assert candidates(read_extra(addr(extra)) or b"") == [PTR_A, PTR_B]
    reordered = (ctypes.c_void_p * 5)(2, addr(size), 1, addr(buf), 0)
    assert read_extra(addr(reordered)) == payload
    assert read_extra(0) is None
    no_size = (ctypes.c_void_p * 3)(1, addr(buf), 0)
    assert read_extra(addr(no_size)) is None
    unterminated = (ctypes.c_void_p * (2 * introspect.MAX_EXTRA_ENTRIES))(*([7] * 2 * introspect.MAX_EXTRA_ENTRIES))
    assert read_extra(addr(unterminated)) is None
    empty = ctypes.c_size_t(0)
    assert read_extra(addr((ctypes.c_void_p * 5)(1, addr(buf), 2, addr(empty), 0))) is None


def test_kernel_params_are_laid_out_as_the_parameter_space(monkeypatch: pytest.MonkeyPatch) -> None:
    a, n, b = ctypes.c_uint64(PTR_A), ctypes.c_int32(1000), ctypes.c_uint64(PTR_B)
    layout = ((0, 8), (8, 4), (16, 8))
    scattered = (ctypes.c_void_p * 3)(addr(a), addr(n), addr(b))
    space = read_params(addr(scattered), layout)
    assert space == struct.pack("<QiiQ", PTR_A, 1000, 0, PTR_B)
    assert candidates(space) == [PTR_A, PTR_B]
    blob = ctypes.create_string_buffer(struct.pack("<QiiQ", PTR_A, 1000, 0, PTR_B), 24)
    packed = (ctypes.c_void_p * 3)(addr(blob), addr(blob) + 8, addr(blob) + 16)
    reads: list[int] = []
    real = ctypes.string_at
    monkeypatch.setattr(ctypes, "string_at", lambda p, n=-1: reads.append(n) or real(p, n))
    assert read_params(addr(packed), layout) == space and reads == [24]  # packed arguments: one read
    assert read_params(0, ()) == b""


# -- the walk, over a stand-in for cuda.bindings.driver -----------------------------------------------


class NodeType(enum.IntEnum):
    CU_GRAPH_NODE_TYPE_KERNEL = 0
    CU_GRAPH_NODE_TYPE_MEMCPY = 1
    CU_GRAPH_NODE_TYPE_MEMSET = 2
    CU_GRAPH_NODE_TYPE_HOST = 3
    CU_GRAPH_NODE_TYPE_GRAPH = 4
    CU_GRAPH_NODE_TYPE_EMPTY = 5
    CU_GRAPH_NODE_TYPE_EVENT_RECORD = 7
    CU_GRAPH_NODE_TYPE_CONDITIONAL = 13


class MemoryType(enum.IntEnum):
    CU_MEMORYTYPE_HOST = 1
    CU_MEMORYTYPE_DEVICE = 2
    CU_MEMORYTYPE_ARRAY = 3
    CU_MEMORYTYPE_UNIFIED = 4


class CaptureStatus(enum.IntEnum):
    CU_STREAM_CAPTURE_STATUS_NONE = 0
    CU_STREAM_CAPTURE_STATUS_ACTIVE = 1


class Handle:
    def __init__(self, value: int) -> None:
        self.value = value

    def __int__(self) -> int:
        return self.value


class CUgraph(Handle):
    pass


class Params:
    def __init__(self, **fields: Any) -> None:
        self.__dict__.update(fields)


class StandInDriver:
    """The calls of cuda.bindings.driver the walk makes, over nodes described in Python."""

    CUgraphNodeType, CUmemorytype, CUstreamCaptureStatus, CUgraph = NodeType, MemoryType, CaptureStatus, CUgraph
    CUgraphNode = CUfunction = Handle

    def __init__(self) -> None:
        self.graphs: dict[int, list[tuple[NodeType, Any]]] = {}
        self.layouts: dict[int, tuple[tuple[int, int], ...] | int] = {}  # function -> layout, or an error code
        self.layout_calls = 0
        self.capturing: dict[int, int] = {}  # stream -> graph

    def cuStreamGetCaptureInfo(self, stream: int) -> tuple:
        graph = self.capturing.get(stream)
        status = CaptureStatus.CU_STREAM_CAPTURE_STATUS_ACTIVE if graph else CaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE
        return 0, status, 1, CUgraph(graph or 0), [], [], 0

    def cuGraphGetNodes(self, graph: CUgraph, count: int = 0) -> tuple:
        nodes = self.graphs[int(graph)]
        handles = [Handle((int(graph) << 16) + i) for i in range(len(nodes))]
        return 0, handles[:count] if count else [], len(nodes)

    def _node(self, node: Handle) -> tuple[NodeType, Any]:
        return self.graphs[int(node) >> 16][int(node) & 0xFFFF]

    def cuGraphNodeGetType(self, node: Handle) -> tuple:
        return 0, self._node(node)[0]

    def cuGraphKernelNodeGetParams(self, node: Handle) -> tuple:
        return 0, self._node(node)[1]

    def cuFuncGetParamInfo(self, func: Handle, index: int) -> tuple:
        self.layout_calls += 1
        layout = self.layouts[int(func)]
        if isinstance(layout, int):
            return layout, 0, 0
        if index >= len(layout):
            return 1, 0, 0  # CUDA_ERROR_INVALID_VALUE: past the last argument
        return 0, *layout[index]

    def cuGraphMemcpyNodeGetParams(self, node: Handle) -> tuple:
        return 0, self._node(node)[1]

    def cuGraphMemsetNodeGetParams(self, node: Handle) -> tuple:
        return 0, self._node(node)[1]

    def cuGraphChildGraphNodeGetGraph(self, node: Handle) -> tuple:
        return 0, CUgraph(self._node(node)[1])


def copy_params(src: int, dst: int, width: int, src_type: MemoryType = MemoryType.CU_MEMORYTYPE_DEVICE) -> Params:
    fields: dict[str, Any] = {"WidthInBytes": width, "Height": 1, "Depth": 1}
    for side, ptr, kind in (("src", src, src_type), ("dst", dst, MemoryType.CU_MEMORYTYPE_UNIFIED)):
        fields.update({f"{side}MemoryType": kind, f"{side}Device": ptr, f"{side}XInBytes": 0, f"{side}Y": 0,
                       f"{side}Z": 0, f"{side}Pitch": 0, f"{side}Height": 0})
    return Params(**fields)


def test_the_walk_reads_every_kind_of_node_and_counts_what_it_cannot() -> None:
    d = StandInDriver()
    a, n = ctypes.c_uint64(PTR_A), ctypes.c_int32(3)
    kernel_args = (ctypes.c_void_p * 2)(addr(a), addr(n))
    payload = struct.pack("<QQ", PTR_B, 12)
    buf, size = ctypes.create_string_buffer(payload, 16), ctypes.c_size_t(16)
    extra = (ctypes.c_void_p * 5)(1, addr(buf), 2, addr(size), 0)
    d.layouts = {0x100: ((0, 8), (8, 4)), 0x200: 801}  # 801: CUDA_ERROR_NOT_SUPPORTED
    kernel = Params(func=Handle(0x100), kern=None, kernelParams=addr(kernel_args), extra=0)
    d.graphs = {
        1: [(NodeType.CU_GRAPH_NODE_TYPE_KERNEL, kernel),
            (NodeType.CU_GRAPH_NODE_TYPE_KERNEL, kernel),  # the same kernel again: its layout is cached
            (NodeType.CU_GRAPH_NODE_TYPE_KERNEL, Params(func=Handle(0x300), kern=None, kernelParams=0,
                                                        extra=addr(extra))),
            (NodeType.CU_GRAPH_NODE_TYPE_KERNEL, Params(func=Handle(0x200), kern=None,
                                                        kernelParams=addr(kernel_args), extra=0)),
            (NodeType.CU_GRAPH_NODE_TYPE_MEMCPY, copy_params(PTR_C, PTR_C + 4096, 256)),
            (NodeType.CU_GRAPH_NODE_TYPE_MEMCPY, copy_params(0x1234_5678, PTR_C, 64, MemoryType.CU_MEMORYTYPE_HOST)),
            (NodeType.CU_GRAPH_NODE_TYPE_MEMSET, Params(dst=PTR_A + 64, pitch=0, elementSize=4, width=8, height=1)),
            (NodeType.CU_GRAPH_NODE_TYPE_GRAPH, 2),
            (NodeType.CU_GRAPH_NODE_TYPE_EVENT_RECORD, None),
            (NodeType.CU_GRAPH_NODE_TYPE_CONDITIONAL, None)],
        2: [(NodeType.CU_GRAPH_NODE_TYPE_MEMSET, Params(dst=PTR_B + 8, pitch=128, elementSize=1, width=16,
                                                        height=4)),
            (NodeType.CU_GRAPH_NODE_TYPE_EMPTY, None)],
    }
    d.capturing = {0xABC: 1}
    walk = GraphWalker(d).capture_addresses(0xABC)
    assert walk.addresses == {(PTR_A, 1), (PTR_B, 1), (PTR_C, 256), (PTR_C + 4096, 256),
                              (PTR_C, 64),  # the device side of a host-to-device copy (its host side is not ours)
                              (PTR_A + 64, 32), (PTR_B + 8, 3 * 128 + 16)}
    assert (walk.nodes, walk.missed, walk.kernels, walk.kernels_missed) == (12, 2, 4, 1)
    assert walk.by_type["kernel"] == 4 and walk.by_type["conditional"] == 1 and walk.seconds > 0
    assert d.layout_calls == 3 + 1  # 0x100 asked once (two arguments, then past the end), 0x200 once
    result = walk.result()
    assert isinstance(result, GraphAddresses) and result.missed == 2 and list(result.spans) == sorted(result.spans)
    with pytest.raises(hal.InvalidStateError, match="not capturing"):
        GraphWalker(d).capture_addresses(0xDEF)


def test_a_kernel_without_arguments_is_read_and_one_without_a_layout_is_missed() -> None:
    d = StandInDriver()
    d.layouts = {0x100: (), 0x200: 801}
    d.graphs = {1: [(NodeType.CU_GRAPH_NODE_TYPE_KERNEL, Params(func=Handle(0x100), kernelParams=0, extra=0)),
                    (NodeType.CU_GRAPH_NODE_TYPE_KERNEL, Params(func=Handle(0x200), kernelParams=0, extra=0)),
                    (NodeType.CU_GRAPH_NODE_TYPE_KERNEL, Params(func=Handle(0), kernelParams=0, extra=0))]}
    walk = introspect.Walk()
    GraphWalker(d).walk(1, walk)
    assert (walk.kernels, walk.kernels_missed, walk.addresses) == (3, 2, set())


def test_the_calls_straight_into_libcuda_fill_what_the_walk_reads() -> None:
    d = StandInDriver()  # the layouts still come through cuda-python
    d.layouts = {0x100: ((0, 8), (8, 8))}
    a, b = ctypes.c_uint64(PTR_A), ctypes.c_uint64(PTR_B)
    args = (ctypes.c_void_p * 2)(addr(a), addr(b))
    kinds = {0x11: NodeType.CU_GRAPH_NODE_TYPE_KERNEL, 0x12: NodeType.CU_GRAPH_NODE_TYPE_EMPTY}
    vp = ctypes.c_void_p

    @ctypes.CFUNCTYPE(ctypes.c_int, vp, vp, ctypes.POINTER(ctypes.c_size_t))
    def get_nodes(graph: int, out: int | None, count: Any) -> int:
        if out:
            (vp * count[0]).from_address(out)[:] = list(kinds)
        count[0] = len(kinds)
        return 0

    @ctypes.CFUNCTYPE(ctypes.c_int, vp, ctypes.POINTER(ctypes.c_int))
    def get_type(node: int, kind: Any) -> int:
        kind[0] = kinds[node]
        return 0

    @ctypes.CFUNCTYPE(ctypes.c_int, vp, ctypes.POINTER(introspect.KernelNodeParams))
    def get_params(node: int, params: Any) -> int:
        params[0].func, params[0].kernelParams, params[0].extra, params[0].kern = 0x100, addr(args), None, None
        return 0

    lib = types.SimpleNamespace(cuGraphGetNodes=get_nodes, cuGraphNodeGetType=get_type,
                                cuGraphKernelNodeGetParams_v2=get_params)
    walk = introspect.Walk()
    GraphWalker(d, introspect.Libcuda(d, lib)).walk(7, walk)  # type: ignore[arg-type]
    assert walk.words == {PTR_A, PTR_B} and (walk.nodes, walk.kernels, walk.missed) == (2, 1, 0)


# -- routed captures: inspected before their end, refused by their route ------------------------------


class FrameworkGraph:
    """Stands for torch.cuda.CUDAGraph: capture_begin(pool, ...), capture_end(), reset()."""

    events: ClassVar[list] = []

    def __init__(self) -> None:
        self.fail_end = False
        self.resets = 0

    def capture_begin(self, pool=None, capture_error_mode="global"):
        self.events.append(("begin", pool))

    def capture_end(self):
        self.events.append(("end",))
        if self.fail_end:
            raise RuntimeError("capture invalidated")

    def reset(self):
        self.resets += 1


class Pool:
    id = (7, 7)


FOUND = GraphAddresses(((PTR_A, 1), (PTR_B, 64)), nodes=3)


def test_a_routed_capture_is_inspected_before_its_end_when_its_route_asks() -> None:
    events = FrameworkGraph.events
    events.clear()
    seen: list = []

    def inspector(graph: Any) -> GraphAddresses:
        events.append(("inspect",))
        return FOUND

    def router(graph: Any, requested: Any) -> Route:
        inspect = requested == "inspect"
        return Route(Pool(), lambda ok: seen.append((ok, graph.__dict__.get(ADDRESSES))), inspect=inspect)

    routing = GraphClassRouting(FrameworkGraph, lambda: 0, lambda pool: pool.id, inspector)
    with routing.activate(0, router):
        g = FrameworkGraph()
        g.capture_begin("inspect")
        g.capture_end()
        plain = FrameworkGraph()
        plain.capture_begin(None)
        plain.capture_end()
        bad = FrameworkGraph()
        bad.fail_end = True
        bad.capture_begin("inspect")
        with pytest.raises(RuntimeError, match="invalidated"):
            bad.capture_end()
    assert events == [("begin", (7, 7)), ("inspect",), ("end",), ("begin", (7, 7)), ("end",),
                      ("begin", (7, 7)), ("inspect",), ("end",)]
    assert seen == [(True, FOUND), (True, None), (False, None)]
    assert g.__dict__[ADDRESSES] is FOUND and ADDRESSES not in bad.__dict__
    g.reset()  # a reset graph uses nothing any more
    assert ADDRESSES not in g.__dict__


def test_a_failed_read_reaches_the_route_as_its_reason(caplog: pytest.LogCaptureFixture) -> None:
    def inspector(graph: Any) -> GraphAddresses:
        raise hal.DriverError("cuGraphGetNodes failed", backend="cuda", call="graph_addresses")

    seen: list = []
    routing = GraphClassRouting(FrameworkGraph, lambda: 0, lambda pool: pool.id, inspector)
    with caplog.at_level(logging.WARNING, logger="hal.routing"), routing.activate(
            0, lambda g, r: Route(Pool(), lambda ok: seen.append(g.__dict__.get(ADDRESSES)), inspect=True)):
        g = FrameworkGraph()
        g.capture_begin()
        g.capture_end()
    assert seen[0].startswith("DriverError") and "cuGraphGetNodes failed" in seen[0]
    assert "could not be read" in caplog.text


def test_a_route_that_refuses_the_graph_gets_it_reset_and_its_error_through() -> None:
    released: list = []
    refusal = hal.CaptureError("graph B reads the space of key A", backend="graphkit", call="capture")

    def on_end(ok: bool) -> None:
        if ok:
            raise refusal

    routing = GraphClassRouting(FrameworkGraph, lambda: 0, lambda pool: pool.id, lambda g: FOUND)
    with routing.activate(0, lambda g, r: Route(Pool(), on_end, released.append, inspect=True)):
        g = FrameworkGraph()
        g.capture_begin()
        with pytest.raises(hal.CaptureError) as info:
            g.capture_end()
        assert info.value is refusal
        assert g.resets == 1 and g.__dict__.get(REFUSED) is True and ADDRESSES not in g.__dict__
        g.reset()
        del g
        gc.collect()
        assert released == []  # a refused graph was never the route's
        g2 = FrameworkGraph()
        g2.capture_begin()  # a later capture of the same object starts clean
        assert REFUSED not in g2.__dict__
    routing2 = GraphClassRouting(FrameworkGraph, lambda: 0, lambda pool: pool.id, None)
    with routing2.activate(0, lambda g, r: Route(Pool(), lambda ok: None, released.append, inspect=True)):
        g3 = FrameworkGraph()
        g3.capture_begin()
        g3.capture_end()
        assert ADDRESSES not in g3.__dict__  # no inspector: nothing recorded
    g3.reset()
    assert released == [False]


class StreamContext:
    def __init__(self) -> None:
        self.entered = self.left = 0

    def __enter__(self) -> None:
        self.entered += 1

    def __exit__(self, *exc: object) -> None:
        self.left += 1


class GraphBlock:
    """``torch.cuda.graph`` as torch writes it: the capture stream's context, then capture_begin; on exit
    capture_end, then the stream context (skipped when capture_end raises)."""

    def __init__(self, graph: FrameworkGraph) -> None:
        self.cuda_graph, self.stream_ctx = graph, StreamContext()

    def __enter__(self) -> None:
        self.stream_ctx.__enter__()
        self.cuda_graph.capture_begin()

    def __exit__(self, *exc: object) -> None:
        self.cuda_graph.capture_end()
        self.stream_ctx.__exit__(*exc)


def test_a_refused_graph_gives_back_the_stream_its_block_made_current() -> None:
    refuse = [True]

    def on_end(ok: bool) -> None:
        if ok and refuse[0]:
            raise hal.CaptureError("refused", backend="graphkit", call="capture")

    routing = GraphClassRouting(FrameworkGraph, lambda: 0, lambda pool: pool.id, lambda g: FOUND)
    with routing.activate(0, lambda g, r: Route(Pool(), on_end, inspect=True)):
        refused = GraphBlock(FrameworkGraph())
        with pytest.raises(hal.CaptureError):
            with refused:
                pass
        assert refused.stream_ctx.left == 1  # left once, by the refusal
        failed = GraphBlock(FrameworkGraph())
        failed.cuda_graph.fail_end = True
        with pytest.raises(RuntimeError):
            with failed:
                pass
        assert failed.stream_ctx.left == 0  # a capture that did not end: as torch leaves it
        refuse[0] = False
        kept = GraphBlock(FrameworkGraph())
        with kept:
            pass
        assert kept.stream_ctx.left == 1


# -- the cuda glue against a stand-in torch.cuda ------------------------------------------------------


def stub_glue() -> tuple[Any, CudaGlue, list]:
    stub = cuda_stub()
    glue = CudaGlue(0, ext=stub)
    streams: list = []
    glue.use_inspector(lambda stream: streams.append(stream) or FOUND)
    return stub, glue, streams


def test_a_hal_capture_with_inspect_keeps_what_the_graph_uses() -> None:
    _, glue, streams = stub_glue()
    graph = glue.create_graph()
    with glue.capture(graph, None, None, None, inspect=True):
        assert streams == []  # read at the end of the block
    assert streams == [graph.stream]
    assert glue.graph_addresses(graph) is FOUND and glue.graph_addresses(graph.torch_graph) is FOUND
    other = glue.create_graph()
    with glue.capture(other, None, None, None):
        pass
    with pytest.raises(hal.InvalidStateError, match="without inspect=True"):
        glue.graph_addresses(other)
    glue.release_graph(graph)
    with pytest.raises(hal.InvalidStateError, match="not captured"):
        glue.graph_addresses(graph)
    with pytest.raises(hal.UnsupportedError, match="inspect=True"):
        CudaGlue(0, ext=cuda_stub()).capture(glue.create_graph(), None, None, None, inspect=True)


def test_a_failed_read_leaves_the_capture_and_says_why(caplog: pytest.LogCaptureFixture) -> None:
    stub = cuda_stub()
    glue = CudaGlue(0, ext=stub)

    def broken(stream: Any) -> GraphAddresses:
        raise hal.DriverError("cuStreamGetCaptureInfo failed", backend="cuda", call="graph_addresses")

    glue.use_inspector(broken)
    graph = glue.create_graph()
    with caplog.at_level(logging.WARNING, logger="hal.cuda"), glue.capture(graph, None, None, None, inspect=True):
        pass
    assert graph.captured and "could not be read" in caplog.text
    with pytest.raises(hal.InvalidStateError, match=r"reading it failed: DriverError: .*cuStreamGetCaptureInfo failed"):
        glue.graph_addresses(graph)


def test_a_routed_hal_capture_refused_by_its_route_is_undone() -> None:
    stub, glue, streams = stub_glue()
    pool = glue.create_pool(None, None)
    refusal = hal.CaptureError("refused", backend="graphkit", call="capture")
    outcome: list = []

    def on_end(ok: bool) -> None:
        outcome.append(glue.graph_addresses(graph.torch_graph) if ok else ok)
        if refuse:
            raise refusal

    def router(g: Any, requested: Any) -> Route:
        return Route(pool, on_end, lambda collected: outcome.append("released"), inspect=True)

    before = stub.cuda.current_stream()
    with glue.route_captures(router):
        graph, refuse = glue.create_graph(), True
        with pytest.raises(hal.CaptureError) as info:
            with glue.capture(graph, None, None, None):  # no inspect of its own: the route asks for it
                pass
        assert info.value is refusal and outcome == [FOUND]
        assert stub.cuda.current_stream() is before  # the capture stream is not left current
        assert not graph.captured and pool.graphs == 0 and graph.addresses is None
        assert [c for c in stub.calls if c[0] == "reset" and c[1] is graph.torch_graph]
        assert ("endAllocateToPool", 0, pool.id) not in stub.calls  # the capture had ended: nothing to undo there
        refuse = False
        with glue.capture(graph, None, None, None):  # the same graph, captured again, is kept
            pass
    assert graph.captured and pool.graphs == 1 and outcome == [FOUND, FOUND]
    assert glue.graph_addresses(graph) is FOUND and streams == [graph.stream, graph.stream]
    glue.release_graph(graph)
    assert outcome[-1] == "released"


# -- on an NVIDIA GPU ----------------------------------------------------------------------------------


@pytest.fixture
def be():
    backend = hal.get_backend("cuda")
    yield backend
    torch.cuda.synchronize()
    gc.collect()
    backend.close()


def covers(spans: tuple[tuple[int, int], ...], t: torch.Tensor) -> bool:
    """Whether a span touches the storage of ``t``."""
    s = t.untyped_storage()
    start, end = s.data_ptr(), s.data_ptr() + s.nbytes()
    return any(a < end and start < a + n for a, n in spans)


def exact(spans: tuple[tuple[int, int], ...], t: torch.Tensor) -> bool:
    return any(a == t.data_ptr() for a, _ in spans)


def capture_inspected(be: hal.Backend, work: Any) -> tuple[Any, GraphAddresses]:
    stream = be.create_stream()
    with be.use_stream(stream):  # warm-up on the capture stream: cuBLAS makes its handle and workspace here
        work()
    be.synchronize(stream)
    graph = be.create_graph()
    with be.capture(graph, None, stream, inspect=True):
        work()
    found = be.graph_addresses(graph)
    log.info("%d span(s), %d node(s), %d missed, %.2f ms", len(found.spans), found.nodes, found.missed,
             found.seconds * 1e3)
    return graph, found


@pytest.mark.cuda
def test_the_pointers_of_an_elementwise_kernel_are_found(be: hal.Backend) -> None:
    assert "graph_addresses" in be.capabilities
    a, b = torch.randn(1 << 20, device="cuda"), torch.randn(1 << 20, device="cuda")
    out, unrelated = torch.empty_like(a), torch.randn(1 << 20, device="cuda")
    graph, found = capture_inspected(be, lambda: torch.add(a, b, out=out))
    assert all(exact(found.spans, t) for t in (a, b, out)) and not covers(found.spans, unrelated)
    assert found.nodes >= 1 and found.complete and found.seconds > 0
    be.release_graph(graph)
    with pytest.raises(hal.InvalidStateError):
        be.graph_addresses(graph)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_the_operands_of_a_cublas_gemm_are_found(be: hal.Backend, dtype: torch.dtype) -> None:
    a = torch.randn(512, 1024, device="cuda", dtype=dtype)
    b = torch.randn(1024, 768, device="cuda", dtype=dtype)
    c = torch.empty(512, 768, device="cuda", dtype=dtype)
    unrelated = torch.randn(512, 1024, device="cuda", dtype=dtype)
    graph, found = capture_inspected(be, lambda: torch.matmul(a, b, out=c))
    log.info("gemm %s: exact pointers a=%s b=%s c=%s", dtype, exact(found.spans, a), exact(found.spans, b),
             exact(found.spans, c))
    assert covers(found.spans, a) and covers(found.spans, b) and covers(found.spans, c)
    assert not covers(found.spans, unrelated) and found.complete
    be.release_graph(graph)


@pytest.mark.cuda
def test_a_routed_capture_is_readable_in_its_routes_on_end(be: hal.Backend) -> None:
    x, w = torch.randn(64, 256, device="cuda"), torch.randn(256, 256, device="cuda")
    pool = be.create_pool()
    seen: list = []

    def on_end(ok: bool) -> None:
        seen.append(be.graph_addresses(graph) if ok else ok)

    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.tanh(x @ w)
    side.synchronize()
    graph = torch.cuda.CUDAGraph()
    with be.route_captures(lambda g, requested: Route(pool, on_end, inspect=True)):
        with torch.cuda.graph(graph, stream=side):
            out = torch.tanh(x @ w)
    assert len(seen) == 1 and isinstance(seen[0], GraphAddresses)
    assert covers(seen[0].spans, x) and covers(seen[0].spans, w) and covers(seen[0].spans, out)
    graph.replay()
    torch.testing.assert_close(out, torch.tanh(x @ w))
    graph.reset()
    with pytest.raises(hal.InvalidStateError):
        be.graph_addresses(graph)
    del out
    gc.collect()
    be.release_pool(pool)


@pytest.mark.cuda
def test_a_graph_its_route_refuses_is_reset_and_the_allocator_stays_usable(be: hal.Backend) -> None:
    x, w = torch.randn(64, 256, device="cuda"), torch.randn(256, 256, device="cuda")
    pool = be.create_pool()
    released: list = []
    refusal = hal.CaptureError("refused: reads another key's space", backend="graphkit", call="capture")

    def on_end(g: Any, ok: bool) -> None:
        if ok and refuse:
            assert covers(be.graph_addresses(g).spans, w)  # g: the torch graph, of torch.cuda.graph or hal
            raise refusal

    def router(g: Any, requested: Any) -> Route:
        return Route(pool, lambda ok: on_end(g, ok), released.append, inspect=True)

    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.tanh(x @ w)
    side.synchronize()
    default = torch.cuda.current_stream()
    graph, refuse = torch.cuda.CUDAGraph(), True
    with be.route_captures(router):
        with pytest.raises(hal.CaptureError) as info:
            with torch.cuda.graph(graph, stream=side):
                torch.tanh(x @ w)
        assert info.value is refusal
        assert torch.cuda.current_stream() == default  # the capture stream is not left current
        with pytest.raises(RuntimeError):
            graph.replay()  # reset: nothing to replay
        y = torch.tanh(x @ w)  # the allocator and the device still work
        torch.testing.assert_close(y, torch.tanh(x.cpu() @ w.cpu()).cuda(), rtol=1e-3, atol=1e-3)
        refuse = False
        with torch.cuda.graph(graph, stream=side):  # the same graph object, captured again, is kept
            out = torch.tanh(x @ w)
        hal_graph = be.create_graph()
        refuse = True
        with pytest.raises(hal.CaptureError):  # hal's own capture, refused by the route
            with be.capture(hal_graph, None, side):
                torch.tanh(x @ w)
        assert torch.cuda.current_stream() == default
        refuse = False
        with be.capture(hal_graph, None, side):
            out2 = torch.tanh(x @ w)
    graph.replay()
    be.replay(hal_graph)
    torch.cuda.synchronize()
    torch.testing.assert_close(out, y)
    torch.testing.assert_close(out2, y)
    assert released == []
    graph.reset()
    be.release_graph(hal_graph)
    assert released == [False, False]
    del out, out2
    gc.collect()
    be.release_pool(pool)


# -- cost and coverage on a decoder step ---------------------------------------------------------------


def decoder(layers: list[dict[str, torch.Tensor]], kv: list[tuple[torch.Tensor, torch.Tensor]], heads: int):
    """The reference decoder step (layer norms, GEMMs, elementwise) with attention over a static cache."""
    import torch.nn.functional as F

    def step(x: torch.Tensor) -> torch.Tensor:
        batch, hidden = x.shape
        h = x
        for p, (k_cache, v_cache) in zip(layers, kv, strict=True):
            a = F.layer_norm(h, (hidden,), p["ln1"])
            q, k, v = (a @ p["qkv"]).chunk(3, dim=-1)
            att = F.scaled_dot_product_attention(q.reshape(batch, heads, 1, -1), k_cache[:batch], v_cache[:batch])
            h = h + (att.reshape(batch, hidden) * torch.sigmoid(k) + v) @ p["o"]
            a = F.layer_norm(h, (hidden,), p["ln2"])
            gate, up = (a @ p["gate_up"]).chunk(2, dim=-1)
            h = h + (F.silu(gate) * up) @ p["down"]
        return F.layer_norm(h, (hidden,))

    return step


def measure(be: hal.Backend, step: Any, inputs: dict[int, torch.Tensor], used: list[torch.Tensor],
            name: str) -> dict:
    """Capture ``step`` for every input through hal, with and without ``inspect``; the walk's cost and coverage.

    Each capture is also walked a second time through cuda-python's objects alone, for comparison.
    """
    stream = be.create_stream()
    with torch.no_grad(), be.use_stream(stream):
        for x in inputs.values():
            step(x)
    be.synchronize(stream)
    glue = be.plugin.glue
    walks: list[tuple[introspect.Walk, introspect.Walk]] = []
    real = glue.inspector
    plain = GraphWalker()  # every node through cuda-python's objects

    def keeping(s: Any) -> GraphAddresses:
        walk = introspect.walker().capture_addresses(int(s.cuda_stream))
        walks.append((walk, plain.capture_addresses(int(s.cuda_stream))))
        return walk.result()

    unrelated = torch.randn(1 << 20, device="cuda")
    glue.use_inspector(keeping)
    rows = []
    try:
        for n, x in inputs.items():
            timing = {}
            for inspect in (False, True, False, True):  # alternated, the second of each kept
                graph = be.create_graph()
                torch.cuda.synchronize()
                start = time.perf_counter()
                with torch.no_grad(), be.capture(graph, None, stream, inspect=inspect):
                    out = step(x)
                timing[inspect] = time.perf_counter() - start
                if inspect:
                    found, (walk, through_bindings) = be.graph_addresses(graph), walks[-1]
                    be.replay(graph)
                    torch.cuda.synchronize()
                    torch.testing.assert_close(out, step(x), rtol=2e-2, atol=2e-2)
                be.release_graph(graph)
            rows.append({
                "batch": n, "capture_ms": timing[False] * 1e3, "capture_inspected_ms": timing[True] * 1e3,
                "walk_ms": found.seconds * 1e3, "walk_share_of_capture": found.seconds / timing[False],
                "walk_ms_through_cuda_python": through_bindings.seconds * 1e3,
                "nodes": walk.nodes, "nodes_missed": walk.missed, "kernel_nodes": walk.kernels,
                "kernel_nodes_read": walk.kernels - walk.kernels_missed, "by_type": dict(walk.by_type),
                "spans": len(found.spans), "used_found": sum(covers(found.spans, t) for t in used),
                "used": len(used), "input_found": covers(found.spans, x),
                "unrelated_found": covers(found.spans, unrelated)})
            log.info("%s batch %d: %s", name, n, walk.summary())
    finally:
        glue.use_inspector(real)
    report = {"workload": name, "device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows,
              "first_walk_ms": walks[0][0].seconds * 1e3}
    text = json.dumps(report, indent=1)
    log.info("walk cost and coverage:\n%s", text)
    print(text)  # the benchmark's own output (pytest -s)
    out_dir = os.environ.get("HAL_INTROSPECT_OUT")
    if out_dir:
        with open(os.path.join(out_dir, f"introspect_{name}.json"), "w") as fh:
            fh.write(text)
    return report


def check_coverage(report: dict) -> None:
    for row in report["rows"]:
        assert row["kernel_nodes_read"] >= 0.95 * row["kernel_nodes"], row
        assert row["used_found"] == row["used"] and row["input_found"] and not row["unrelated_found"], row


@pytest.mark.cuda
def test_walk_cost_and_coverage_on_a_decoder_step(be: hal.Backend) -> None:
    from tests.cuda_scripts.decoder_capture import make_layers

    n_layers, hidden, mlp, heads, context, sizes = 4, 2048, 5632, 16, 256, [1, 8, 32, 64]
    dev = torch.device("cuda")
    layers = make_layers(n_layers, hidden, mlp, dev, seed=0)
    kv = [(torch.randn(max(sizes), heads, context, hidden // heads, device=dev, dtype=torch.bfloat16),
           torch.randn(max(sizes), heads, context, hidden // heads, device=dev, dtype=torch.bfloat16))
          for _ in layers]
    used = [t for p in layers for t in p.values()] + [t for pair in kv for t in pair]
    inputs = {n: torch.randn(n, hidden, device=dev, dtype=torch.bfloat16) for n in sizes}
    check_coverage(measure(be, decoder(layers, kv, heads), inputs, used, "decoder"))


@pytest.mark.cuda
@pytest.mark.slow  # 16 s on an H100: a whole transformers model
def test_walk_cost_and_coverage_on_a_transformers_model(be: hal.Backend) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                                      num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=4,
                                      attn_implementation="sdpa")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to("cuda", torch.bfloat16).eval()
    inputs = {n: torch.randint(0, 32000, (n, 1), device="cuda") for n in (1, 8, 32)}

    def step(ids: torch.Tensor) -> torch.Tensor:
        return model(input_ids=ids, use_cache=False).logits

    try:
        report = measure(be, step, inputs, list(model.parameters()), "llama")
    except hal.CaptureError as exc:
        pytest.skip(f"this transformers' forward does not capture: {exc}")
    check_coverage(report)
