"""``python -m graphkit_bench.trace``: a serving run's batch sizes, replayed under the executables budget.

A serving run is simulated (:func:`simulate`): requests arrive as a Poisson
process whose rate swings slowly between light and heavy load, each asks for
a seeded lognormal number of decode tokens, joins the running batch while it
holds fewer than the largest size (else waits), and leaves when done. Every
decode step's batch size is one entry of the trace (>= 2,000 steps for the
reference). The trace is then replayed, step by step, through

* the runner (:class:`graphkit.GraphRunner` on the reference decoder, the
  bench's sizes) with at most ``K`` executables per topology, for the default
  ``K`` and each of ``--ks``;
* the scope: an engine's own loop (nano-vllm's: static buffers, every size
  captured with the framework's graph API, ``graph.replay()``) inside
  ``graphkit.graph_memory(executables=K)``;

against each path with every size instantiated (``executables=None``). Each
step is timed on the device (:class:`graphkit_bench.trace_paths.StepClock`).
The trace is cut into ``--rounds`` parts; round by round every strategy runs
that part, in an order rotated from round to round, in ``--processes`` fresh
processes. Per strategy: step mean, p50, p99 and their ratios to every size
instantiated (overall, and round by round with their spread), executables'
bytes, updates, instantiations, refused updates, updates per step.

Targets (a GPU, >= 2,000 steps): step mean <= 1.02 x and p99 <= 1.25 x of
every size instantiated, pooled over every step, judged on a 95% interval
that resamples whole rounds (:func:`pooled_interval`): met or missed when it
lies on one side of the limit, not judged when it straddles it; the
recommended default ``K`` is the smallest that meets both on every path,
with the least memory.

    python -m graphkit_bench.trace --backend cuda --config reference --out-dir trace-out
    python -m graphkit_bench.trace --backend fake --config tiny --out-dir /tmp/trace
"""

from __future__ import annotations

import argparse
import collections
import functools
import itertools
import json
import logging
import math
import random
import shlex
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

import hal
from graphkit.graphs.executables import DEFAULT, Budget
from graphkit_bench.fair import fmt_spread, rotated, spread
from graphkit_bench.helptext import OneDefaultFormatter
from graphkit_bench.model import Decoder, DecoderConfig
from graphkit_bench.run import REFERENCE_SIZES
from graphkit_bench.timing import rel_error
from graphkit_bench.trace_paths import PATHS, StepClock, StepPath, open_path
from hal.types import fmt_bytes

log = logging.getLogger("graphkit.bench.trace")

#: the trace's targets: a strategy's step mean and p99 against every size instantiated on its path
MEAN_LIMIT = 1.02
P99_LIMIT = 1.25
#: the fewest decode steps a judged trace has
MIN_STEPS = 2000
KS = (1, 2, 4, 8)


# -- the serving run --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TraceOptions:
    """A simulated serving run (see :func:`simulate`)."""

    steps: int = 2000  # decode steps to record
    max_batch: int = 256  # the running batch holds at most this many requests (the largest captured size)
    seed: int = 0
    mean_length: float = 128.0  # decode tokens per request, on average (lognormal)
    length_sigma: float = 1.0  # the lognormal's sigma: how unequal the requests are
    load: float = 0.5  # running requests at the mean arrival rate, as a share of max_batch
    swing: float = 0.9  # the arrival rate swings between (1 - swing) and (1 + swing) x its mean
    period: int = 800  # ticks (decode-step times) of one swing

    def __post_init__(self) -> None:
        bad = [f"{name}={value!r} must be > 0" for name, value in (
            ("steps", self.steps), ("max_batch", self.max_batch), ("mean_length", self.mean_length),
            ("length_sigma", self.length_sigma), ("load", self.load), ("period", self.period)) if not value > 0]
        if not 0 <= self.swing < 1:
            bad.append(f"swing={self.swing!r} must be in [0, 1)")
        if bad:
            raise hal.InvalidArgumentError("; ".join(bad), call="TraceOptions")


@dataclass
class Trace:
    """Per decode step: the batch size, the requests that arrived since the previous step, those that finished
    at it, and those left waiting after it was formed."""

    options: TraceOptions
    batches: list[int] = field(default_factory=list)
    arrivals: list[int] = field(default_factory=list)
    departures: list[int] = field(default_factory=list)
    waiting: list[int] = field(default_factory=list)
    idle_ticks: int = 0  # ticks with no request to decode (no step)

    def buckets(self, sizes: list[int]) -> list[int]:
        """The captured size each step replays (the smallest size >= its batch)."""
        ordered = sorted(sizes)
        return [next(s for s in ordered if s >= b) for b in self.batches]

    def summary(self, sizes: list[int]) -> dict[str, Any]:
        buckets = self.buckets(sizes)
        changes = sum(a != b for a, b in itertools.pairwise(buckets))
        return {"steps": len(self.batches), "mean_batch": statistics.mean(self.batches),
                "min_batch": min(self.batches), "max_batch": max(self.batches),
                "requests": sum(self.arrivals), "finished": sum(self.departures), "idle_ticks": self.idle_ticks,
                "sizes_used": len(set(buckets)), "size_changes": changes,
                "steps_per_size": {str(s): c for s, c in sorted(collections.Counter(buckets).items())}}


def _poisson(rng: random.Random, rate: float) -> int:
    """A Poisson draw (Knuth's method; a normal approximation above a rate of 30)."""
    if rate > 30:
        return max(0, round(rng.gauss(rate, math.sqrt(rate))))
    limit, k, p = math.exp(-rate), 0, rng.random()
    while p > limit:
        k += 1
        p *= rng.random()
    return k


def simulate(opts: TraceOptions) -> Trace:
    """The batch size of every decode step of a seeded serving run.

    Each tick (the time of one decode step) a Poisson number of requests arrives
    at a rate that swings as a sine around ``load * max_batch / mean_length``
    (Little's law: about ``load * max_batch`` running); waiting requests join
    the running batch while it holds fewer than ``max_batch``; a tick with a
    running request is a decode step, after which every request has one token
    less and those with none left depart.
    """
    rng = random.Random(opts.seed)
    mean_rate = opts.load * opts.max_batch / opts.mean_length
    mu = math.log(opts.mean_length) - opts.length_sigma ** 2 / 2  # so that the lengths' mean is mean_length
    phase = rng.uniform(0, 2 * math.pi)
    trace = Trace(opts)
    running: list[int] = []  # tokens left per running request
    waiting: collections.deque[int] = collections.deque()
    arrived, tick = 0, 0
    while len(trace.batches) < opts.steps:
        if trace.idle_ticks > 100 * opts.steps + 10_000:
            raise hal.InvalidArgumentError(f"the load {opts.load} brings too few requests for {opts.steps} steps",
                                           call="simulate")
        rate = mean_rate * (1 + opts.swing * math.sin(2 * math.pi * tick / opts.period + phase))
        for _ in range(_poisson(rng, rate)):
            waiting.append(max(1, round(rng.lognormvariate(mu, opts.length_sigma))))
            arrived += 1
        tick += 1
        while waiting and len(running) < opts.max_batch:
            running.append(waiting.popleft())
        if not running:
            trace.idle_ticks += 1
            continue
        trace.batches.append(len(running))
        trace.arrivals.append(arrived)
        trace.waiting.append(len(waiting))
        arrived = 0
        running = [left - 1 for left in running]
        trace.departures.append(sum(left == 0 for left in running))
        running = [left for left in running if left > 0]
    return trace


# -- one process: every strategy over the trace --------------------------------------------------------------


@dataclass(frozen=True)
class Setup:
    """What a config replays: the decoder, its sizes, and the trace's defaults."""

    decoder: DecoderConfig
    sizes: list[int]
    steps: int
    mean_length: float


CONFIGS = {
    "reference": Setup(DecoderConfig(), list(REFERENCE_SIZES), 2000, 128.0),
    "tiny": Setup(DecoderConfig.tiny(), [1, 2, 4, 8, 16], 240, 24.0),
}


@dataclass(frozen=True)
class Strategy:
    path: str  # "runner" or "scope"
    budget: Budget  # executables kept per topology, "lazy" (one per size at its first replay), None: all at capture

    @property
    def name(self) -> str:
        return f"{self.path} {'all' if self.budget is None else _label(self.budget)}"


def strategies(paths: list[str], ks: list[int]) -> list[Strategy]:
    """Per path: every size instantiated, then each budget of ``ks`` and the default (once)."""
    budgets: list[Budget] = [*sorted(set(ks)), "lazy"]
    return [Strategy(p, b) for p in paths for b in (None, *budgets)]


def round_bounds(steps: int, rounds: int) -> list[tuple[int, int]]:
    """``rounds`` consecutive parts of ``steps`` steps, as even as they can be."""
    cuts = [round(k * steps / rounds) for k in range(rounds + 1)]
    return [(a, b) for a, b in itertools.pairwise(cuts) if b > a]


def _stats(path: Any) -> dict[str, Any] | None:
    stats = path.stats()
    return None if stats is None else {k: v for k, v in asdict(stats).items()}


def _worst_error(be: hal.Backend, model: Decoder, path: Any, inputs: dict[int, dict[str, torch.Tensor]],
                 largest: int) -> float:
    """The largest error of the path's step against eager, at a few batches (padded ones among them)."""
    worst = 0.0
    for batch in sorted({1, min(3, largest), largest // 2 + 1, largest}):
        model.reset_cache()
        with torch.no_grad():
            want = model.step(**inputs[batch]).clone()
        model.reset_cache()
        got = path.step(batch).clone()
        be.synchronize()
        worst = max(worst, rel_error(got, want))
    model.reset_cache()
    return worst


def run_part(clock: StepClock, path: StepPath, batches: list[int]) -> tuple[list[float], list[bool]]:
    """Milliseconds of each step of ``batches`` through ``path``, and whether the step updated or instantiated
    an executable (read between steps, outside the timing)."""
    times, busy = [], []
    before = path.events()
    for b in batches:
        times.append(clock.time(functools.partial(path.step, b)))
        after = path.events()
        busy.append(after != before)
        before = after
    return times, busy


def run_process(backend: str | None, device: int, config: str, opts: TraceOptions, plan: list[Strategy],
                rounds: int, index: int, progress: bool = True) -> dict[str, Any]:
    """Every strategy of ``plan`` over the trace, in this process: step times, executables, errors."""
    setup = CONFIGS[config]
    trace = simulate(opts)
    be = hal.get_backend(backend, device=device, requires=("graphs", "capture_routing"))
    if be.torch_device().type == "cpu":
        torch.set_num_threads(1)  # small host ops gain nothing from threads that wait on each other
    try:
        model = Decoder(setup.decoder, max(setup.sizes), be.torch_device(), seed=opts.seed)
        inputs = {b: model.example_inputs(b, seed=b) for b in range(1, max(setup.sizes) + 1)}
        opened = {s.name: open_path(s.path, be, model, setup.sizes, inputs, s.budget)
                  for s in tqdm(plan, desc="capturing", unit="strategy", disable=not progress, leave=False)}
        clock = StepClock(be)
        times: dict[str, list[float]] = {name: [] for name in opened}
        busy: dict[str, list[bool]] = {name: [] for name in opened}
        bounds = round_bounds(len(trace.batches), rounds)
        with torch.no_grad(), tqdm(total=len(bounds) * len(plan), desc=f"trace, process {index}", unit="part",
                                   disable=not progress) as bar:
            for r, (start, end) in enumerate(bounds):
                for name in rotated(list(opened), r + index):  # each strategy goes first in its turn
                    part_times, part_busy = run_part(clock, opened[name], trace.batches[start:end])
                    times[name] += part_times
                    busy[name] += part_busy
                    bar.update()
        strategies_out: dict[str, Any] = {}
        out = {"process": index, "machine": {"backend": be.name, "device": str(be.torch_device()),
                                             "device_name": _device_name(be)},
               "bounds": bounds, "strategies": strategies_out}
        for s in plan:
            path = opened[s.name]
            strategies_out[s.name] = {
                "path": s.path, "budget": s.budget, "times_ms": times[s.name], "busy": busy[s.name],
                "setup": path.setup,
                "stats": _stats(path), "max_rel_error": _worst_error(be, model, path, inputs, max(setup.sizes))}
        for path in opened.values():
            path.close()
        return out
    finally:
        be.close()


def _device_name(be: hal.Backend) -> str | None:
    device = be.torch_device()
    return torch.cuda.get_device_name(device) if device.type == "cuda" else None


# -- the figures ------------------------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of ``values``, linearly interpolated."""
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    low, high = math.floor(k), math.ceil(k)
    return ordered[low] + (ordered[high] - ordered[low]) * (k - low)


def _figures(times: list[float]) -> dict[str, float]:
    return {"mean_ms": statistics.mean(times), "p50_ms": percentile(times, 50), "p99_ms": percentile(times, 99)}


#: the fewest rounds (over every process) a target is judged from
MIN_ROUNDS = 6
#: resamples of the rounds for an interval of a pooled ratio
RESAMPLES = 1000


def pooled_interval(mine: list[list[float]], base: list[list[float]], q: float | None,
                    resamples: int = RESAMPLES, seed: int = 0) -> tuple[float, float]:
    """A 95% interval of the pooled ratio of ``mine``'s step times over ``base``'s -- their means (``q`` None)
    or their ``q``-th percentiles -- resampling whole rounds, paired, with replacement (a block bootstrap: the
    steps of a round are not independent, an update's cost falls where the trace changes size)."""
    width = max(len(r) for r in (*mine, *base))

    def table(rounds: list[list[float]]) -> torch.Tensor:
        t = torch.full((len(rounds), width), math.nan, dtype=torch.float64)
        for i, r in enumerate(rounds):
            t[i, :len(r)] = torch.tensor(r, dtype=torch.float64)
        return t

    resamples = max(1, min(resamples, (1 << 24) // (len(mine) * width)))  # torch.quantile's input limit
    picks = torch.randint(len(mine), (resamples, len(mine)), generator=torch.Generator().manual_seed(seed))
    m, b = table(mine)[picks].reshape(resamples, -1), table(base)[picks].reshape(resamples, -1)
    if q is None:
        ratios = m.nanmean(dim=1) / b.nanmean(dim=1)
    else:
        ratios = m.nanquantile(q / 100, dim=1) / b.nanquantile(q / 100, dim=1)
    return float(ratios.quantile(0.025)), float(ratios.quantile(0.975))


def judge(ratio: float, interval: tuple[float, float] | None, limit: float, judged: bool,
          why_not: str) -> tuple[bool | None, str]:
    """A target from the pooled ratio's interval: met when it lies at or under ``limit``, missed when above, not
    judged when it straddles ``limit``, there are too few rounds (``interval`` None), or ``why_not``."""
    if not judged:
        return None, f"not judged: {why_not}"
    if interval is None:
        return None, f"not judged: fewer than {MIN_ROUNDS} rounds for an interval"
    low, high = interval
    where = f"pooled ratio {ratio:.3f}, 95% interval (rounds resampled) {low:.3f}-{high:.3f}"
    if high <= limit:
        return True, where
    if low > limit:
        return False, where
    return None, f"not judged: {where} straddles {limit:g} (too noisy here to tell)"


def summarise(processes: list[dict[str, Any]], plan: list[Strategy], judged: bool,
              why_not: str = "") -> list[dict[str, Any]]:
    """Per strategy: step figures over every process, ratios to every size instantiated on its path (overall,
    and round by round, with their spread), the targets, and what its executables held and did."""
    rows = []
    for s in plan:
        base = Strategy(s.path, None).name
        mine = [p["strategies"][s.name] for p in processes]
        theirs = [p["strategies"][base] for p in processes]
        all_times = [t for m in mine for t in m["times_ms"]]
        base_times = [t for m in theirs for t in m["times_ms"]]
        figures, base_figures = _figures(all_times), _figures(base_times)
        mine_rounds, base_rounds = [], []
        for p, m, b in zip(processes, mine, theirs, strict=True):
            for start, end in p["bounds"]:
                mine_rounds.append(m["times_ms"][start:end])
                base_rounds.append(b["times_ms"][start:end])
        per_round = [(_figures(x), _figures(y)) for x, y in zip(mine_rounds, base_rounds, strict=True)]
        mean_ratios = [x["mean_ms"] / y["mean_ms"] for x, y in per_round]
        p99_ratios = [x["p99_ms"] / y["p99_ms"] for x, y in per_round]
        stats = [m["stats"] for m in mine]
        steps = len(mine[0]["times_ms"])
        # the steps that neither updated nor instantiated an executable, against the same steps of every size
        # instantiated: what running through the budget's executables costs besides the updates
        quiet = [(t, u) for m, b in zip(mine, theirs, strict=True)
                 for t, u, busy in zip(m["times_ms"], b["times_ms"], m.get("busy") or [False] * steps, strict=True)
                 if not busy]
        row: dict[str, Any] = {
            "strategy": s.name, "path": s.path, "budget": s.budget, "steps": steps, "processes": len(mine),
            **figures, **{f"ratio_{k.removesuffix('_ms')}": figures[k] / base_figures[k] for k in figures},
            "round_ratios_mean": spread(mean_ratios), "round_ratios_p99": spread(p99_ratios),
            "quiet_steps": len(quiet),
            "ratio_quiet_mean": (statistics.mean(t for t, _ in quiet) / statistics.mean(u for _, u in quiet)
                                 if quiet else None),
            "max_rel_error": max(m["max_rel_error"] for m in mine),
            "capture_seconds": spread(m["setup"]["capture_seconds"] for m in mine),
        }
        if s.budget is None:  # every size instantiated at its capture's end: the driver's memory of them all
            row.update(executables=spread(m["setup"]["graphs"] for m in mine),
                       executables_bytes=spread(m["setup"]["driver_bytes"] for m in mine), updates=spread([0]),
                       instantiations=spread(m["setup"]["graphs"] for m in mine), refused=spread([0]),
                       updates_per_step=0.0)
        else:
            row.update(executables=spread(x["executables"] for x in stats if x),
                       executables_bytes=spread(x["driver_bytes"] for x in stats if x),
                       updates=spread(x["updates"] for x in stats if x),
                       instantiations=spread(x["instantiations"] for x in stats if x),
                       refused=spread(x["refused"] for x in stats if x),
                       topologies=spread(x["topologies"] for x in stats if x))
            row["updates_per_step"] = (row["updates"]["median"] or 0) / steps
            enough = judged and len(mine_rounds) >= MIN_ROUNDS
            intervals = {key: pooled_interval(mine_rounds, base_rounds, q) if enough else None
                         for key, q in (("mean", None), ("p99", 99.0))}
            row["targets"] = {}
            for key, limit in (("mean", MEAN_LIMIT), ("p99", P99_LIMIT)):
                met, why = judge(row[f"ratio_{key}"], intervals[key], limit, judged, why_not)
                row["targets"][key] = {"met": met, "why": why, "interval": intervals[key]}
        rows.append(row)
    return rows


def _order(budget: Any) -> tuple[int, int]:
    """Budgets in order: K ascending, then lazy (one executable per size replayed)."""
    return (1, 0) if budget == "lazy" else (0, int(budget))


def _label(budget: Any) -> str:
    return "lazy" if budget == "lazy" else f"K={budget}"


def recommend(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The smallest ``K`` that meets both targets on every path, with the least executables' memory; the
    evidence per ``K``."""
    budgets = sorted({r["budget"] for r in rows if r["budget"] is not None}, key=_order)
    evidence, meeting = [], []
    for k in budgets:
        mine = [r for r in rows if r["budget"] == k]
        verdicts = [r["targets"][t]["met"] for r in mine for t in ("mean", "p99")]
        memory = [r["executables_bytes"]["median"] for r in mine if r["executables_bytes"]["median"] is not None]
        met = all(v is True for v in verdicts)
        evidence.append({"k": k, "met": met if all(v is not None for v in verdicts) else None,
                         "executables_bytes": max(memory) if memory else None,
                         "paths": {r["path"]: {"ratio_mean": r["ratio_mean"], "ratio_p99": r["ratio_p99"],
                                               "mean": r["targets"]["mean"]["met"], "p99": r["targets"]["p99"]["met"]}
                                   for r in mine}})
        if met:
            meeting.append(evidence[-1])
    if not meeting:
        judged = any(e["met"] is not None for e in evidence)
        why = ("no budget met both targets on every path" if judged else
               "no budget was judged (see the targets' reasons)")
        return {"k": None, "why": why, "evidence": evidence}
    best = min(meeting, key=lambda e: (e["executables_bytes"] if e["executables_bytes"] is not None else 0,
                                       _order(e["k"])))
    return {"k": best["k"], "why": (f"{_label(best['k'])}: the smallest budget that meets step mean <= "
                                    f"{MEAN_LIMIT:g} x and p99 <= {P99_LIMIT:g} x on every path, with the least "
                                    "executables' memory"),
            "evidence": evidence}


def markdown(result: dict[str, Any]) -> str:
    """The trace's figures as markdown: the run, the trace, a row per strategy, the targets, the recommendation."""
    t = result["trace"]
    m = result["machine"]
    lines = ["# Serving trace: step time under the executables budget", "",
             (f"* device: {m.get('device_name') or m['backend']} (backend {m['backend']}), config {result['config']}, "
             f"{len(result['sizes'])} sizes {result['sizes'][0]}..{result['sizes'][-1]}"),
             f"* command: `{result['command']}`",
             (f"* trace: {t['steps']} decode steps (seed {result['options']['seed']}), batch {t['min_batch']}..."
             f"{t['max_batch']} (mean {t['mean_batch']:.1f}), {t['requests']} requests, {t['sizes_used']} sizes "
             f"used, the size changing at {t['size_changes']} steps; {result['processes']} process(es) x "
             f"{result['rounds']} rounds, strategies in turns"),
             "", ("| strategy | mean ms | p50 ms | p99 ms | mean / all | p50 / all | p99 / all | mean / all per round "
             "| p99 / all per round | mean / all, steps without update | executables | bytes | updates | instantiated "
             "| refused | updates/step | max rel err |"),
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        memory = r["executables_bytes"]["median"]
        count = fmt_spread(r["executables"], digits=0) + (" (every size)" if r["budget"] is None else "")
        lines.append(
            f"| {r['strategy']} | {r['mean_ms']:.3f} | {r['p50_ms']:.3f} | {r['p99_ms']:.3f} | {r['ratio_mean']:.3f} "
            f"| {r['ratio_p50']:.3f} | {r['ratio_p99']:.3f} | {fmt_spread(r['round_ratios_mean'])} "
            f"| {fmt_spread(r['round_ratios_p99'])} | {_ratio(r['ratio_quiet_mean'])} ({r['quiet_steps']}) "
            f"| {count} | {_bytes(memory)} "
            f"| {fmt_spread(r['updates'], digits=0)} | {fmt_spread(r['instantiations'], digits=0)} "
            f"| {fmt_spread(r['refused'], digits=0)} | {r['updates_per_step']:.4f} | {r['max_rel_error']:.2e} |")
    lines += ["", ("all = every size instantiated (executables=None) on the same path; per round: median (min-max) of "
              "the rounds' ratios; steps without update: the steps that neither updated nor instantiated an "
              "executable (how many), against the same steps of all; bytes: the executables' driver memory (n/m: "
              "not measured, a host device); every size: the driver's memory of all the graphs."),
              "", "## Targets", ""]
    for r in result["rows"]:
        if r["budget"] is None:
            continue
        for key, limit in (("mean", MEAN_LIMIT), ("p99", P99_LIMIT)):
            target = r["targets"][key]
            state = {True: "met", False: "MISSED", None: "not judged"}[target["met"]]
            lines.append(f"* [{state}] {r['strategy']}: step {key} <= {limit:g} x every size instantiated — "
                         f"{target['why']}")
    rec = result["recommendation"]
    lines += ["", "## Recommended default", "",
              f"* {rec['why']}" + f" (graphkit's default now: {_label(DEFAULT)})"]
    for e in rec["evidence"]:
        paths = "; ".join(f"{p}: mean {v['ratio_mean']:.3f} x ({_state(v['mean'])}), p99 {v['ratio_p99']:.3f} x "
                          f"({_state(v['p99'])})" for p, v in e["paths"].items())
        memory = fmt_bytes(int(e["executables_bytes"])) if e["executables_bytes"] is not None else "n/m"
        lines.append(f"  * K={e['k']}: {paths}; executables {memory}")
    return "\n".join(lines) + "\n"


def _ratio(value: float | None) -> str:
    return f"{value:.3f}" if value is not None else "-"


def _bytes(value: float | None) -> str:
    return fmt_bytes(int(value)) if value is not None else "n/m"


def _state(met: bool | None) -> str:
    return {True: "met", False: "missed", None: "not judged"}[met]


# -- the command ------------------------------------------------------------------------------------------------


def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of ints") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must name ints >= 1")
    return sorted(set(values))


def _paths(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [n for n in names if n not in PATHS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"{text!r}: choose from {', '.join(PATHS)}")
    return [p for p in PATHS if p in names]


def _positive(kind: type) -> Any:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid {kind.__name__} value: {text!r}") from None
        if not value > 0 or (kind is float and math.isinf(value)):
            raise argparse.ArgumentTypeError(f"must be > 0 (got {text})")
        return value
    parse.__name__ = kind.__name__
    return parse


def parser() -> argparse.ArgumentParser:
    from graphkit_bench.cli import CliParser

    p = CliParser(prog="python -m graphkit_bench.trace", description=__doc__.split("\n\n")[0],
                  formatter_class=OneDefaultFormatter)
    p.add_argument("--backend", default=None, help="hal backend (default: the best available)")
    p.add_argument("--device", type=int, default=0, help="device index")
    p.add_argument("--config", choices=sorted(CONFIGS), default="reference",
                   help="the decoder and its sizes: the reference (35 sizes 1..256) or a tiny one (sizes 1..16)")
    p.add_argument("--steps", type=_positive(int), default=None,
                   help="decode steps of the trace (default: 2000 for the reference, 240 for tiny); the targets are "
                        f"judged from {MIN_STEPS}")
    p.add_argument("--seed", type=int, default=0, help="seed of the serving run (arrivals, request lengths)")
    p.add_argument("--load", type=_positive(float), default=0.5,
                   help="running requests at the mean arrival rate, as a share of the largest size")
    p.add_argument("--mean-length", type=_positive(float), default=None,
                   help="decode tokens per request, on average (default: 128 for the reference, 24 for tiny)")
    p.add_argument("--ks", type=_ints, default=list(KS), help="executables budgets to replay the trace with, "
                                                              "besides lazy executables (graphkit's default)")
    p.add_argument("--paths", type=_paths, default=list(PATHS),
                   help="runner (graphkit's GraphRunner), scope (an engine's own loop inside graph_memory)")
    p.add_argument("--rounds", type=_positive(int), default=8,
                   help="parts of the trace; every strategy runs each part in turns")
    p.add_argument("--processes", type=int, default=3,
                   help="fresh processes, each replaying the whole trace (0: in this process)")
    p.add_argument("--timeout", type=_positive(float), default=1200.0, help="seconds a process may take")
    p.add_argument("--out-dir", type=Path, default=Path("trace-out"), help="where trace.json and trace.md go")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--process-index", type=int, default=0, help=argparse.SUPPRESS)
    return p


def _options(args: argparse.Namespace) -> TraceOptions:
    setup = CONFIGS[args.config]
    return TraceOptions(steps=args.steps or setup.steps, max_batch=max(setup.sizes), seed=args.seed,
                        mean_length=args.mean_length or setup.mean_length, load=args.load)


def _run_children(argv: list[str], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Each process in turn, fresh, with a timeout; its figures."""
    out = []
    for i in range(args.processes):
        path = args.out_dir / f".trace-process-{i}.json"
        cmd = [sys.executable, "-m", "graphkit_bench.trace", *argv, "--child", str(path), "--process-index", str(i)]
        log.info("trace: process %d of %d", i + 1, args.processes)
        try:
            done = subprocess.run(cmd, timeout=args.timeout, check=False)
        except subprocess.TimeoutExpired:
            raise hal.HalError(f"trace process {i} ran past --timeout {args.timeout:g} s") from None
        if done.returncode != 0 or not path.exists():
            raise hal.HalError(f"trace process {i} failed (exit code {done.returncode}; its error is above)")
        out.append(json.loads(path.read_text()))
        path.unlink()
    return out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = parser()
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.processes < 0:
        p.error(f"--processes must be >= 0 (got {args.processes})")
    if args.device < 0:
        p.error(f"--device must be >= 0 (got {args.device})")
    try:
        opts = _options(args)
    except hal.InvalidArgumentError as exc:
        p.error(str(exc))
    plan = strategies(args.paths, args.ks)
    if args.child is not None:  # one process of a run: its figures to the file named
        result = run_process(args.backend, args.device, args.config, opts, plan, args.rounds, args.process_index,
                             progress=not args.no_progress)
        args.child.write_text(json.dumps(result))
        return 0
    from graphkit_bench.cli import backend_error, out_dir_error

    for why in (backend_error(args.backend, args.device), out_dir_error(args.out_dir)):
        if why:
            p.error(why)
    if args.processes:
        processes = _run_children(argv, args)
    else:
        processes = [run_process(args.backend, args.device, args.config, opts, plan, args.rounds, 0,
                                 progress=not args.no_progress)]
    machine = processes[0]["machine"]
    steps = opts.steps
    judged = machine["device"] != "cpu" and steps >= MIN_STEPS
    why_not = (f"a trace of {steps} steps (judged from {MIN_STEPS})" if steps < MIN_STEPS else
               "the device is the host: its updates (a tape recompiled) and launches are not a GPU's")
    rows = summarise(processes, plan, judged, why_not)
    trace = simulate(opts)
    sizes = CONFIGS[args.config].sizes
    result = {"command": "python -m graphkit_bench.trace " + shlex.join(argv), "machine": machine,
              "config": args.config, "sizes": sizes, "options": asdict(opts), "trace": trace.summary(sizes),
              "processes": len(processes), "rounds": args.rounds, "default_k": DEFAULT,
              "limits": {"mean": MEAN_LIMIT, "p99": P99_LIMIT}, "rows": rows, "recommendation": recommend(rows)}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    text = markdown(result)
    (args.out_dir / "trace.json").write_text(json.dumps(result, indent=1))
    (args.out_dir / "trace.md").write_text(text)
    log.info("%s\nwrote %s and %s", text, args.out_dir / "trace.json", args.out_dir / "trace.md")
    exact = all(r["max_rel_error"] < 2e-2 for r in rows)
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
