"""One tensor-parallel rank whose graphs carry NCCL collectives over graphkit memory (run by test_collectives_cuda).

``python nccl_aliasing.py RANK [--probe]``, two ranks, torch.distributed's
environment (MASTER_ADDR, MASTER_PORT) and NCCL's (NCCL_GRAPH_REGISTER,
NCCL_CUMEM_ENABLE...) set by the caller; ``HAL_TEST_SHAREABLE=1`` makes the
chunks exportable (``hal.get_backend("cuda", shareable=True)``). Every graph does
an in-place all-reduce and an out-of-place all-gather, whose receive buffer
(graph memory) is the kind of buffer NCCL registers with its peers when it
captures a collective.

1. captures every size in ascending order, then again in descending order, each
   into a space of its own over the same chunks, and replays all of them in a
   shuffled order (the same on both ranks), each against eager;
2. releases the spaces captured last and at once (no NCCL call in between)
   captures sizes again in another order, so that new spaces take the released
   address ranges over other chunks; replays everything again;
3. sleeps and wakes the graph memory (chunks released, new ones mapped at the
   same addresses) and replays again -- unless NCCL can have registered graph
   memory (NCCL_GRAPH_REGISTER and NCCL_CUMEM_ENABLE on, exportable chunks),
   the case graphkit warns about.

Prints ``FINDING {json}`` lines and ``rank R ok`` at the end. A replay that differs
from eager raises, except with ``--probe``: then every phase runs (the sleep's
replays too), and each says how many graphs differed (``PHASE`` lines say where
a rank was if it has to be killed).
"""

from __future__ import annotations

import gc
import json
import logging
import os
import random
import sys

import torch
import torch.distributed as dist

import graphkit
import hal

H = 1024
SIZES = [1, 8, 64, 256, 512]  # all-gather receive buffers of 8 KiB to 4 MiB: inside one 2 MiB chunk and across two


def finding(**facts: object) -> None:
    print("FINDING", json.dumps(facts), flush=True)


class Rank:
    def __init__(self, rank: int, probe: bool, world: int = 2) -> None:
        self.rank, self.world, self.probe = rank, world, probe
        gen = torch.Generator().manual_seed(0)
        self.w = (torch.randn(H, H, generator=gen) / 32).cuda()
        self.xs = {n: torch.zeros(n, H, device="cuda") for n in SIZES}  # static inputs, outside graph memory
        self.be = hal.get_backend("cuda", device=rank, shareable=os.environ.get("HAL_TEST_SHAREABLE", "1") == "1")
        self.saver = graphkit.MemorySaver(self.be)
        self.pools = graphkit.GraphPools(self.be, saver=self.saver)
        self.graphs: dict[tuple[str, int], tuple[torch.cuda.CUDAGraph, int, torch.Tensor]] = {}
        self.replays = 0

    def step(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(x @ self.w)
        dist.all_reduce(h)  # in place: NCCL's ring and tree never register an in-place all-reduce
        gathered = torch.empty(self.world * x.shape[0], H, device="cuda")
        dist.all_gather_into_tensor(gathered, h)  # out of place: the receive buffer may be registered
        return gathered.view(self.world, -1, H).sum(0) + x

    def capture(self, key: tuple[str, int], warm_up: bool = True) -> None:
        n = key[1]
        if warm_up:
            self.step(self.xs[n])  # the engine's warm-up, on its own stream
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pools.pool(key)):
            out = self.step(self.xs[n])
        self.graphs[key] = (graph, n, out)

    def check(self, phase: str) -> None:
        """Replay every graph in a shuffled order (the same on both ranks, so collectives pair up) against eager."""
        print(f"PHASE rank {self.rank} replays {phase}", flush=True)
        keys = sorted(self.graphs)
        random.Random(phase).shuffle(keys)
        differ = []
        for key in keys:
            graph, n, out = self.graphs[key]
            self.replays += 1
            gen = torch.Generator().manual_seed(1000 * self.rank + self.replays)
            self.xs[n].copy_(torch.randn(n, H, generator=gen))
            graph.replay()
            expected = self.step(self.xs[n])
            if not self.probe:
                torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4, msg=f"{phase}: graph {key} differs")
            elif not torch.allclose(out, expected, rtol=1e-4, atol=1e-4):
                differ.append(list(key))
        torch.cuda.synchronize()
        if self.probe:
            finding(rank=self.rank, phase=phase, graphs=len(keys), differ=differ)
        else:
            print(f"rank {self.rank} {phase}: {len(keys)} graphs replay as eager", flush=True)

    def spaces(self) -> dict[int, tuple[int, int]]:
        return {i: (s.base, s.size) for i, s in self.pools.allocator.spaces.items()}

    def release(self, keys: list[tuple[str, int]]) -> None:
        for key in keys:
            graph, _, out = self.graphs.pop(key)
            graph.reset()
            del graph, out
        gc.collect()
        for key in keys:
            self.pools.release(key)
        self.pools.collect()


def reused(before: dict[int, tuple[int, int]], released: set[int], after: dict[int, tuple[int, int]]) -> dict:
    """How the new spaces sit over the released ones: same start (same chunk at each address) or shifted."""
    old = [before[i] for i in released]
    new = [after[i] for i in after if i not in before]
    overlapping = [(b, s) for b, s in new if any(b < ob + os_ and ob < b + s for ob, os_ in old)]
    shifted = [(b, s) for b, s in overlapping if all(b != ob for ob, _ in old)]
    return {"released": len(old), "new": len(new), "over_released": len(overlapping), "shifted": len(shifted)}


def main() -> None:
    rank = int(sys.argv[1])
    logging.basicConfig(level=logging.WARNING, format="%(name)s %(levelname)s %(message)s")
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=2, device_id=torch.device("cuda", rank))
    probe = "--probe" in sys.argv
    r = Rank(rank, probe)
    env = {k: os.environ.get(k) for k in ("NCCL_GRAPH_REGISTER", "NCCL_CUMEM_ENABLE", "NCCL_PROTO")}
    finding(rank=rank, nccl=".".join(map(str, torch.cuda.nccl.version())), torch=torch.__version__, env=env,
            memory_sharing=r.be.supports("memory_sharing"))
    r.step(r.xs[SIZES[-1]])  # the communicator, made outside any capture
    torch.cuda.synchronize()

    for n in SIZES:
        r.capture(("ascending", n))
    for n in reversed(SIZES):
        r.capture(("descending", n))
    r.check("captured ascending and descending")

    before = r.spaces()
    last = [("descending", n) for n in (256, 64, 8, 1)]  # the spaces captured last: their ranges end the arena
    r.release(last)
    released = set(before) - set(r.spaces())
    for n in (8, 256, 1, 64):  # another order: new spaces start elsewhere over the released ranges
        r.capture(("again", n), warm_up=False)  # no NCCL call between the release and the capture
    finding(rank=rank, reuse=reused(before, released, r.spaces()))
    r.check("recaptured over released address ranges")

    stale = (env["NCCL_GRAPH_REGISTER"] != "0" and env["NCCL_CUMEM_ENABLE"] != "0"
             and r.be.supports("memory_sharing"))
    r.saver.pause()
    r.saver.resume()
    if stale and not probe:
        finding(rank=rank, sleep="replays skipped: NCCL may hold registrations of the released chunks")
    else:
        r.check("after sleep and wake")

    r.release(sorted(r.graphs))
    r.pools.close()
    r.saver.close()
    dist.destroy_process_group()
    r.be.close()
    print(f"rank {rank} ok", flush=True)


if __name__ == "__main__":
    main()
