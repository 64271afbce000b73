"""Print what the cuda backend relies on: versions, allocator backend, snapshot layout, a pool round trip."""

from __future__ import annotations

import inspect
from importlib import metadata

import torch

import hal


def main() -> None:
    print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())
    for dist in ("cuda-bindings", "cuda-python"):
        try:
            print(dist, metadata.version(dist))
        except metadata.PackageNotFoundError:
            print(dist, "absent")
    print("allocator backend", torch.cuda.get_allocator_backend())
    print("memory_snapshot", inspect.signature(torch.cuda.memory.memory_snapshot))
    print("MemPool", inspect.signature(torch.cuda.MemPool.__init__))
    print("graph", inspect.signature(torch.cuda.graph.__init__))
    for info in hal.list_backends():
        print("backend", info.name, info.available, info.reason)
    with hal.get_backend("cuda") as be:
        print("granularity", be.granularity, be.recommended_granularity, "mem", be.mem_info(),
              "caps", sorted(be.capabilities))
        va = be.create_vir_ptr(8 * be.granularity)
        handles = []

        def alloc(n: int) -> int:
            h = be.create_phy_mem_handle(-(-n // be.granularity) * be.granularity)
            handles.append((h, n))
            be.map(va, -(-n // be.granularity) * be.granularity, h)
            return va

        pool = be.create_pool(alloc, lambda p, n: None)
        stream, graph = be.create_stream(), be.create_graph()
        x = torch.ones(1000, device=be.torch_device())
        with be.capture(graph, pool, stream):
            y = x * 2
        be.replay(graph)
        print("replay sum", float(y.sum()), "y at", hex(y.data_ptr()), "va", hex(va))
        snap = torch.cuda.memory.memory_snapshot(pool.id)
        for seg in snap:
            print("segment keys", sorted(seg), "pool", seg.get("segment_pool_id"))
            print("block keys", sorted(seg["blocks"][0]) if seg["blocks"] else None)
        print("active blocks", be.pool_active_blocks(pool))
        del y
        be.release_graph(graph)
        be.release_pool(pool)
        print("after release, callbacks live:", pool.callbacks.live)
        for h, n in handles:
            size = -(-n // be.granularity) * be.granularity
            be.unmap(va, size)
            be.release_phy_mem_handle(h)
        be.release_vir_ptr(va, 8 * be.granularity)


if __name__ == "__main__":
    main()
