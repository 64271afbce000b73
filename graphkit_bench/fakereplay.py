"""``python -m graphkit_bench.fakereplay``: what replaying a fake graph costs against eager, on the CPU.

Two workloads, each captured on the ``fake`` backend:

* ``mlp16``: a 16-layer small-op model (``Linear(64, 64)``, GELU, a
  hand-written layer norm of elementwise ops and a residual add per layer);
* ``demo``: the demo's batch-1 decode step (:class:`graphkit_bench.model.Decoder`
  with :meth:`DecoderConfig.tiny`, a cache for the demo's largest batch).

For each: eager milliseconds (``torch.no_grad``), the replay of the graph
alone (``Backend.replay``) and a call through :class:`graphkit.GraphRunner`
(inputs copied into its static buffers, replay, output views), as medians
of ``--iters`` calls, and their ratios to eager. The three are timed in
turns (one call of each per round, as :func:`graphkit_bench.timing.median_ms`
times one), so that load from other processes on a shared machine weighs on
all three alike. ``--profile`` prints where replay time goes (cProfile, top
functions by total time).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import logging
import platform
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F

import graphkit
import hal
from graphkit_bench.model import Decoder, DecoderConfig

log = logging.getLogger("graphkit.bench.fakereplay")

#: the demo's largest batch: its decoder (and KV cache) is sized for it
DEMO_MAX_BATCH = 64


@dataclass
class Row:
    """One workload's figures (milliseconds are medians)."""

    workload: str
    batch: int
    ops: int
    eager_ms: float
    replay_ms: float
    runner_ms: float

    @property
    def replay_ratio(self) -> float:
        return self.replay_ms / self.eager_ms

    @property
    def runner_ratio(self) -> float:
        return self.runner_ms / self.eager_ms


class SmallOpModel:
    """``layers`` x (Linear(width, width), GELU, elementwise layer norm, residual): many small ops."""

    def __init__(self, layers: int = 16, width: int = 64, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.layers = [
            (torch.randn(width, width, generator=gen) / width ** 0.5, torch.randn(width, generator=gen) * 0.1,
             1 + 0.1 * torch.randn(width, generator=gen), 0.1 * torch.randn(width, generator=gen))
            for _ in range(layers)
        ]

    def step(self, x: torch.Tensor) -> torch.Tensor:
        for weight, bias, gain, shift in self.layers:
            y = F.gelu(F.linear(x, weight, bias))
            mean = y.mean(-1, keepdim=True)
            centred = y - mean
            var = (centred * centred).mean(-1, keepdim=True)
            x = x + centred * torch.rsqrt(var + 1e-5) * gain + shift
        return x


def graph_of(be: hal.Backend, fn: Callable[..., Any], inputs: dict[str, torch.Tensor]) -> tuple[Any, Any]:
    """Capture ``fn(**inputs)`` on ``be`` (one warm-up call first); return the graph and its outputs."""
    with torch.no_grad():
        fn(**inputs)
        graph = be.create_graph()
        with be.capture(graph):
            out = fn(**inputs)
    return graph, out


def interleaved_medians(be: hal.Backend, fns: list[Callable[[], Any]], iters: int,
                        warmup: int = 3) -> list[float]:
    """Median milliseconds of each of ``fns``, called in turns ``iters`` times, each synchronised on both sides."""
    for fn in fns:
        for _ in range(warmup):
            fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(iters):
        for fn, out in zip(fns, times, strict=True):
            be.synchronize()
            t0 = time.perf_counter()
            fn()
            be.synchronize()
            out.append((time.perf_counter() - t0) * 1e3)
    return [statistics.median(t) for t in times]


def measure(be: hal.Backend, name: str, fn: Callable[..., Any], inputs: dict[str, torch.Tensor],
            iters: int, reset: Callable[[], None] | None = None) -> tuple[Row, Any]:
    """Eager, replay and runner medians of one workload; also the graph (for profiling)."""
    batch = next(iter(inputs.values())).shape[0]

    def eager() -> None:
        with torch.no_grad():
            fn(**inputs)

    graph, out = graph_of(be, fn, inputs)
    runner = graphkit.GraphRunner(fn, [batch], backend=be, kind="shared", outputs="view", progress=False)
    runner.capture(inputs)
    try:
        for _ in range(2):  # all three agree before anything is timed
            if reset:
                reset()
            with torch.no_grad():
                want = fn(**inputs).clone()
            if reset:
                reset()
            be.replay(graph)
            torch.testing.assert_close(out, want)
            if reset:
                reset()
            torch.testing.assert_close(runner(**inputs), want)
        eager_ms, replay_ms, runner_ms = interleaved_medians(
            be, [eager, lambda: be.replay(graph), lambda: runner(**inputs)], iters)
    finally:
        runner.close()
    ops = len(getattr(graph, "ops", ()))
    return Row(name, batch, ops, eager_ms, replay_ms, runner_ms), (graph, out)


def profile(be: hal.Backend, graph: Any, calls: int, top: int) -> str:
    """cProfile of ``calls`` replays: the ``top`` functions by total time."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        be.replay(graph)
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    return buf.getvalue()


def op_breakdown(graph: Any, calls: int, top: int) -> str:
    """Milliseconds per replay spent in each kind of step of a compiled fake graph (a fake-only view)."""
    program, ops = getattr(graph, "program", None), getattr(graph, "ops", None)
    if not program or not ops or len(program) != len(ops):
        return "(no compiled program to break down)"
    totals: dict[str, float] = {}
    counts: dict[str, int] = {}
    with torch.no_grad():
        for _ in range(calls):
            for (fn, args, kwargs), op in zip(program, ops, strict=True):
                how = "copies" if getattr(fn, "__self__", None) is None and hasattr(fn, "__code__") else "writes"
                key = f"{op.func} ({how})"
                t0 = time.perf_counter()
                fn(*args, **kwargs)
                totals[key] = totals.get(key, 0.0) + time.perf_counter() - t0
                counts[key] = counts.get(key, 0) + 1
    lines = [f"{'ms/replay':>9} {'steps':>5}  op (writes in place | runs and copies)"]
    for key, total in sorted(totals.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"{total * 1e3 / calls:9.3f} {counts[key] // calls:5d}  {key}")
    return "\n".join(lines)


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m graphkit_bench.fakereplay", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=200, help="timed calls per figure (median)")
    parser.add_argument("--batch", type=int, default=4, help="batch of the 16-layer model")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--profile", action="store_true", help="print a cProfile of each workload's replays")
    parser.add_argument("--top", type=int, default=15, help="functions per profile")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON too")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    be = hal.get_backend("fake", granularity=64 << 10)
    rows, graphs = [], []
    try:
        mlp = SmallOpModel()
        x = torch.randn(args.batch, 64, generator=torch.Generator().manual_seed(1))
        row, kept = measure(be, "mlp16", mlp.step, {"x": x}, args.iters)
        rows.append(row)
        graphs.append(kept)
        dec = Decoder(DecoderConfig.tiny(), DEMO_MAX_BATCH, be.torch_device())
        row, kept = measure(be, "demo", dec.step, dec.example_inputs(1, seed=1), args.iters, reset=dec.reset_cache)
        rows.append(row)
        graphs.append(kept)
        print(f"fake replay against eager: {cpu_model()}, {torch.get_num_threads()} torch thread(s), "
              f"torch {torch.__version__}, python {sys.version.split()[0]}, median of {args.iters}")
        print(f"{'workload':10} {'batch':>5} {'ops':>5} {'eager ms':>9} {'replay ms':>10} {'x eager':>8} "
              f"{'runner ms':>10} {'x eager':>8}")
        for r in rows:
            print(f"{r.workload:10} {r.batch:5d} {r.ops:5d} {r.eager_ms:9.3f} {r.replay_ms:10.3f} "
                  f"{r.replay_ratio:8.2f} {r.runner_ms:10.3f} {r.runner_ratio:8.2f}")
        if args.json:
            print(json.dumps([{**asdict(r), "replay_ratio": r.replay_ratio, "runner_ratio": r.runner_ratio}
                              for r in rows], indent=1))
        if args.profile:
            for r, (graph, _) in zip(rows, graphs, strict=True):
                print(f"\n--- cProfile: {r.workload}, 50 replays ---")
                print(profile(be, graph, 50, args.top))
                print(f"--- steps of {r.workload} by time, 50 replays ---")
                print(op_breakdown(graph, 50, args.top))
    finally:
        for graph, _ in graphs:
            be.release_graph(graph)
        graphs.clear()
        be.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
