"""A custom all-reduce nobody here wrote (torch's symmetric memory) captured in graphs over graphkit memory, N ranks.

    python tests/cuda_scripts/custom_allreduce.py --world 4 --out DIR [--timeout 200] [--reps 7] [--iters 50]

The launcher starts ``--world`` rank processes of this script (``--rank R``), each with a hard deadline
(``tests/ranks.py``: every rank is killed at ``--timeout``, the others a few seconds after one fails), and
writes DIR/custom_allreduce.json (every rank's RESULT) and DIR/custom_allreduce.md (one line for the
benchmark table). It prints ``RESULT {json}`` (the summary) and exits 0 when every rank passed.

Each rank, on its own GPU, with torch.distributed (NCCL) up:

* allocates one symmetric buffer (``torch.distributed._symmetric_memory.empty`` + ``rendezvous``) outside
  any graph: the buffer the all-reduce owns, as vLLM's ``SymmMemCommunicator`` and SGLang's
  ``TorchSymmMemCommunicator`` do;
* captures, inside ``graphkit.graph_memory()`` (a ``MemorySaver`` attached), one graph per (kind, size):
  ``h = x * (rank + 1)``, ``r = all_reduce(h)``, ``out = r + x``. ``h``, ``r`` and ``out`` are graph memory,
  i.e. graphkit's: the spaces of every size share the same chunks. Kinds: ``one_shot_copy``
  (``symm_mem.one_shot_all_reduce_copy``: the kernel copies ``h`` into the buffer and writes ``r``),
  ``two_shot`` (the engines' staging: copy in, ``symm_mem.two_shot_all_reduce_``, copy out), ``multimem``
  (the same with ``multimem_all_reduce_``, where the buffer has a multicast address) and ``nccl`` (NCCL in
  the graph, the reference for latency);
* checks every replay against NCCL's all-reduce run eagerly (bf16 small integers: the sums are exact, so
  "equal" is ``torch.equal``): replays in a shuffled order, each checked right after it (the keys before it
  ran over the same chunks); all keys replayed, then every output checked (each kept its own result); after
  ``MemorySaver.pause()`` and ``resume()`` (new chunks at the same addresses), the same again;
* measures replay latency of each (kind, size) over graphkit memory against the same graph captured in
  torch's own graph pool, interleaved (the order of the two alternates per repetition): per repetition the
  mean of ``--iters`` replays timed with CUDA events; median, minimum and maximum over ``--reps``.

Each rank prints one ``RESULT {json}`` line.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

#: elements (bf16) per all-reduce: 4 KiB to 2 MiB, every one a multiple of 16 bytes times 8 ranks
SIZES = (2048, 32768, 262144, 1048576)
KINDS = ("one_shot_copy", "two_shot", "multimem", "nccl")
#: the kinds that are a custom all-reduce (code of torch's symmetric memory), not NCCL
CUSTOM = ("one_shot_copy", "two_shot", "multimem")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2, help="ranks, one GPU each (2, 4 or 8)")
    parser.add_argument("--rank", type=int, default=None, help="run as this rank (the launcher sets it)")
    parser.add_argument("--out", type=Path, default=None, help="folder for custom_allreduce.json and .md")
    parser.add_argument("--timeout", type=float, default=200.0, help="seconds before every rank is killed")
    parser.add_argument("--reps", type=int, default=7, help="interleaved latency repetitions")
    parser.add_argument("--iters", type=int, default=50, help="replays per timed repetition")
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)), help="bf16 elements per all-reduce")
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"a subset of {','.join(KINDS)}")
    args = parser.parse_args(argv)
    args.sizes = [int(s) for s in str(args.sizes).split(",") if s]
    args.kinds = [k for k in str(args.kinds).split(",") if k]
    bad = [k for k in args.kinds if k not in KINDS]
    if bad:
        parser.error(f"--kinds: unknown {bad}; choose from {KINDS}")
    if args.world < 2:
        parser.error("--world must be at least 2")
    if not args.sizes or any(n <= 0 or (2 * n) % (16 * args.world) for n in args.sizes):
        parser.error(f"--sizes: each a positive number of bf16 elements, a multiple of {8 * args.world}")
    if args.reps < 1 or args.iters < 1:
        parser.error("--reps and --iters must be at least 1")
    if args.rank is not None and not 0 <= args.rank < args.world:
        parser.error(f"--rank {args.rank} outside 0..{args.world - 1}")
    return args


def stats(samples: Sequence[float]) -> dict[str, float | int]:
    """Median, minimum, maximum and count of ``samples``, and the spread (max - min) relative to the median."""
    if not samples:
        raise ValueError("stats() of no samples")
    median = statistics.median(samples)
    return {"median": median, "min": min(samples), "max": max(samples), "n": len(samples),
            "spread": (max(samples) - min(samples)) / median if median else 0.0}


def compare(graphkit_us: Sequence[float], plain_us: Sequence[float]) -> dict[str, Any]:
    """Latency over graphkit memory against plain memory: both sides' stats, the ratio of the medians and the
    median of the per-repetition ratios (the repetitions are interleaved, so pairs share the machine's state)."""
    if len(graphkit_us) != len(plain_us):
        raise ValueError(f"compare(): {len(graphkit_us)} graphkit samples against {len(plain_us)} plain ones")
    pairs = [g / p for g, p in zip(graphkit_us, plain_us, strict=True) if p > 0]
    gk, plain = stats(graphkit_us), stats(plain_us)
    return {"graphkit_us": gk, "plain_us": plain,
            "ratio": gk["median"] / plain["median"] if plain["median"] else float("nan"),
            "paired_ratio": statistics.median(pairs) if pairs else float("nan")}


def markdown_line(summary: dict[str, Any]) -> str:
    """One line for the benchmark table: ranks, device, kinds, the worst and median latency ratio, correctness."""
    ratios = [(kind, size, row["ratio"]) for kind, per_size in summary["latency"].items() if kind in CUSTOM
              for size, row in per_size.items()]
    worst = max(ratios, key=lambda r: r[2]) if ratios else None
    median = statistics.median(r[2] for r in ratios) if ratios else float("nan")
    checks = "equal to NCCL after aliasing replays and a sleep" if summary["ok"] else "FAILED (see the JSON)"
    kinds = ", ".join(k for k in summary["kinds_run"] if k in CUSTOM) or "none"
    worst_text = f"{worst[2]:.3f}x ({worst[0]}, {int(worst[1]) * 2 // 1024} KiB)" if worst else "n/a"
    return (f"| custom all-reduce in graphs, {summary['world']} ranks, {summary.get('device', '?')} | "
            f"torch symm-mem {kinds} | graphkit/plain replay latency: median {median:.3f}x, worst {worst_text} "
            f"| {checks} | `{summary['command']}` |")


# -- one rank -------------------------------------------------------------------------------------------------


def legacy_ipc_capable(ptr: int) -> int | None:
    """The driver's ``CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE`` at ``ptr`` (None without cuda-bindings)."""
    try:
        from cuda.bindings import driver as d
    except ImportError:
        return None
    err, capable = d.cuPointerGetAttribute(d.CUpointer_attribute.CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE,
                                           ptr)
    return int(capable) if int(err) == 0 else None


def run_rank(args: argparse.Namespace) -> dict[str, Any]:
    import warnings

    import torch
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    import graphkit
    import hal

    rank, world = args.rank, args.world
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
    group = dist.group.WORLD
    assert group is not None
    group_name = group.group_name
    if hasattr(symm_mem, "enable_symm_mem_for_group"):  # needed by older torch, a deprecated no-op by newer
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            symm_mem.enable_symm_mem_for_group(group_name)
    result: dict[str, Any] = {"rank": rank, "world": world, "torch": torch.__version__,
                              "nccl": ".".join(map(str, torch.cuda.nccl.version())),
                              "device": torch.cuda.get_device_name(rank)}
    # the buffer the all-reduce owns: made and exchanged once, outside graph memory, before any capture
    buffer = symm_mem.empty(max(args.sizes), dtype=torch.bfloat16, device=device)
    handle = symm_mem.rendezvous(buffer, group_name)
    multicast = int(getattr(handle, "multicast_ptr", 0) or 0) != 0
    try:
        result["symm_backend"] = symm_mem.get_backend(device)
    except (AttributeError, RuntimeError):  # older torch: one backend, no getter
        result["symm_backend"] = None
    result["multicast"] = multicast
    ops = torch.ops.symm_mem
    missing = [name for name in ("one_shot_all_reduce_copy", "two_shot_all_reduce_", "multimem_all_reduce_")
               if not hasattr(ops, name)]
    result["ops_missing"] = missing
    kinds = [k for k in args.kinds
             if not (k == "one_shot_copy" and "one_shot_all_reduce_copy" in missing)
             and not (k == "two_shot" and "two_shot_all_reduce_" in missing)
             and not (k == "multimem" and ("multimem_all_reduce_" in missing or not multicast))]
    result["kinds_run"] = kinds

    def all_reduce(kind: str, h: torch.Tensor) -> torch.Tensor:
        n = h.numel()
        if kind == "one_shot_copy":
            return ops.one_shot_all_reduce_copy(buffer[:n], h, "sum", group_name)
        if kind in ("two_shot", "multimem"):
            buffer[:n].copy_(h)
            if kind == "two_shot":
                ops.two_shot_all_reduce_(buffer[:n], "sum", group_name)
            else:
                ops.multimem_all_reduce_(buffer[:n], "sum", group_name)
            out = torch.empty_like(h)
            out.copy_(buffer[:n])
            return out
        r = h.clone()
        dist.all_reduce(r)
        return r

    def step(kind: str, x: torch.Tensor) -> torch.Tensor:
        h = x * (rank + 1)
        return all_reduce(kind, h) + x

    def expected(x: torch.Tensor) -> torch.Tensor:
        ref = x * (rank + 1)
        dist.all_reduce(ref)  # NCCL, eager
        return ref + x

    keys = [(kind, n) for n in args.sizes for kind in kinds]
    inputs = {key: torch.zeros(key[1], dtype=torch.bfloat16, device=device) for key in keys}  # static, outside
    feeds = [0]

    def feed(key: tuple[str, int]) -> None:
        feeds[0] += 1
        gen = torch.Generator().manual_seed(7919 * feeds[0] + rank)
        inputs[key].copy_(torch.randint(-8, 9, (key[1],), generator=gen).to(torch.bfloat16))

    # warm-up and eager correctness (first calls set the ops up), outside any capture
    for key in keys:
        feed(key)
        torch.testing.assert_close(step(key[0], inputs[key]), expected(inputs[key]), rtol=0, atol=0)
    torch.cuda.synchronize()

    # the same graphs in torch's own graph pool (one private pool each), for latency, captured outside the scope
    plain: dict[tuple[str, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
    for key in keys:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step(key[0], inputs[key])
        plain[key] = (graph, out)

    be = hal.get_backend("cuda", device=rank)
    saver = graphkit.MemorySaver(be)
    pools = graphkit.GraphPools(be, saver=saver)
    graphs: dict[tuple[str, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
    in_graph: dict[str, list[int]] = {"h": [], "out": []}
    with graphkit.graph_memory(pools=pools):
        for key in keys:  # ascending sizes: every space over the chunks the largest maps
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                h = inputs[key] * (rank + 1)
                out = all_reduce(key[0], h) + inputs[key]
            in_graph["h"].append(h.data_ptr())
            in_graph["out"].append(out.data_ptr())
            graphs[key] = (graph, out)
            del h
    spaces = [(s.base, s.size) for s in pools.allocator.spaces.values()] if pools.allocator else []

    def inside(ptr: int) -> bool:
        return any(base <= ptr < base + size for base, size in spaces)

    result["graph_memory_is_graphkit"] = all(inside(p) for p in in_graph["h"] + in_graph["out"])
    result["plain_memory_is_graphkit"] = any(inside(out.data_ptr()) for _, out in plain.values())
    result["legacy_ipc_capable_graph_buffers"] = sorted({legacy_ipc_capable(p) for p in in_graph["h"]},
                                                        key=str)
    result["legacy_ipc_capable_plain_buffers"] = sorted({legacy_ipc_capable(out.data_ptr())
                                                         for _, out in plain.values()}, key=str)
    report = pools.report()
    result["pools_report"] = str(report).splitlines()[0] if str(report) else ""
    checks: dict[str, int] = {}

    def check_each(phase: str) -> None:
        order = list(keys)
        random.Random(phase).shuffle(order)  # the same order on every rank: the collectives pair up
        for key in order:
            graph, out = graphs[key]
            feed(key)
            graph.replay()
            want = expected(inputs[key])
            if not torch.equal(out, want):
                raise AssertionError(f"rank {rank}, {phase}: graph {key} differs from NCCL's all-reduce: "
                                     f"{int((out != want).sum())} of {out.numel()} elements")
        torch.cuda.synchronize()
        checks[phase] = len(order)

    def check_kept(phase: str) -> None:
        wants = {}
        for key in keys:  # every key replays over the chunks of the ones before it
            feed(key)
            wants[key] = inputs[key].clone()
            graphs[key][0].replay()
        for key in keys:
            want = expected(wants[key])
            if not torch.equal(graphs[key][1], want):
                raise AssertionError(f"rank {rank}, {phase}: graph {key}'s output did not keep its result")
        torch.cuda.synchronize()
        checks[phase] = len(keys)

    check_each("replays, shuffled")
    check_kept("all replayed, then read")
    saver.pause()
    saver.resume()
    check_each("after sleep and resume, shuffled")
    check_kept("after sleep and resume, all replayed, then read")
    result["checks"] = checks

    # latency: interleaved repetitions, graphkit's and torch's own memory alternating who goes first
    def timed(graph: torch.cuda.CUDAGraph) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        graph.replay()  # not timed: settles the peers
        start.record()
        for _ in range(args.iters):
            graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1000.0 / args.iters

    samples: dict[tuple[str, int], dict[str, list[float]]] = {key: {"graphkit": [], "plain": []} for key in keys}
    for rep in range(args.reps):
        order: list[tuple[str, dict]] = [("graphkit", graphs), ("plain", plain)]
        if rep % 2:
            order.reverse()
        for key in keys:
            for mode, table in order:
                samples[key][mode].append(timed(table[key][0]))
    result["latency"] = {kind: {str(n): compare(samples[(kind, n)]["graphkit"], samples[(kind, n)]["plain"])
                                for (k, n) in keys if k == kind} for kind in kinds}

    torch.cuda.synchronize()
    for graph, _ in list(graphs.values()) + list(plain.values()):
        graph.reset()
    graphs.clear()
    plain.clear()
    del graph, out
    gc.collect()
    pools.close()
    saver.close()
    dist.barrier()
    dist.destroy_process_group()
    return result


# -- the launcher -----------------------------------------------------------------------------------------------


def launch(args: argparse.Namespace, argv: Sequence[str], runner: Callable[..., list] | None = None) -> int:
    """Run every rank with a deadline; write the JSON and the markdown line; 0 when every rank passed."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from tests.ranks import explain, rank_env, run_ranks

    runner = runner or run_ranks
    env = rank_env()
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])  # graphkit from this tree
    started = time.monotonic()
    results = runner(Path(__file__), args.world, timeout=args.timeout, env=env,
                     args=["--rank-from-argv", *argv])
    ranks: list[dict] = []
    for r in results:
        line = next((x for x in r.output.splitlines() if x.startswith("RESULT ")), None)
        ranks.append(json.loads(line[len("RESULT "):]) if line and r.ok else
                     {"rank": r.rank, "failed": r.returncode, "output": r.output[-4000:]})
    ok = all(r.ok for r in results) and all("failed" not in x for x in ranks)
    first = ranks[0] if ranks and "failed" not in ranks[0] else {}
    command = f"python tests/cuda_scripts/custom_allreduce.py {' '.join(argv)}"
    summary = {"ok": ok, "world": args.world, "device": first.get("device"), "seconds": time.monotonic() - started,
               "kinds_run": first.get("kinds_run", []), "latency": first.get("latency", {}), "command": command}
    line = markdown_line(summary)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "custom_allreduce.json").write_text(json.dumps({"summary": summary, "ranks": ranks}, indent=1))
        (args.out / "custom_allreduce.md").write_text(line + "\n")
    if not ok:
        print(explain(results), file=sys.stderr)
    print("RESULT", json.dumps({k: v for k, v in summary.items() if k != "latency"}
                               | {"markdown": line, "ratios": {k: {n: round(row["ratio"], 4) for n, row in v.items()}
                                                               for k, v in summary["latency"].items()}}), flush=True)
    return 0 if ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:2] and argv[1:2] == ["--rank-from-argv"]:  # a rank: ``RANK --rank-from-argv ARGS...`` (run_ranks)
        rank, rest = argv[0], argv[2:]
        args = parse_args([*rest, "--rank", rank])
        print("RESULT", json.dumps(run_rank(args)), flush=True)
        return 0
    args = parse_args(argv)
    if args.rank is not None:
        print("RESULT", json.dumps(run_rank(args)), flush=True)
        return 0
    return launch(args, argv)


if __name__ == "__main__":
    sys.exit(main())
