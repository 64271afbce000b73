"""An engine-like process (NCCL process group, MemorySaver regions, graphs through graph_memory) that fails.

Run as ``python exit_with_error.py``: it must end with the exception's exit code (1), as any Python
program does, not with a signal from the teardown of device memory.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

import graphkit
import hal


def main() -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    be = hal.get_backend("cuda", requires=("graphs", "custom_pool", "use_pool"))
    saver = graphkit.MemorySaver(be)
    with saver.region("weights", backup=True):
        weights = torch.randn(1024, 1024, device="cuda")
    with saver.region("kv_cache"):
        kv = torch.zeros(1 << 20, device="cuda")
    pools = graphkit.GraphPools(be, saver=saver)
    x = torch.zeros(8, 1024, device="cuda")

    def step(n: int) -> torch.Tensor:
        out = x[:n] @ weights
        dist.all_reduce(out)
        return out

    step(8)  # the engine's warm-up on its stream: NCCL's communicator is made outside any capture
    graphs = []
    with graphkit.graph_memory(pools=pools):
        for n in (8, 4, 2, 1):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                out = step(n)
                kv[: out.numel()].copy_(out.flatten())
            graphs.append((g, out))
    for g, _ in graphs:
        g.replay()
    torch.cuda.synchronize()
    raise RuntimeError("the engine failed after capturing (this exception must end the process with exit code 1)")


if __name__ == "__main__":
    main()
