"""``python -m graphkit_bench.overhead``: a :class:`graphkit.GraphRunner` call against the hand-written loop.

Target 4 of the bench: the runner's step at batch 1 within 5% of the loop an
engine writes by hand on the same graph (copy the inputs into the static
buffers, replay the graph natively, slice the output). The two are timed in
turns (:func:`graphkit_bench.timing.interleaved_ms`), in ``--processes``
fresh processes, so that neither the order nor one process's luck decides.
Each process gives the ratio round by round; the target is judged on every
round of every process, through a confidence interval of the median ratio:
met when it lies at or under 1.05, missed when above, not judged when it
straddles (a machine too noisy to tell).

Workloads: ``demo`` (the demo's decoder, 9 sizes, what ``python -m graphkit
demo`` judges), ``reference`` (the reference decoder, 35 sizes; a GPU), and
``trivial`` (one small elementwise op: the runner's own cost per call is then
most of the step, shown in microseconds).

    python -m graphkit_bench.overhead --backend fake --processes 5
    python -m graphkit_bench.overhead --backend cuda --workload reference --processes 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

import graphkit
import hal
from graphkit_bench.fair import fmt_spread, judge_ratio, spread
from graphkit_bench.model import DecoderConfig
from graphkit_bench.run import HAND_LOOP_CALLS, REFERENCE_SIZES, Bench, BenchConfig
from graphkit_bench.targets import HAND_LOOP_LIMIT
from graphkit_bench.timing import interleaved_ms, round_ratios

WORKLOADS = ("demo", "reference", "trivial")
DEMO_SIZES = [1, 2, 4, 8, 16, 24, 32, 48, 64]
FAKE_GRANULARITY = 64 << 10  # the demo's


def _backend_options(backend: str | None) -> dict[str, Any]:
    name = hal.registry.select_backend_name(backend, requires=("graphs",))
    return {"granularity": FAKE_GRANULARITY} if name == "fake" else {}


def _trivial(backend: str | None, rounds: int) -> dict[str, list[float]]:
    """A one-op step (``x * 2`` on 64 floats): the hand loop is the copy, the native replay and the slice."""
    with hal.get_backend(backend, requires=("graphs",), **_backend_options(backend)) as be:
        runner = graphkit.GraphRunner(lambda x: x * 2, [1, 2, 4, 8], backend=be, outputs="view", progress=False)
        try:
            device = be.torch_device()
            runner.capture(x=torch.zeros(8, 64, device=device))
            x = torch.ones(1, 64, device=device)
            bucket = runner.bucket(1)
            assert bucket is not None  # captured above
            graph, out, buf = bucket.graphs[0], bucket.outputs[0], runner.inputs.buffers["x"]  # type: ignore[union-attr]
            native = getattr(graph, "torch_graph", graph)

            def hand() -> Any:
                buf[:1].copy_(x)
                native.replay()
                return out[:1]

            def through_hal() -> Any:
                buf[:1].copy_(x)
                be.replay(graph)
                return out[:1]

            return interleaved_ms(be, {"runner": lambda: runner(x=x), "hand": hand, "hal": through_hal}, rounds,
                                  HAND_LOOP_CALLS)
        finally:
            runner.close()


def one_process(workload: str, backend: str | None, rounds: int) -> dict[str, Any]:
    """The figures of one process: per-call milliseconds of both, round by round, and their ratios."""
    if workload == "trivial":
        return _figures(_trivial(backend, rounds))
    else:
        cfg = BenchConfig(workload=DecoderConfig.tiny() if workload == "demo" else DecoderConfig(),
                          sizes=DEMO_SIZES if workload == "demo" else list(REFERENCE_SIZES), strategies=["vmm"],
                          orders=["descending"], backend=backend, backend_options=_backend_options(backend),
                          progress=False)
        bench = Bench(cfg)
        try:
            runner = bench.make_runner("vmm", on_demand=False)
            runner.capture(bench.inputs[max(cfg.sizes)])
            inputs = bench.inputs[1]
            times = interleaved_ms(bench.be, {"runner": lambda: runner(**inputs), "hand": bench.hand_loop(runner, 1),
                                              "hal": bench.hand_loop(runner, 1, through_hal=True)},
                                   rounds, HAND_LOOP_CALLS)
            runner.close()
        finally:
            bench.close()
    return _figures(times)


def _figures(times: dict[str, list[float]]) -> dict[str, Any]:
    """One process's rounds: the runner, the hand loop, the hand loop replaying through hal, and their ratios."""
    return {"runner_ms": times["runner"], "hand_ms": times["hand"], "hal_ms": times["hal"],
            "ratios": round_ratios(times, "runner", "hand"), "hal_ratios": round_ratios(times, "hal", "hand"),
            "runner_over_hal": round_ratios(times, "runner", "hal")}


def summarise(runs: list[dict[str, Any]], workload: str, command: str) -> dict[str, Any]:
    """Per process and pooled: medians with their spread, the runner's extra microseconds, the judgement."""
    pooled = [r for run in runs for r in run["ratios"]]
    met, why = judge_ratio(pooled, HAND_LOOP_LIMIT)
    per_process = []
    for run in runs:
        runner_ms, hand_ms, hal_ms = (statistics.median(run[k]) for k in ("runner_ms", "hand_ms", "hal_ms"))
        per_process.append({"runner_ms": runner_ms, "hand_ms": hand_ms, "hal_ms": hal_ms,
                            "extra_us": (runner_ms - hand_ms) * 1e3, "hal_extra_us": (hal_ms - hand_ms) * 1e3,
                            "ratio": spread(run["ratios"]), "hal_ratio": spread(run["hal_ratios"]),
                            "judged": judge_ratio(run["ratios"], HAND_LOOP_LIMIT)[0]})
    return {"command": command, "workload": workload, "limit": HAND_LOOP_LIMIT, "processes": per_process,
            "ratio": spread(pooled), "met": met, "detail": why,
            "hal_ratio": spread(r for run in runs for r in run["hal_ratios"]),
            "runner_over_hal": spread(r for run in runs for r in run["runner_over_hal"]), "runs": runs}


def print_summary(out: dict[str, Any]) -> None:
    print(f"workload {out['workload']}: the runner at batch 1 against the hand-written loop, "
          f"{len(out['processes'])} process(es), timed in turns")
    print("hand: the loop an engine writes (inputs copied in, the framework's own replay, the output sliced); "
          "via hal: the same loop replaying through hal.Backend.replay")
    print(f"{'process':>8}{'runner ms':>12}{'hand ms':>12}{'via hal ms':>12}{'runner extra us':>17}"
          f"{'of which hal us':>17}{'runner / hand':>28}  judged")
    for i, p in enumerate(out["processes"]):
        judged = {True: "met", False: "MISSED", None: "not judged"}[p["judged"]]
        print(f"{i + 1:>8}{p['runner_ms']:>12.4f}{p['hand_ms']:>12.4f}{p['hal_ms']:>12.4f}{p['extra_us']:>17.1f}"
              f"{p['hal_extra_us']:>17.1f}{fmt_spread(p['ratio'], digits=4):>28}  {judged}")
    state = {True: "met", False: "MISSED", None: "not judged"}[out["met"]]
    print(f"target 4 (<= {out['limit']} x), every round of every process: [{state}] {out['detail']}")
    print(f"the loop via hal / hand: {fmt_spread(out['hal_ratio'], digits=4)}; runner / the loop via hal: "
          f"{fmt_spread(out['runner_over_hal'], digits=4)} (graphkit's own share)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m graphkit_bench.overhead", description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", choices=WORKLOADS, default="demo")
    parser.add_argument("--backend", default=None, help="hal backend (default: the best available)")
    parser.add_argument("--processes", type=int, default=5, help="fresh processes (0: this one)")
    parser.add_argument("--rounds", type=int, default=40, help="rounds in turns per process")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: 1 on fake, as in the demo; torch's own elsewhere)")
    parser.add_argument("--out-dir", type=Path, default=Path("bench-out"), help="where bench-overhead.json goes")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.processes < 0 or args.rounds < 1:
        parser.error("--processes must be >= 0 and --rounds >= 1")
    if args.threads is None and hal.registry.select_backend_name(args.backend, requires=("graphs",)) == "fake":
        args.threads = 1
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.child or args.processes == 0:
        run = one_process(args.workload, args.backend, args.rounds)
        if args.child:
            print(json.dumps(run))
            return 0
        runs = [run]
    else:
        child = [sys.executable, "-m", "graphkit_bench.overhead", "--child", "--workload", args.workload,
                 "--rounds", str(args.rounds), *(["--backend", args.backend] if args.backend else []),
                 *(["--threads", str(args.threads)] if args.threads else [])]
        runs = []
        for _ in range(args.processes):
            proc = subprocess.run(child, capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                print(proc.stderr[-4000:], file=sys.stderr)
                return 2
            runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    out = summarise(runs, args.workload, "python -m graphkit_bench.overhead " + " ".join(argv or sys.argv[1:]))
    print_summary(out)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path = args.out_dir / "bench-overhead.json"
    path.write_text(json.dumps(out, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
