"""Print what cuda-python hands back when a graph under capture is read, node by node.

Captures an elementwise add, a bf16 and an fp32 GEMM (cuBLAS), a layer norm,
a fill and a copy through ``torch.cuda.graph``; at the end of the capture
block it reads the graph with cuda.bindings directly and prints, for every
node, the Python types of the fields the walk uses, the argument layout, and
where the operands' pointers appear among the argument words (also shifted,
as a tensor-map descriptor could hold them). Diagnostics for
:mod:`hal.backends.cuda.introspect`; prints only.
"""

from __future__ import annotations

import struct
import traceback
from importlib import metadata

import torch
import torch.nn.functional as F

from hal.backends.cuda import introspect


def show(label: str, value: object) -> None:
    print(f"  {label}: {type(value).__module__}.{type(value).__qualname__} = {value!r}"[:300], flush=True)


def main() -> None:
    from cuda.bindings import driver as d

    print("cuda-bindings", metadata.version("cuda-bindings"), "driver", d.cuDriverGetVersion(), flush=True)
    print("unavailable_reason:", introspect.unavailable_reason(), flush=True)
    dev = torch.device("cuda")
    a, b = torch.randn(4096, device=dev), torch.randn(4096, device=dev)
    out = torch.empty_like(a)
    tensors = {}
    for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        tensors[name] = (torch.randn(512, 1024, device=dev, dtype=dtype),
                         torch.randn(1024, 768, device=dev, dtype=dtype),
                         torch.empty(512, 768, device=dev, dtype=dtype))
    ln_w = torch.ones(1024, device=dev)
    filled, copied = torch.empty(1000, device=dev), torch.empty(4096, device=dev)
    side = torch.cuda.Stream()

    def work() -> None:
        torch.add(a, b, out=out)
        for x, y, z in tensors.values():
            torch.matmul(x, y, out=z)
        F.layer_norm(tensors["fp32"][0], (1024,), ln_w)
        filled.zero_()
        copied.copy_(a)

    with torch.cuda.stream(side):
        work()
    side.synchronize()
    pointers = {"a": a, "b": b, "out": out, "filled": filled, "copied": copied,
                **{f"{n}.{k}": t for n, ts in tensors.items() for k, t in zip("ABC", ts, strict=True)}}
    ranges = {k: (t.data_ptr(), t.data_ptr() + t.untyped_storage().nbytes()) for k, t in pointers.items()}

    def where(word: int) -> str:
        for k, (lo, hi) in ranges.items():
            for shift in (0, 4):
                if lo <= (word << shift) < hi:
                    return f"{k}{'+' if (word << shift) != lo else ''}{f' <<{shift}' if shift else ''}"
        return ""

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        work()
        try:
            probe(d, int(torch.cuda.current_stream().cuda_stream), where)
        except Exception:  # noqa: BLE001 - a diagnostic: print and go on
            traceback.print_exc()
    graph.replay()
    torch.cuda.synchronize()
    print("replayed", flush=True)


def probe(d, stream: int, where) -> None:  # type: ignore[no-untyped-def]
    info = d.cuStreamGetCaptureInfo(stream)
    print("cuStreamGetCaptureInfo ->", len(info), "values", flush=True)
    for i, v in enumerate(info):
        show(f"[{i}]", v)
    graph = next(v for v in info if isinstance(v, d.CUgraph))
    err, nodes, count = d.cuGraphGetNodes(graph, 0)
    print("cuGraphGetNodes(0) ->", err, nodes, count, flush=True)
    err, nodes, count = d.cuGraphGetNodes(graph, count)
    for node in nodes:
        err, kind = d.cuGraphNodeGetType(node)
        print(f"node {int(node):#x}: {kind!r}", flush=True)
        if kind == d.CUgraphNodeType.CU_GRAPH_NODE_TYPE_KERNEL:
            err, p = d.cuGraphKernelNodeGetParams(node)
            print("  params", type(p).__qualname__, err, flush=True)
            for field in ("func", "kern", "ctx", "kernelParams", "extra"):
                show(field, getattr(p, field, "<absent>"))
            if hasattr(d, "cuFuncGetName") and int(p.func or 0):
                show("name", d.cuFuncGetName(p.func))
            layout = []
            for i in range(64):
                err, off, size = d.cuFuncGetParamInfo(p.func, i)
                if int(err):
                    print(f"  cuFuncGetParamInfo stops at {i}: {err!r}", flush=True)
                    break
                layout.append((int(off), int(size)))
            print("  layout", layout, flush=True)
            space = b""
            kp, extra = introspect.address(p.kernelParams), introspect.address(p.extra)
            if kp and layout:
                space = introspect.read_params(kp, tuple(layout))
            if extra:
                buf = introspect.read_extra(extra)
                print("  extra buffer", None if buf is None else len(buf), flush=True)
                space += buf or b""
            words = struct.unpack_from(f"<{len(space) // 8}Q", space) if space else ()
            hits = [(i * 8, hex(w), where(w)) for i, w in enumerate(words) if where(w)]
            print(f"  {len(words)} words, candidates {len(introspect.candidates(space))}, operands {hits}", flush=True)
        elif kind == d.CUgraphNodeType.CU_GRAPH_NODE_TYPE_MEMCPY:
            err, p = d.cuGraphMemcpyNodeGetParams(node)
            for field in ("srcMemoryType", "srcDevice", "dstMemoryType", "dstDevice", "WidthInBytes", "Height",
                          "Depth"):
                show(field, getattr(p, field))
        elif kind == d.CUgraphNodeType.CU_GRAPH_NODE_TYPE_MEMSET:
            err, p = d.cuGraphMemsetNodeGetParams(node)
            for field in ("dst", "elementSize", "width", "height", "pitch"):
                show(field, getattr(p, field))
    walk = introspect.GraphWalker(d).capture_addresses(stream)
    print("walk:", walk.summary(), flush=True)


if __name__ == "__main__":
    main()
