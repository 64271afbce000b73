"""How the driver's memory of instantiated graphs grows with graph nodes and with the number of variants, and what
two levers save: instantiating lazily, and one executable graph per topology.

    python -m graphkit_bench.graphmem sweep --out-dir DIR

Three parts, each in a fresh process (``--in-process``: all in this one),
every graph kept alive until its part ends (the driver keeps the memory of
destroyed graphs for reuse, which would hide the next measurement's):

* **nodes**: for each ``N`` of ``--nodes``, ``--copies`` graphs of ``N``
  in-place elementwise kernels on a small tensor (nothing is allocated in the
  capture): the device's used-memory growth over their captures, per graph
  and per node.
* **variants**: the decode step of the reference-shaped decoder captured for
  ``S`` sizes x ``M`` models x ``P`` pieces (a piece: a run of consecutive
  layers, the first with the embedding, the last with the logits), for each
  ``M`` of ``--models`` and ``P`` of ``--pieces``: the driver's memory in all,
  per graph and per node.
* **levers**, on ``--copies`` graphs of ``--lever-nodes`` elementwise kernels
  and on the decoder's sizes, each against the usual graphs (instantiated at
  the end of their captures) of the same work in the same process:

  - *lazy instantiation* (``create_graph(lazy=True)``: instantiated at the
    first replay): the driver's memory after the captures, after replaying
    the sizes a run uses (``--replayed``), after replaying all, as ratios to
    the usual; the capture, first-replay and replay times;
  - *one executable graph per topology* (``update_graph``): every capture
    lazy, each served by the first executable graph that takes an update to
    it (:class:`SharedExecs`): the executable graphs it takes, the driver's
    memory against one per capture, the time of an update and of a step
    (update and replay) against a replay;

  and whether the lever's results equal the usual graphs'.

The driver's memory of graphs is the device's used-memory growth less the
framework allocator's reserved-bytes growth (the pools' memory). A host
device (``fake``) has no driver memory: its rows say ``n/m`` and why, and
everything else (captures, replays, results) runs as on a GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import json
import logging
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

import hal
from graphkit.graphs.report import driver_memory
from graphkit_bench.model import Decoder, DecoderConfig
from graphkit_bench.timing import rel_error
from hal.types import fmt_bytes

log = logging.getLogger("graphkit.bench.drivermem")

#: one captured graph's work: given the previous graph's outputs (None for the first), returns its own
Work = Callable[[Any], Any]

DEFAULT_NODES = [1, 10, 100, 1000, 5000]
LAZY = "lazy instantiation (create_graph(lazy=True))"
UPDATE = "one executable graph per topology (update_graph)"
DEFAULT_SIZES = [1, 2, 4, 8, 16, 32, 64, 128]


# -- measuring ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Mark:
    """The device's used bytes and the framework allocator's reserved bytes at one moment."""

    used: int
    pool: int | None


class Meter:
    """Marks of device memory, and the driver's growth between two of them (device growth less the pools')."""

    def __init__(self, be: hal.Backend) -> None:
        self.be = be
        self.device = be.torch_device()
        self.framework = getattr(torch, self.device.type, None)  # torch.cuda, torch.npu, ...

    def mark(self) -> Mark:
        """Synchronise the device, then read it."""
        self.be.synchronize()
        reserved = getattr(self.framework, "memory_reserved", None)
        pool = int(reserved(self.device)) if reserved is not None and self.device.type != "cpu" else None
        return Mark(self.be.mem_info().used, pool)

    def driver(self, since: Mark) -> tuple[int | None, str]:
        """The driver's own memory gained since ``since`` (None and why where it cannot be told)."""
        now = self.mark()
        pool = now.pool - since.pool if now.pool is not None and since.pool is not None else None
        return driver_memory(self.be, now.used - since.used, pool)


@dataclasses.dataclass
class Captured:
    """Graphs captured from a list of works, with their outputs and what the capture cost."""

    graphs: list[Any]
    outs: list[Any]
    capture_s: float
    nodes: int | None  # in all, where the backend can read graphs


def capture_all(be: hal.Backend, works: Sequence[Work], *, pool: Any, stream: Any, lazy: bool,
                inspect: bool) -> Captured:
    """One graph per work, in order, each work given the previous one's outputs."""
    graphs: list[Any] = []
    outs: list[Any] = []
    prev: Any = None
    start = time.perf_counter()
    for work in works:
        graph = be.create_graph(lazy=lazy)
        with torch.no_grad(), be.capture(graph, pool, stream, inspect=inspect):
            prev = work(prev)
        graphs.append(graph)
        outs.append(prev)
    seconds = time.perf_counter() - start
    nodes = sum(be.graph_addresses(g).nodes for g in graphs) if inspect else None
    return Captured(graphs, outs, seconds, nodes)


def replay_each_ms(be: hal.Backend, graphs: Sequence[Any]) -> list[float]:
    """Milliseconds of one replay of each graph, in order, each synchronised (a lazy graph's first: its
    instantiation and its run)."""
    times = []
    for graph in graphs:
        be.synchronize()
        t0 = time.perf_counter()
        be.replay(graph)
        be.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def replay_ms(be: hal.Backend, graphs: Sequence[Any], rounds: int) -> float:
    """Mean milliseconds per graph of replaying ``graphs`` in order, ``rounds`` times, back to back."""
    be.synchronize()
    t0 = time.perf_counter()
    for _ in range(rounds):
        for graph in graphs:
            be.replay(graph)
    be.synchronize()
    return (time.perf_counter() - t0) * 1e3 / (rounds * len(graphs))


@dataclasses.dataclass
class Kept:
    """Graphs and pools kept alive until a part ends: a graph released earlier would leave the driver memory to
    reuse, which would hide the next measurement's."""

    captured: list[Captured] = dataclasses.field(default_factory=list)
    pools: list[Any] = dataclasses.field(default_factory=list)

    def pool(self, be: hal.Backend) -> Any:
        """A new pool of ``be``'s, kept."""
        self.pools.append(be.create_pool())
        return self.pools[-1]

    def release(self, be: hal.Backend) -> None:
        """Wait for the device, then release every graph, then every pool."""
        be.synchronize()
        for c in self.captured:
            for graph in c.graphs:
                be.release_graph(graph)
        for pool in self.pools:
            be.release_pool(pool)
        self.captured.clear()
        self.pools.clear()


def _per(value: int | None, count: int | None) -> float | None:
    return value / count if value is not None and count else None


# -- workloads ------------------------------------------------------------------------------------------------


def elementwise_works(x: torch.Tensor, nodes: int, copies: int) -> list[Work]:
    """``copies`` works of ``nodes`` in-place kernels each on ``x`` (halve, add one: the values stay bounded)."""

    def work(_: Any) -> torch.Tensor:
        for i in range(nodes):
            if i % 2:
                x.add_(1.0)
            else:
                x.mul_(0.5)
        return x

    return [work] * copies


def piece_bounds(layers: int, pieces: int) -> list[tuple[int, int]]:
    """``pieces`` runs of consecutive layers covering ``layers`` (as even as they can be)."""
    cuts = [round(k * layers / pieces) for k in range(pieces + 1)]
    return list(itertools.pairwise(cuts))


def decoder_works(model: Decoder, inputs: dict[str, torch.Tensor], pieces: int) -> list[Work]:
    """A decode step of ``model`` at ``inputs``'s batch in ``pieces`` works, each reading the previous one's
    hidden state; the last returns the logits."""
    bounds = piece_bounds(model.cfg.layers, pieces)
    works: list[Work] = []
    for k, (first, last) in enumerate(bounds):
        def work(h: Any, k: int = k, first: int = first, last: int = last) -> torch.Tensor:
            if k == 0:
                h = model.embed_tokens(inputs["tokens"])
            h = model.run_layers(h, inputs["positions"], inputs["slots"], first, last)
            return model.head(h) if k == len(bounds) - 1 else h
        works.append(work)
    return works


def warm_up(be: hal.Backend, stream: Any, works: Sequence[Work]) -> None:
    """Run the works eagerly on the capture stream (the libraries' lazily made state is made here, not in the
    measurement)."""
    prev: Any = None
    with torch.no_grad(), be.use_stream(stream):
        for work in works:
            prev = work(prev)
    be.synchronize()


class SharedExecs:
    """Lazy captures served by as few executable graphs as their topologies allow: each capture goes to the first
    executable graph that takes an update to it; one that none takes becomes an executable graph itself (updated
    with itself: instantiated). :meth:`step` replays capture ``i``, updating its executable graph first when that
    runs another capture."""

    def __init__(self, be: hal.Backend, sources: Sequence[Any]) -> None:
        self.be, self.sources = be, list(sources)
        self.execs: list[Any] = []
        self.exec_of: list[int] = []
        self.running: list[int | None] = []  # the capture each executable graph runs now
        self.refused = 0
        self.update_s: list[float] = []
        start = time.perf_counter()
        for i, source in enumerate(self.sources):
            self.exec_of.append(self._place(i, source))
        self.group_s = time.perf_counter() - start

    def _place(self, i: int, source: Any) -> int:
        for e, graph in enumerate(self.execs):
            try:
                self.be.update_graph(graph, source)
            except hal.InvalidArgumentError as exc:  # another topology
                self.refused += 1
                self.running[e] = None  # what it runs after a refusal is not counted on
                log.debug("drivermem: capture %d is not of executable graph %d's topology: %s", i, e, exc)
                continue
            self.running[e] = i
            return e
        self.be.update_graph(source, source)
        self.execs.append(source)
        self.running.append(i)
        return len(self.execs) - 1

    def step(self, i: int) -> None:
        e = self.exec_of[i]
        if self.running[e] != i:
            t0 = time.perf_counter()
            self.be.update_graph(self.execs[e], self.sources[i])
            self.update_s.append(time.perf_counter() - t0)
            self.running[e] = i
        self.be.replay(self.execs[e])

    def groups(self) -> list[list[int]]:
        """The captures of each executable graph."""
        return [[i for i, e in enumerate(self.exec_of) if e == k] for k in range(len(self.execs))]


# -- the three parts ------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Options:
    """What a sweep measures (the CLI's flags)."""

    nodes: list[int] = dataclasses.field(default_factory=lambda: list(DEFAULT_NODES))
    copies: int = 8
    numel: int = 1024
    sizes: list[int] = dataclasses.field(default_factory=lambda: list(DEFAULT_SIZES))
    models: list[int] = dataclasses.field(default_factory=lambda: [1, 2])
    pieces: list[int] = dataclasses.field(default_factory=lambda: [1, 4])
    lever_nodes: int = 1000
    replayed: int = 8  # the lever's run uses the sizes up to this one
    rounds: int = 20
    config: str = "reference"
    count_nodes: bool = True
    progress: bool = True
    parts: tuple[str, ...] = ("nodes", "variants", "levers")


class Sweep:
    """One backend, one capture stream, and the parts measured on them."""

    def __init__(self, be: hal.Backend, opts: Options) -> None:
        self.be, self.opts = be, opts
        self.meter = Meter(be)
        self.stream = be.create_stream()
        self.inspect = opts.count_nodes and be.supports("graph_addresses")
        self.device = be.torch_device()
        self.cfg = DecoderConfig() if opts.config == "reference" else DecoderConfig.tiny()
        self._prime()

    def _prime(self) -> None:
        """Capture, replay and release one graph first: what the first graph of a process sets up is no graph's."""
        x = torch.zeros(self.opts.numel, device=self.device)
        works = elementwise_works(x, 2, 1)
        warm_up(self.be, self.stream, works)
        primer = capture_all(self.be, works, pool=None, stream=self.stream, lazy=False, inspect=False)
        replay_each_ms(self.be, primer.graphs)
        Kept([primer]).release(self.be)

    def _bar(self, total: int, desc: str) -> Any:
        return tqdm(total=total, desc=desc, unit="case", disable=not self.opts.progress, leave=False)

    # -- nodes

    def nodes(self) -> list[dict[str, Any]]:
        """For each node count, ``copies`` graphs: the driver's memory per graph and per node."""
        opts = self.opts
        rows: list[dict[str, Any]] = []
        kept = Kept()
        try:
            with self._bar(len(opts.nodes), "driver memory: nodes") as bar:
                for n in opts.nodes:
                    x = torch.zeros(opts.numel, device=self.device)
                    works = elementwise_works(x, n, opts.copies)
                    warm_up(self.be, self.stream, works[:1])
                    before = self.meter.mark()
                    c = capture_all(self.be, works, pool=None, stream=self.stream, lazy=False, inspect=False)
                    kept.captured.append(c)
                    driver, why = self.meter.driver(before)
                    nodes = self._nodes_of(works[:1]) or n
                    replay = replay_ms(self.be, c.graphs, opts.rounds)
                    replayed, _ = self.meter.driver(before)  # what the first launches added, if anything
                    rows.append({"nodes_asked": n, "nodes": nodes, "graphs": opts.copies, "driver_bytes": driver,
                                 "driver_why": why, "per_graph_bytes": _per(driver, opts.copies),
                                 "per_node_bytes": _per(driver, opts.copies * nodes),
                                 "driver_after_replays_bytes": replayed,
                                 "capture_ms_per_graph": c.capture_s * 1e3 / opts.copies,
                                 "replay_ms_per_graph": replay})
                    bar.update()
        finally:
            kept.release(self.be)
        return rows

    def _nodes_of(self, works: Sequence[Work]) -> int | None:
        """Nodes of one graph of ``works`` (lazy where it can be: never instantiated, it costs nothing)."""
        if not self.inspect:
            return None
        c = capture_all(self.be, works, pool=None, stream=self.stream, lazy=self.be.supports("lazy_graphs"),
                        inspect=True)
        Kept([c]).release(self.be)
        return c.nodes

    # -- variants

    def _models(self, count: int) -> list[Decoder]:
        largest = max(self.opts.sizes)
        return [Decoder(self.cfg, largest, self.device, seed=seed) for seed in range(count)]

    def _variant_works(self, models: Sequence[Decoder], pieces: int) -> list[tuple[int, list[Work]]]:
        """Per model and size (largest first), the works of one step in ``pieces`` pieces."""
        out = []
        for model in models:
            for size in sorted(self.opts.sizes, reverse=True):
                inputs = model.example_inputs(size, seed=size)
                out.append((size, decoder_works(model, inputs, pieces)))
        return out

    def variants(self) -> list[dict[str, Any]]:
        """For each model count and piece count, every size captured: the driver's memory in all, per graph,
        per node, and as the sizes were added."""
        opts = self.opts
        rows: list[dict[str, Any]] = []
        kept = Kept()
        models = self._models(max(opts.models))
        cases = [(m, p) for m in opts.models for p in opts.pieces]
        try:
            with self._bar(len(cases), "driver memory: variants") as bar:
                for m, p in cases:
                    jobs = self._variant_works(models[:m], p)
                    for _, works in jobs:
                        warm_up(self.be, self.stream, works)
                    pool = kept.pool(self.be)  # one pool per case, as an engine has one
                    before = self.meter.mark()
                    graphs = nodes = 0
                    seconds = 0.0
                    growth = []
                    driver, why = None, ""
                    for size, works in jobs:
                        c = capture_all(self.be, works, pool=pool, stream=self.stream, lazy=False,
                                        inspect=self.inspect)
                        kept.captured.append(c)
                        graphs += len(c.graphs)
                        nodes += c.nodes or 0
                        seconds += c.capture_s
                        driver, why = self.meter.driver(before)
                        growth.append({"graphs": graphs, "size": size, "driver_bytes": driver})
                    rows.append({"sizes": len(opts.sizes), "models": m, "pieces": p, "graphs": graphs,
                                 "nodes": nodes or None, "driver_bytes": driver, "driver_why": why,
                                 "per_graph_bytes": _per(driver, graphs),
                                 "per_node_bytes": _per(driver, nodes or None),
                                 "capture_ms_per_graph": seconds * 1e3 / graphs, "growth": growth})
                    bar.update()
        finally:
            kept.release(self.be)
        return rows

    # -- levers

    def levers(self) -> list[dict[str, Any]]:
        """Lazy instantiation, then one executable graph per topology, against the usual: on the elementwise
        workload and on the decoder's sizes. A lever that fails gives a row with its error; the others go on."""
        opts = self.opts
        rows: list[dict[str, Any]] = []
        kept = Kept()
        update = self.be.supports("graph_update")
        if not update:
            rows.append({"lever": UPDATE, "workload": "-", "error": f"{self.be.name} cannot update graphs here "
                                                                     "(capability graph_update)"})
        try:
            with self._bar(4, "driver memory: levers") as bar:
                x = {k: torch.zeros(opts.numel, device=self.device) for k in ("usual", "lever")}
                xs = {k: [torch.zeros(opts.numel, device=self.device) for _ in range(opts.copies)] for k in x}

                def reset() -> None:
                    for t in (*x.values(), *xs["usual"], *xs["lever"]):
                        t.copy_(torch.linspace(-1, 1, opts.numel, device=self.device))

                works = {k: elementwise_works(x[k], opts.lever_nodes, opts.copies) for k in x}
                half = range(opts.copies // 2)
                what = f"{opts.copies} graphs of {opts.lever_nodes} elementwise kernels"
                rows.append(self._attempt(LAZY, what, lambda: self.lazy_lever(
                    what, [[w] for w in works["usual"]], [[w] for w in works["lever"]], used=half, reset=reset,
                    kept=kept, pool=False)))
                bar.update()
                if update:  # each graph on a tensor of its own: one topology, other arguments
                    one = {k: [elementwise_works(t, opts.lever_nodes, 1)[0] for t in xs[k]] for k in xs}
                    what_one = what + ", each on a tensor of its own"
                    rows.append(self._attempt(UPDATE, what_one, lambda: self.update_lever(
                        what_one, one["usual"], one["lever"], used=half, reset=reset, kept=kept, pool=False)))
                bar.update()
                model = self._models(1)[0]
                sized = self._variant_works([model], 1)
                jobs = [works for _, works in sized]
                used = [i for i, (size, _) in enumerate(sized) if size <= opts.replayed]
                what = f"decoder step, {len(jobs)} sizes (a run that uses sizes <= {opts.replayed})"
                rows.append(self._attempt(LAZY, what, lambda: self.lazy_lever(
                    what, jobs, jobs, used=used, reset=model.reset_cache, kept=kept, pool=True)))
                bar.update()
                if update:
                    steps = [works[0] for works in jobs]
                    rows.append(self._attempt(UPDATE, what, lambda: self.update_lever(
                        what, steps, steps, used=used, reset=model.reset_cache, kept=kept, pool=True)))
                bar.update()
        finally:
            kept.release(self.be)
        return rows

    def _attempt(self, lever: str, workload: str, measure: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """``measure()``, or a row with its error where it fails (logged with its traceback)."""
        try:
            return measure()
        except (hal.HalError, RuntimeError) as exc:
            log.exception("drivermem: %s on %s failed", lever, workload)
            self.be.synchronize()
            return {"lever": lever, "workload": workload, "error": f"{type(exc).__name__}: {exc}"}

    def update_lever(self, workload: str, usual_works: Sequence[Work], lever_works: Sequence[Work], *,
                     used: Sequence[int], reset: Callable[[], Any], kept: Kept, pool: bool) -> dict[str, Any]:
        """A graph per work, instantiated at its capture (the usual), against lazy captures of ``lever_works``
        and one executable graph per topology among them, updated to the capture a step needs
        (``update_graph``): the driver's memory, the time of an update and of a step, whether the used works'
        outputs are equal."""
        be, opts = self.be, self.opts
        for work in usual_works:
            warm_up(be, self.stream, [work])
        used = list(used)
        usual_pool = kept.pool(be) if pool else None
        before = self.meter.mark()
        usual = [capture_all(be, [w], pool=usual_pool, stream=self.stream, lazy=False, inspect=False)
                 for w in usual_works]
        kept.captured += usual
        usual_driver, why = self.meter.driver(before)
        reset()
        replay_each_ms(be, [usual[i].graphs[0] for i in used])
        usual_outs = [usual[i].outs[-1].clone() for i in used]
        usual_ms = replay_ms(be, [usual[i].graphs[0] for i in used], opts.rounds)
        lever_pool = kept.pool(be) if pool else None
        before = self.meter.mark()
        sources = [capture_all(be, [w], pool=lever_pool, stream=self.stream, lazy=True, inspect=False)
                   for w in lever_works]
        kept.captured += sources
        after_capture, _ = self.meter.driver(before)
        shared = SharedExecs(be, [c.graphs[0] for c in sources])
        after_group, _ = self.meter.driver(before)
        reset()
        for i in used:
            shared.step(i)
        be.synchronize()
        outs = [sources[i].outs[-1].clone() for i in used]
        err = max((rel_error(a.float(), b.float()) for a, b in zip(outs, usual_outs, strict=True)), default=0.0)
        shared.update_s.clear()
        be.synchronize()
        t0 = time.perf_counter()
        for _ in range(opts.rounds):
            for i in used:
                shared.step(i)
        be.synchronize()
        step_ms = (time.perf_counter() - t0) * 1e3 / max(1, opts.rounds * len(used))
        return {"lever": UPDATE, "workload": workload,
                "graphs": len(usual_works), "executable_graphs": len(shared.execs), "groups": shared.groups(),
                "refused_updates": shared.refused, "replayed_graphs": len(used), "driver_why": why,
                "usual": {"driver": usual_driver, "replay_ms": usual_ms,
                          "capture_ms_per_graph": sum(c.capture_s for c in usual) * 1e3 / len(usual)},
                "update": {"driver_after_capture": after_capture, "driver": after_group,
                           "capture_ms_per_graph": sum(c.capture_s for c in sources) * 1e3 / len(sources),
                           "group_s": shared.group_s, "step_ms": step_ms,
                           "update_ms": statistics.mean(shared.update_s) * 1e3 if shared.update_s else None},
                "ratio": after_group / usual_driver if after_group is not None and usual_driver else None,
                "max_rel_error": err, "equal": bool(used) and err == 0.0}

    def lazy_lever(self, workload: str, usual_jobs: Sequence[list[Work]], lazy_jobs: Sequence[list[Work]], *,
                   used: Sequence[int], reset: Callable[[], Any], kept: Kept, pool: bool) -> dict[str, Any]:
        """The usual graphs of ``usual_jobs`` (a job: works captured one after the other), then the lazy ones of
        ``lazy_jobs``: the driver's memory after their captures, after replaying the jobs ``used`` (from
        ``reset()``), after replaying all; times; whether the used jobs' last outputs are equal."""
        be, opts = self.be, self.opts
        for works in usual_jobs:
            warm_up(be, self.stream, works)
        used = list(used)
        got: dict[bool, dict[str, Any]] = {}
        for lazy, jobs in ((False, usual_jobs), (True, lazy_jobs)):
            p = kept.pool(be) if pool else None
            before = self.meter.mark()
            caps = [capture_all(be, works, pool=p, stream=self.stream, lazy=lazy, inspect=False) for works in jobs]
            kept.captured += caps
            after_capture, why = self.meter.driver(before)
            reset()
            first = [t for i in used for t in replay_each_ms(be, caps[i].graphs)]
            after_used, _ = self.meter.driver(before)
            outs = [caps[i].outs[-1].clone() for i in used]
            for i in range(len(caps)):
                if i not in used:
                    replay_each_ms(be, caps[i].graphs)
            after_all, _ = self.meter.driver(before)
            graphs = [g for c in caps for g in c.graphs]
            got[lazy] = {"driver_after_capture": after_capture, "driver_after_used": after_used,
                         "driver_after_all": after_all, "driver_why": why,
                         "capture_ms_per_graph": sum(c.capture_s for c in caps) * 1e3 / len(graphs),
                         "first_replay_ms": statistics.mean(first) if first else None,
                         "replay_ms_per_graph": replay_ms(be, graphs, opts.rounds), "outs": outs,
                         "graphs": len(graphs)}
        usual, lazy_ = got[False], got[True]
        pairs = list(zip(lazy_.pop("outs"), usual.pop("outs"), strict=True))
        err = max((rel_error(a.float(), b.float()) for a, b in pairs), default=0.0)

        def ratio(key: str) -> float | None:  # lazy against the usual at the same point
            base = usual[key]
            return lazy_[key] / base if lazy_[key] is not None and base else None

        return {"lever": LAZY, "workload": workload,
                "graphs": usual["graphs"], "replayed_graphs": sum(len(usual_jobs[i]) for i in used),
                "usual": usual, "lazy": lazy_, "ratio_after_capture": ratio("driver_after_capture"),
                "ratio_after_used": ratio("driver_after_used"), "ratio_after_all": ratio("driver_after_all"),
                "max_rel_error": err, "equal": bool(pairs) and err == 0.0}

    # -- all

    def run(self) -> dict[str, Any]:
        """Every part of :attr:`Options.parts`, by name; ``left_out``: the parts this backend cannot measure."""
        out: dict[str, Any] = {"left_out": {}}
        for part in self.opts.parts:
            if part == "levers" and not self.be.supports("lazy_graphs"):
                out["left_out"][part] = f"{self.be.name} has no lazy graphs here (capability lazy_graphs)"
                log.warning("drivermem: levers left out: %s", out["left_out"][part])
                continue
            log.info("drivermem: measuring %s", part)
            out[part] = getattr(self, part)()
        return out


# -- output ---------------------------------------------------------------------------------------------------


def machine(be: hal.Backend) -> dict[str, Any]:
    """The device, its driver and the software, for the report's header."""
    info: dict[str, Any] = {"backend": be.name, "torch": torch.__version__, "python": sys.version.split()[0],
                            "device_memory_total": be.mem_info().total}
    dev = be.torch_device()
    if dev.type == "cuda":
        info["device_name"] = torch.cuda.get_device_name(dev)
        info["cuda_runtime"] = torch.version.cuda
        try:
            smi = subprocess.run(["nvidia-smi", f"--id={dev.index or 0}", "--query-gpu=driver_version",
                                  "--format=csv,noheader"], capture_output=True, text=True, timeout=20, check=True)
            info["driver"] = smi.stdout.strip()
        except (OSError, subprocess.SubprocessError) as exc:
            log.info("drivermem: no driver version from nvidia-smi: %s", exc)
    return info


def _b(value: float | None) -> str:
    return fmt_bytes(int(value)) if value is not None else "n/m"


def _r(value: float | None) -> str:
    return f"{value:.3f}" if value is not None else "-"


def _ms(value: float | None) -> str:
    return f"{value:.3f}" if value is not None else "-"


def _table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """A markdown table: the first column left-aligned, the others right-aligned."""
    rule = ["---"] + ["---:"] * (len(head) - 1)
    return [f"| {' | '.join(cells)} |" for cells in (head, rule, *rows)] + [""]


NODES_HEAD = ("nodes", "graphs", "driver", "per graph", "per node", "driver after replays", "capture ms/graph",
              "replay ms/graph")
VARIANTS_HEAD = ("sizes", "models", "pieces", "graphs", "nodes", "driver", "per graph", "per node",
                 "capture ms/graph")
LEVERS_HEAD = ("workload", "graphs", "replayed", "driver after capture, usual / lazy", "after replaying the used",
               "after replaying all", "ratio after capture", "ratio after the used", "ratio after all",
               "capture ms/graph usual / lazy", "first replay ms usual / lazy", "replay ms/graph usual / lazy", "equal")


UPDATE_HEAD = ("workload", "graphs", "executable graphs", "refused updates", "driver, usual / update", "ratio",
               "update: driver after the lazy captures", "capture ms/graph usual / lazy", "grouping s",
               "update ms", "replay ms usual / step ms (update + replay)", "equal")


def _update_row(r: dict[str, Any]) -> list[str]:
    u, up = r["usual"], r["update"]
    equal = "yes" if r["equal"] else f"NO (max rel err {r['max_rel_error']:.2e})"
    return [r["workload"], str(r["graphs"]), str(r["executable_graphs"]), str(r["refused_updates"]),
            f"{_b(u['driver'])} / {_b(up['driver'])}", _r(r["ratio"]), _b(up["driver_after_capture"]),
            f"{_ms(u['capture_ms_per_graph'])} / {_ms(up['capture_ms_per_graph'])}", _r(up["group_s"]),
            _ms(up["update_ms"]), f"{_ms(u['replay_ms'])} / {_ms(up['step_ms'])}", equal]


def _lever_row(r: dict[str, Any]) -> list[str]:
    u, lz = r["usual"], r["lazy"]

    def pair(key: str, show: Callable[[Any], str]) -> str:
        return f"{show(u[key])} / {show(lz[key])}"

    equal = "yes" if r["equal"] else f"NO (max rel err {r['max_rel_error']:.2e})"
    return [r["workload"], str(r["graphs"]), str(r["replayed_graphs"]), pair("driver_after_capture", _b),
            pair("driver_after_used", _b), pair("driver_after_all", _b), _r(r["ratio_after_capture"]),
            _r(r["ratio_after_used"]), _r(r["ratio_after_all"]), pair("capture_ms_per_graph", _ms),
            pair("first_replay_ms", _ms), pair("replay_ms_per_graph", _ms), equal]


def markdown(result: dict[str, Any]) -> str:
    """The sweep as markdown: a header (machine, driver, command), then one table per part."""
    m = result["machine"]
    device = (f"* device: {m.get('device_name', m['backend'])} (backend {m['backend']}), driver "
              f"{m.get('driver', '-')}, CUDA runtime {m.get('cuda_runtime', '-')}, torch {m['torch']}")
    lines = ["# The driver's memory of instantiated graphs", "", device, f"* command: `{result['command']}`",
             f"* when: {result['when']}", ""]
    if "nodes" in result:
        lines += ["## Nodes: graphs of N elementwise kernels", ""]
        lines += _table(NODES_HEAD, [
            [str(r["nodes"]), str(r["graphs"]), _b(r["driver_bytes"]), _b(r["per_graph_bytes"]),
             _b(r["per_node_bytes"]), _b(r["driver_after_replays_bytes"]), _ms(r["capture_ms_per_graph"]),
             _ms(r["replay_ms_per_graph"])] for r in result["nodes"]])
    if "variants" in result:
        lines += ["## Variants: sizes x models x pieces of the decoder's step", ""]
        lines += _table(VARIANTS_HEAD, [
            [str(r["sizes"]), str(r["models"]), str(r["pieces"]), str(r["graphs"]), str(r["nodes"] or "-"),
             _b(r["driver_bytes"]), _b(r["per_graph_bytes"]), _b(r["per_node_bytes"]),
             _ms(r["capture_ms_per_graph"])] for r in result["variants"]])
    lazy = [r for r in result.get("levers", []) if "lazy" in r]
    if lazy:
        lines += ["## Lever: lazy instantiation against instantiation at the capture's end", ""]
        lines += _table(LEVERS_HEAD, [_lever_row(r) for r in lazy])
    updates = [r for r in result.get("levers", []) if "update" in r]
    if updates:
        lines += ["## Lever: one executable graph per topology (update_graph) against one per capture", ""]
        lines += _table(UPDATE_HEAD, [_update_row(r) for r in updates])
    why = next((r["driver_why"] for part in ("nodes", "variants") for r in result.get(part, [])
                if r.get("driver_why")), None)
    if why:
        lines.append(f"n/m: {why}")
    for r in result.get("levers", []):
        if "error" in r:
            lines.append(f"{r['lever']} on {r['workload']}: not measured: {r['error']}")
    for part, reason in result.get("left_out", {}).items():
        lines.append(f"{part}: left out: {reason}")
    return "\n".join(lines) + "\n"


# -- CLI ------------------------------------------------------------------------------------------------------


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m graphkit_bench.graphmem sweep", description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default=None, help="hal backend (default: the best available)")
    p.add_argument("--out-dir", type=Path, required=True, help="where drivermem.md and drivermem.json go")
    p.add_argument("--parts", default="nodes,variants,levers", help="comma-separated: nodes, variants, levers")
    p.add_argument("--nodes", type=_ints, default=DEFAULT_NODES, help="kernels per graph, comma-separated")
    p.add_argument("--copies", type=int, default=8, help="graphs per node count (the growth is divided by it)")
    p.add_argument("--numel", type=int, default=1024, help="elements of the elementwise kernels' tensor")
    p.add_argument("--sizes", type=_ints, default=DEFAULT_SIZES, help="batch sizes of the decoder's variants")
    p.add_argument("--models", type=_ints, default=[1, 2], help="model counts, comma-separated")
    p.add_argument("--pieces", type=_ints, default=[1, 4], help="piece counts, comma-separated")
    p.add_argument("--lever-nodes", type=int, default=1000, help="kernels per graph of the levers' first workload")
    p.add_argument("--replayed", type=int, default=8, help="the levers' run uses the decoder's sizes up to this")
    p.add_argument("--rounds", type=int, default=20, help="replays of every graph for the replay time")
    p.add_argument("--config", choices=("reference", "tiny"), default=None,
                   help="decoder shape (default: reference on a GPU, tiny otherwise)")
    p.add_argument("--no-count-nodes", action="store_true", help="do not read the graphs' node counts")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--in-process", action="store_true",
                   help="measure every part in this process (by default each runs in a fresh one: the driver keeps "
                        "the memory of one part's graphs for reuse by the next)")
    return p


def options(args: argparse.Namespace, device_type: str) -> Options:
    parts = tuple(x.strip() for x in args.parts.split(",") if x.strip())
    return Options(nodes=args.nodes, copies=args.copies, numel=args.numel, sizes=args.sizes, models=args.models,
                   pieces=args.pieces, lever_nodes=args.lever_nodes, replayed=args.replayed, rounds=args.rounds,
                   config=args.config or ("reference" if device_type != "cpu" else "tiny"),
                   count_nodes=not args.no_count_nodes, progress=not args.no_progress, parts=parts)


def measure(args: argparse.Namespace, command: str) -> dict[str, Any]:
    """Every part asked for, in this process."""
    with hal.get_backend(args.backend, requires=("graphs",)) as be:
        opts = options(args, be.torch_device().type)
        result: dict[str, Any] = {
            "machine": machine(be), "options": dataclasses.asdict(opts), "command": command,
            "when": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "config": (DecoderConfig() if opts.config == "reference" else DecoderConfig.tiny()).as_dict()}
        result.update(Sweep(be, opts).run())
    return result


def measure_apart(argv: Sequence[str], parts: Sequence[str], out_dir: Path, command: str) -> dict[str, Any]:
    """Each part in a fresh process (its files under ``out_dir/parts/PART``), merged; a part whose process fails
    is left out, with its exit status."""
    merged: dict[str, Any] = {}
    failed: dict[str, str] = {}
    for part in parts:
        part_dir = out_dir / "parts" / part
        child = [sys.executable, "-m", "graphkit_bench.graphmem", "sweep", *argv, "--parts", part, "--in-process",
                 "--out-dir", str(part_dir)]
        done = subprocess.run(child, stdout=subprocess.DEVNULL, check=False)  # progress and errors go to stderr
        if done.returncode:
            failed[part] = f"its process exited with status {done.returncode} (its error is above)"
            log.error("drivermem: %s: %s", part, failed[part])
            continue
        result = json.loads((part_dir / "drivermem.json").read_text())
        if not merged:
            merged = result
        else:
            merged[part] = result[part]
            merged["left_out"].update(result["left_out"])
    if not merged:
        raise hal.HalError(f"every part failed: {failed}")
    merged["command"] = command
    merged["options"]["parts"] = list(parts)
    merged["left_out"].update(failed)
    return merged


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = parser()
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    counts = [*args.nodes, *args.sizes, *args.models, *args.pieces, args.copies, args.numel, args.lever_nodes,
              args.rounds]
    if not (args.nodes and args.sizes and args.models and args.pieces) or min(counts) < 1:
        p.error("--nodes, --sizes, --models, --pieces, --copies, --numel, --lever-nodes and --rounds need "
                "positive integers")
    parts = [x.strip() for x in args.parts.split(",") if x.strip()]
    unknown = set(parts) - {"nodes", "variants", "levers"}
    if unknown or not parts:
        p.error(f"--parts: unknown part(s) {', '.join(sorted(unknown))}; known: nodes, variants, levers")
    command = "python -m graphkit_bench.graphmem sweep " + shlex.join(argv)
    if args.in_process or len(parts) == 1:
        result = measure(args, command)
    else:
        result = measure_apart(argv, parts, args.out_dir, command)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    text = markdown(result)
    (args.out_dir / "drivermem.md").write_text(text)
    (args.out_dir / "drivermem.json").write_text(json.dumps(result, indent=2))
    print(text)
    return 1 if any("exited with status" in why for why in result["left_out"].values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
