"""Graph buffers of every rank read in place by the others, over graphkit memory on CUDA (graphkit.memory.peers).

    python tests/cuda_scripts/peer_buffers.py --world 2 --out DIR [--same-device] [--timeout 150]

The launcher starts ``--world`` rank processes of this script (``tests/ranks.py``: a hard deadline for all),
each on its own GPU (``--same-device``: all on GPU 0, where only one is lent), and writes DIR/peer_buffers.json
(every rank's RESULT). Each rank, with torch.distributed (gloo: tokens only) up:

* captures, inside ``graphkit.graph_memory()`` over :class:`graphkit.GraphPools` held by a
  :class:`graphkit.MemorySaver`, one graph per size of a layered step, untouched torch code
  (``torch.cuda.graph``): per layer ``h = x * (layer + 1) + rank`` -- the buffer a custom all-reduce would read
  in place, noted as the capture goes (its address and bytes) -- and ``x = h.tanh() * 0.5``; the step's output is
  kept (so its granules get chunks of their own: buffers beside it are read through them);
* registers the noted buffers as a custom all-reduce's registration does after capture: ``publish`` (each rank),
  an all-gather of the tokens, ``resolve`` of every rank's token; timed against the captures;
* captures a *reader* graph in torch's own pool: for every peer buffer, the sum of its bytes read at the address
  the registration gave (a kernel reading a peer's graph buffer in place, its address fixed in the graph);
* replays every graph, then checks, buffer by buffer, the reader's sums against the sums each peer computes of
  its own buffers (exact integers); then ``pause()`` (the free memory the device reports is noted) and
  ``resume()`` on every rank, replays again and checks again with the reader graph captured before the sleep.

Exit 0 when every rank passed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

SIZES = (1, 8, 64, 256)
LAYERS = 8
HIDDEN = 4096


def rank_main(rank: int, world: int, same_device: bool) -> dict:
    import torch
    import torch.distributed as dist

    import graphkit
    import hal
    from graphkit.memory.peers import PeerMemory

    device = 0 if same_device else rank
    torch.cuda.set_device(device)
    dist.init_process_group("gloo", rank=rank, world_size=world)

    def gather(obj: object) -> list:
        out: list = [None] * world
        dist.all_gather_object(out, obj)
        return out

    be = hal.get_backend("cuda", device=device, shareable=True)  # chunks with a POSIX file descriptor handle type
    saver = graphkit.MemorySaver(be)
    pools = graphkit.GraphPools(be, "vmm", saver=saver)
    noted: list[tuple[int, int]] = []
    graphs, inputs, outputs = [], [], []
    t0 = time.perf_counter()
    with graphkit.graph_memory(pools=pools):
        for size in SIZES:
            x0 = torch.full((size, HIDDEN), 0.25 * (size % 7 + 1), device="cuda", dtype=torch.bfloat16)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                x = x0
                for layer in range(LAYERS):
                    h = x * (layer + 1) + rank
                    noted.append((h.data_ptr(), h.numel() * h.element_size()))
                    x = h.tanh() * 0.5
                out = x.float()
            graphs.append(g)
            inputs.append(x0)
            outputs.append(out)
    torch.cuda.synchronize()
    capture_s = time.perf_counter() - t0

    peers = PeerMemory(pools.allocator, timeout=60)
    peers.adopt(saver)
    t0 = time.perf_counter()
    tokens = gather(peers.publish(noted))
    addresses = [peers.resolve(t) for t in tokens]
    register_s = time.perf_counter() - t0

    reader_out = torch.zeros(world, len(noted), dtype=torch.int64, device="cuda")
    views = [[be.tensor_at(addresses[r][i], noted[i][1]) for i in range(len(noted))] for r in range(world)]
    reader = torch.cuda.CUDAGraph()
    with torch.cuda.graph(reader):
        for r in range(world):
            for i, view in enumerate(views[r]):
                reader_out[r, i] = view.to(torch.int64).sum()

    def own_sums() -> list[int]:
        return [int(be.tensor_at(p, n).to(torch.int64).sum()) for p, n in noted]

    def check(phase: str) -> int:
        for g in graphs:
            g.replay()
        torch.cuda.synchronize()
        every = gather(own_sums())  # after every rank replayed its graphs
        reader.replay()
        torch.cuda.synchronize()
        got = reader_out.tolist()
        bad = [(r, i) for r in range(world) for i in range(len(noted)) if got[r][i] != every[r][i]]
        if bad:
            raise AssertionError(f"{phase}: {len(bad)} buffer(s) read wrong in place, e.g. rank {bad[0][0]} "
                                 f"buffer {bad[0][1]}: {got[bad[0][0]][bad[0][1]]} != {every[bad[0][0]][bad[0][1]]}")
        distinct = len({every[r][i] for r in range(world) for i in range(len(noted))})
        return distinct

    distinct = check("after registration")
    gather(None)
    free_before = torch.cuda.mem_get_info()[0]
    saver.pause()
    gather(None)  # every rank paused: now each rank's chunks are free
    free_paused = torch.cuda.mem_get_info()[0]
    saver.resume()
    check("after pause and resume")
    result = {"rank": rank, "device": device, "buffers": len(noted), "graphs": len(graphs),
              "capture_s": round(capture_s, 4), "register_s": round(register_s, 4),
              "register_over_capture": round(register_s / capture_s, 4), "mapped": peers.mapped(),
              "chunks_bytes": pools.allocator.physical_bytes, "distinct_sums": distinct,
              "freed_by_pause_mib": round((free_paused - free_before) / 2**20, 1), "ok": True}
    gather(None)
    reader.reset()
    for g in graphs:
        g.reset()
    peers.close()
    dist.destroy_process_group()
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rank", nargs="?", type=int)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--same-device", action="store_true")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--timeout", type=float, default=150.0)
    args = parser.parse_args()
    if args.rank is not None:
        try:
            result = rank_main(args.rank, args.world, args.same_device)
        except Exception as exc:  # noqa: BLE001 - the rank's error goes to the launcher as its RESULT
            import traceback

            traceback.print_exc()
            print("RESULT " + json.dumps({"rank": args.rank, "ok": False, "error": f"{type(exc).__name__}: {exc}"}))
            return 1
        print("RESULT " + json.dumps(result))
        return 0
    from tests.ranks import explain, rank_env, run_ranks

    flags = ["--world", str(args.world)] + (["--same-device"] if args.same_device else [])
    results = run_ranks(Path(__file__), args.world, timeout=args.timeout, env=rank_env(), args=flags)
    ranks = [json.loads(line[7:]) for r in results for line in r.output.splitlines() if line.startswith("RESULT ")]
    summary = {"world": args.world, "same_device": args.same_device, "ranks": ranks,
               "ok": all(r.ok for r in results) and len(ranks) == args.world and all(r["ok"] for r in ranks)}
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "peer_buffers.json").write_text(json.dumps(summary, indent=1))
    print("RESULT " + json.dumps(summary))
    if not summary["ok"]:
        print(explain(results))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
