"""Walk through a capture that fails (a host sync inside it) and print torch's pool bookkeeping."""

from __future__ import annotations

import torch

import hal
from graphkit import SharedVMMAllocator


def main() -> None:
    be = hal.get_backend("cuda")
    alloc = SharedVMMAllocator(be, reserve_bytes=64 << 20)
    stream = be.create_stream()
    x = torch.randn(64, 64, device="cuda")
    with be.use_stream(stream):
        (x @ x).sum()
    be.synchronize(None)
    space = alloc.switch_to_new_virtual_space()
    pool = be.create_pool(*alloc.pool_callbacks(space))
    print("use_count after create", pool.mempool.use_count(), flush=True)
    graph = be.create_graph()
    try:
        with be.capture(graph, pool, stream):
            y = x @ x
            print("use_count inside capture", pool.mempool.use_count(), flush=True)
            float(y.sum())
    except hal.CaptureError as exc:
        print("CaptureError:", str(exc)[:300], flush=True)
        print("cause:", repr(exc.__cause__)[:300], flush=True)
    except Exception as exc:
        print("other error:", type(exc).__name__, str(exc)[:300], flush=True)
    print("use_count after failure", pool.mempool.use_count(), flush=True)
    print("current stream is default:", torch.cuda.current_stream() == torch.cuda.default_stream(), flush=True)
    be.release_graph(graph)
    print("use_count after release_graph", pool.mempool.use_count(), flush=True)
    be.release_pool(pool)
    print("released pool; callbacks live:", pool.callbacks.live, flush=True)
    alloc.release_virtual_space(space)
    space = alloc.switch_to_new_virtual_space()
    pool = be.create_pool(*alloc.pool_callbacks(space))
    graph = be.create_graph()
    with be.capture(graph, pool, stream):
        y = x @ x
    be.replay(graph)
    print("second capture ok:", bool(torch.allclose(y, x @ x)), "y in space:",
          alloc.spaces[space].contains(y.data_ptr()), flush=True)
    del y
    be.release_graph(graph)
    be.release_pool(pool)
    alloc.release_virtual_space(space)
    alloc.close()
    be.close()
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
