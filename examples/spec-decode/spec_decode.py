"""Speculative decoding with a draft and a target decoder, each with its own capture loop, over one graph memory.

Both models are the engine of ``examples/engine-decode`` (imported from its
file), with different shapes and seeds: a small **draft** and a larger
**target** sharing a vocabulary. Each engine owns its capture loop (static
input buffers sized for its largest batch, one capture per batch size, the
outputs kept) over at least 8 batch sizes, counted in rows: a row is one
token of one sequence at one position.

One round, for every sequence of ``L`` tokens:

1. the draft proposes ``k`` tokens greedily in ``k`` steps; its first step
   feeds two rows per sequence (positions ``L-2`` and ``L-1``, so that its
   cache is whole again whatever the last round accepted), the next ones one;
2. the target verifies them in **one** step of ``k + 1`` rows per sequence:
   its static input buffer is filled from the draft's proposals on the
   device (``[t(L-1), d1, ..., dk]`` at positions ``L-1 .. L-1+k``); a row's
   k/v are written into the cache before attention reads it, so row ``j``
   sees the proposals before it;
3. the longest prefix of proposals equal to the target's own choices is
   accepted, plus the target's next token: 1 to ``k + 1`` new tokens.

The tokens are the target's greedy tokens, from graphs as from eager steps.

Graph memory of the two capture loops under four setups, in both capture
orders (``--order draft-first`` / ``target-first``):

* ``separate``: each engine's own pool (the engines' default);
* ``shared``: one pool for both models (vLLM's EAGLE drafter uses the
  target's pool), outputs kept;
* ``scope``: ``graphkit.graph_memory()`` around both capture loops;
* ``switch``: ``GRAPHKIT_GRAPH_MEMORY=1`` (``graphkit.switch``), no line changed.

Both engines read a graph's logits right after its own replay, so graphkit
is told ``outputs="replay"`` (``--outputs kept``, graphkit's default, gives
every capture's outputs memory of their own: survivors).

    python examples/spec-decode/spec_decode.py --backend fake --order draft-first
    python examples/spec-decode/spec_decode.py --backend fake --setup scope --setup shared
    python examples/spec-decode/spec_decode.py --backend cuda --config reference
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import logging
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

import graphkit
import graphkit.switch
import hal
from graphkit.graphs.capture import release_cached_memory
from hal.registry import select_backend_name
from hal.types import fmt_bytes

log = logging.getLogger("spec_decode")

ENGINE_PATH = Path(__file__).resolve().parents[1] / "engine-decode" / "engine.py"
SETUPS = ("separate", "shared", "scope", "switch")
#: graphkit's ``outputs=``: these engines read a graph's logits right after its own replay (``replay``); ``kept``
#: (graphkit's default) gives what a capture leaves allocated memory of its own
OUTPUTS = ("replay", "kept")
ORDERS = ("draft-first", "target-first")
#: the fake device's granule: the switch's pools take the backend's default, so every setup does
FAKE_OPTIONS: dict[str, Any] = {}


def load_engine_module() -> ModuleType:
    """The engine of ``examples/engine-decode``, imported from its file."""
    name = "spec_decode_engine_decode"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ENGINE_PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


engine_decode = load_engine_module()
ModelConfig = engine_decode.ModelConfig

#: (draft, target) per name. ``tiny`` runs on a CPU in seconds; its vocabulary is large enough that the
#: logits span several of the fake device's 2 MiB granules. ``reference``: a Qwen3-0.6B-shaped target.
CONFIGS: dict[str, tuple[Any, Any]] = {
    "tiny": (ModelConfig(hidden=64, layers=1, heads=4, kv_heads=2, head_dim=16, mlp=128, vocab=32768,
                         dtype="float32"),
             ModelConfig(hidden=128, layers=3, heads=4, kv_heads=2, head_dim=32, mlp=384, vocab=32768,
                         dtype="float32")),
    "reference": (ModelConfig(hidden=512, layers=4, heads=8, kv_heads=4, head_dim=64, mlp=1536),
                  ModelConfig()),
}


def spread(largest: int, count: int = 8) -> list[int]:
    """``count`` batch sizes (fewer only when ``largest < count``) spread evenly up to ``largest``."""
    return sorted({max(1, round(largest * i / count)) for i in range(1, count + 1)})


@dataclass
class SpecOutput:
    """What :meth:`SpecDecoder.generate` produced."""

    tokens: list[list[int]]
    rounds: int = 0
    proposed: int = 0  # draft tokens proposed
    accepted: int = 0  # of those, accepted
    draft_steps: int = 0
    target_steps: int = 0
    logits: list[torch.Tensor] = field(default_factory=list)  # the target's logits of every verify step

    @property
    def acceptance(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0


def accept(proposals: Sequence[int], choices: Sequence[int]) -> list[int]:
    """The tokens a round adds: the longest prefix of ``proposals`` equal to ``choices`` (the target's token
    after each position), then the target's choice after it."""
    if len(choices) != len(proposals) + 1:
        raise hal.InvalidArgumentError(f"{len(proposals)} proposals need {len(proposals) + 1} choices, got "
                                       f"{len(choices)}", call="accept")
    m = 0
    while m < len(proposals) and proposals[m] == choices[m]:
        m += 1
    return [*proposals[:m], choices[m]]


class SpecDecoder:
    """A draft and a target engine, each with its own capture loop and static buffers.

    :param max_seqs: sequences per round at most. The draft's largest batch is ``2 * max_seqs`` rows (its
        first step of a round), the target's ``(k + 1) * max_seqs``.
    :param k: tokens the draft proposes per round.
    :param draft_sizes, target_sizes: batch sizes (rows) each loop captures; default 8 spread up to the largest.
    :param draft_config, draft_seed: another draft (default: the config's, seeded ``seed + 1``; the target is
        seeded ``seed + 2``). The target's own config and seed make a draft that is always right.
    """

    def __init__(self, backend: hal.Backend, config: str = "tiny", *, max_seqs: int = 4, k: int = 3,
                 max_model_len: int = 64, seed: int = 0, draft_sizes: Sequence[int] | None = None,
                 target_sizes: Sequence[int] | None = None, draft_config: Any = None,
                 draft_seed: int | None = None) -> None:
        if config not in CONFIGS:
            raise hal.InvalidArgumentError(f"config={config!r} must be one of {sorted(CONFIGS)}",
                                           backend=backend.name, call="SpecDecoder")
        if not isinstance(k, int) or k < 1 or not isinstance(max_seqs, int) or max_seqs < 1:
            raise hal.InvalidArgumentError(f"k={k!r} and max_seqs={max_seqs!r} must be ints >= 1",
                                           backend=backend.name, call="SpecDecoder")
        draft_cfg, target_cfg = CONFIGS[config]
        self.backend, self.k, self.max_seqs = backend, k, max_seqs
        self.draft_sizes = sorted(set(draft_sizes or spread(2 * max_seqs)))
        self.target_sizes = sorted(set(target_sizes or spread((k + 1) * max_seqs)))
        self.draft = engine_decode.Engine(backend, draft_config or draft_cfg, max_batch=max(self.draft_sizes),
                                          max_model_len=max_model_len,
                                          seed=seed + 1 if draft_seed is None else draft_seed)
        self.target = engine_decode.Engine(backend, target_cfg, max_batch=max(self.target_sizes),
                                           max_model_len=max_model_len, seed=seed + 2)

    # -- capture ---------------------------------------------------------------------------

    def loops(self, order: str) -> list[tuple[str, Any, list[int]]]:
        """``(name, engine, sizes)`` of both capture loops in ``order``."""
        if order not in ORDERS:
            raise hal.InvalidArgumentError(f"order={order!r} must be one of {ORDERS}", backend=self.backend.name,
                                           call="SpecDecoder")
        both = [("draft", self.draft, self.draft_sizes), ("target", self.target, self.target_sizes)]
        return both if order == "draft-first" else both[::-1]

    def capture(self, order: str, one_pool: bool = False) -> float:
        """Run both engines' capture loops (each largest size first) in ``order``; return the capture seconds.

        :param one_pool: the second engine captures into the first one's pool (vLLM's EAGLE drafter).
        """
        seconds = 0.0
        first: Any = None
        for _, engine, sizes in self.loops(order):
            if one_pool and first is not None:
                engine.graph_pool = first.graph_pool  # made by the first engine's first capture
            seconds += engine.capture_graphs(sizes)
            first = first or engine
        return seconds

    def graphs(self) -> int:
        return len(self.draft.graphs) + len(self.target.graphs)

    def close(self) -> None:
        """Graphs first, then the pools (a pool the draft borrowed from the target, or the other way, once)."""
        if self.draft.graph_pool is not None and self.draft.graph_pool is self.target.graph_pool:
            shared, self.draft.graph_pool = self.draft.graph_pool, None
            self.draft.close()
            self.target.close()  # releases the shared pool after the draft's graphs are gone
            assert self.target.graph_pool is None or self.target.graph_pool is not shared
            return
        self.draft.close()
        self.target.close()

    # -- decoding --------------------------------------------------------------------------

    def _step(self, engine: Any, ids: torch.Tensor, positions: torch.Tensor, tables: torch.Tensor,
              use_graphs: bool) -> torch.Tensor:
        """The argmax of one step's logits per row (valid after the next replay: a new tensor)."""
        batch = engine.decode_batch(ids, positions, tables)
        return engine.step(batch, replay=use_graphs).argmax(dim=-1)

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], steps: int, use_graphs: bool = True,
                 keep_logits: bool = False) -> SpecOutput:
        """``steps`` new tokens per prompt by speculative rounds; ``use_graphs=False`` runs every step eagerly
        on exactly the rows a graph would see (padded as its batch size), for comparison."""
        n, k, dev = len(prompts), self.k, self.draft.device
        if not 0 < n <= self.max_seqs or min(len(p) for p in prompts) < 2 or steps < 1:
            raise hal.InvalidArgumentError(f"need 1..{self.max_seqs} prompts of 2 tokens or more and steps >= 1",
                                           backend=self.backend.name, call="SpecDecoder.generate")
        longest = max(len(p) for p in prompts) + steps + k + 1
        tables = {e: e.block_tables_for(n, longest) for e in (self.draft, self.target)}
        seqs = [list(p) for p in prompts]
        out = SpecOutput([])
        # prefill: every prompt token but the last, through both models, one row per token (eager above
        # the largest graph, in both runs alike)
        rows = [(s, p) for s in range(n) for p in range(len(seqs[s]) - 1)]
        ids = torch.tensor([seqs[s][p] for s, p in rows], device=dev)
        pos = torch.tensor([p for _, p in rows], device=dev)
        which = torch.tensor([s for s, _ in rows], device=dev)
        for engine in (self.draft, self.target):
            self._step(engine, ids, pos, tables[engine][which], use_graphs)
        while True:
            active = [s for s in range(n) if len(seqs[s]) - len(prompts[s]) < steps]
            if not active:
                break
            a = torch.tensor(active, device=dev)
            last = torch.tensor([seqs[s][-1] for s in active], device=dev)
            ends = torch.tensor([len(seqs[s]) - 1 for s in active], device=dev)  # position of the last token
            # the draft: two rows per sequence first (its cache is whole whatever the last round accepted)
            before = torch.tensor([seqs[s][-2] for s in active], device=dev)
            two = torch.stack((before, last), 1).flatten()
            two_pos = torch.stack((ends - 1, ends), 1).flatten()
            chosen = self._step(self.draft, two, two_pos, tables[self.draft][a].repeat_interleave(2, 0), use_graphs)
            proposals = [chosen[1::2]]
            for j in range(1, k):
                proposals.append(self._step(self.draft, proposals[-1], ends + j, tables[self.draft][a], use_graphs))
            # the target verifies all k in one step: its inputs are the draft's proposals, on the device
            verify_ids = torch.stack((last, *proposals), 1).flatten()
            verify_pos = (ends[:, None] + torch.arange(k + 1, device=dev)[None, :]).flatten()
            batch = self.target.decode_batch(verify_ids, verify_pos, tables[self.target][a].repeat_interleave(k + 1, 0))
            logits = self.target.step(batch, replay=use_graphs)
            if keep_logits:
                out.logits.append(logits.clone())
            choices = logits.argmax(dim=-1).view(len(active), k + 1).tolist()
            drafted = torch.stack(proposals, 1).tolist()
            for s, d, c in zip(active, drafted, choices, strict=True):
                new = accept(d, c)
                seqs[s] += new
                out.accepted += len(new) - 1
            out.proposed += k * len(active)
            out.rounds += 1
            out.draft_steps += k
            out.target_steps += 1
        out.tokens = [s[len(p):len(p) + steps] for s, p in zip(seqs, prompts, strict=True)]
        return out


# -- memory setups -------------------------------------------------------------------------------


def used(be: hal.Backend) -> int:
    """The device's used memory, the framework's cache emptied."""
    release_cached_memory(be)
    be.synchronize()
    return be.mem_info().used


def reserved(be: hal.Backend) -> int | None:
    """What the framework's allocator holds on the device (its pools' segments); None on a host device."""
    device = be.torch_device()
    module = getattr(torch, device.type, None)
    if device.type == "cpu" or not hasattr(module, "memory_reserved"):
        return None
    return int(module.memory_reserved(device))


@contextlib.contextmanager
def setup_scope(be: hal.Backend, setup: str, outputs: str = "replay") -> Iterator[dict[str, Any]]:
    """Around both capture loops: what ``setup`` puts there (``outputs``: graphkit's, for scope and switch).
    Yields a dict that gets ``pools`` (the :class:`graphkit.GraphPools` the captures drew from, for scope and
    switch)."""
    held: dict[str, Any] = {"pools": None}
    if setup in ("separate", "shared"):
        yield held
    elif setup == "scope":
        with graphkit.graph_memory(be, outputs=outputs) as pools:
            held["pools"] = pools
            yield held
    elif setup == "switch":
        started = graphkit.switch.active() is None  # GRAPHKIT_GRAPH_MEMORY=1 may have started it already
        options = graphkit.switch.Options(outputs=outputs, report=0)
        scope = graphkit.switch.start(options) if started else graphkit.switch.active()
        assert scope is not None
        try:
            yield held
        finally:
            held["pools"] = scope.pools.get((be.name, be.device))
            held["stop"] = started
            if started:
                graphkit.switch.stop()  # new captures are left alone; these graphs keep their memory
    else:
        raise hal.InvalidArgumentError(f"setup={setup!r} must be one of {SETUPS}", backend=be.name,
                                       call="setup_scope")


def run_setup(be: hal.Backend, setup: str, order: str, config: str = "tiny", *, max_seqs: int = 4, k: int = 3,
              steps: int = 6, seed: int = 0, outputs: str = "replay") -> dict[str, Any]:
    """Capture both loops under ``setup`` in ``order``, decode with graphs and eagerly; the figures.

    ``graph_bytes`` is the device's used-memory growth over both capture loops; ``pool_bytes`` what the
    pools hold (chunk bytes for graphkit; the framework's reserved growth for its own pools on a GPU, the
    device growth on a host device, where pools are all there is); ``driver_bytes`` the difference on a
    device with a driver (None on a host device: graphs keep no driver memory there); ``survivor_bytes``
    graphkit's memory of their own for what captures left allocated (``outputs="kept"``).
    """
    spec = SpecDecoder(be, config, max_seqs=max_seqs, k=k, seed=seed)
    held: dict[str, Any] = {"pools": None}
    try:
        before, reserved0 = used(be), reserved(be)
        t0 = time.perf_counter()
        with setup_scope(be, setup, outputs) as held:
            seconds = spec.capture(order, one_pool=setup == "shared")
        wall = time.perf_counter() - t0
        graph_bytes = used(be) - before
        pools = held["pools"]
        report = pools.report() if pools is not None else None
        reserved1 = reserved(be)
        if report is not None:
            pool_bytes = report.chunk_bytes
            if setup == "switch" and be.torch_device().type == "cpu":
                graph_bytes = report.device_bytes or 0  # the switch's pools are on a fake device of their own
        elif reserved0 is not None and reserved1 is not None:
            pool_bytes = reserved1 - reserved0
        else:
            pool_bytes = graph_bytes
        driver = None if be.torch_device().type == "cpu" else graph_bytes - pool_bytes
        prompts = example_prompts(max_seqs, spec.target.cfg.vocab, seed)
        got = spec.generate(prompts, steps)
        eager = spec.generate(prompts, steps, use_graphs=False)
        greedy = spec.target.generate(prompts, steps, use_graphs=False, keep_logits=False).tokens
        result = {
            "setup": setup, "order": order, "config": config, "graphs": spec.graphs(),
            "draft_sizes": spec.draft_sizes, "target_sizes": spec.target_sizes,
            "graph_bytes": graph_bytes, "pool_bytes": pool_bytes, "driver_bytes": driver,
            "kind": report.kind if report is not None else "own",
            "outputs": outputs if report is not None else None,
            "survivor_bytes": pools.allocator.survivor_bytes if pools is not None and pools.allocator else 0,
            "capture_seconds": seconds, "capture_wall_seconds": wall,
            "tokens": got.tokens, "tokens_equal_eager": got.tokens == eager.tokens,
            "tokens_equal_greedy_target": got.tokens == greedy,
            "acceptance": got.acceptance, "rounds": got.rounds,
        }
    finally:
        spec.close()
        pools = held.get("pools")
        if pools is not None and (setup == "scope" or held.get("stop")):
            pools.close()  # the graphs are gone; the switch's pools are this run's when it started the switch
    return result


def run_alone(be: hal.Backend, model: str, config: str = "tiny", *, max_seqs: int = 4, k: int = 3,
              seed: int = 0, outputs: str = "replay") -> dict[str, int]:
    """One model's capture loop alone under ``graphkit.graph_memory``: its chunk bytes (``pool_bytes``, survivors
    included) and the survivors' (``survivor_bytes``)."""
    spec = SpecDecoder(be, config, max_seqs=max_seqs, k=k, seed=seed)
    engine, sizes = (spec.draft, spec.draft_sizes) if model == "draft" else (spec.target, spec.target_sizes)
    try:
        with graphkit.graph_memory(be, outputs=outputs) as pools:
            engine.capture_graphs(sizes)
        assert pools.allocator is not None
        return {"pool_bytes": pools.report().chunk_bytes, "survivor_bytes": pools.allocator.survivor_bytes}
    finally:
        spec.close()
        pools.close()


def example_prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (2 + i % 3,), generator=gen).tolist() for i in range(n)]


def judge(results: list[dict[str, Any]], alone: dict[str, dict[str, int]]) -> list[str]:
    """The issue's targets where they can be judged: graphkit's graph memory (scope, switch) at most the larger
    model's alone plus the other model's survivors (memory of their own for what its captures left allocated),
    and below one shared pool, per order. ``alone``: :func:`run_alone` of each model, with the same ``outputs``."""
    lines = []
    larger = max(alone, key=lambda m: alone[m]["pool_bytes"])
    other = "draft" if larger == "target" else "target"
    by = {(r["setup"], r["order"]): r for r in results}
    for (setup, order), r in sorted(by.items()):
        if setup not in ("scope", "switch"):
            continue
        base, kept = alone[larger]["pool_bytes"], alone[other]["survivor_bytes"]
        ok = r["pool_bytes"] <= base + kept
        lines.append(f"{setup}/{order}: {fmt_bytes(r['pool_bytes'])} <= {larger} alone {fmt_bytes(base)} + {other}'s "
                     f"survivors {fmt_bytes(kept)}: {'met' if ok else 'MISSED'}")
        shared = by.get(("shared", order))
        if shared is not None:
            below = r["graph_bytes"] < shared["graph_bytes"]
            lines.append(f"{setup}/{order}: {fmt_bytes(r['graph_bytes'])} below one shared pool "
                         f"{fmt_bytes(shared['graph_bytes'])}: {'met' if below else 'MISSED'}")
    return lines


def table(results: list[dict[str, Any]], alone: dict[str, dict[str, int]]) -> str:
    lines = [(f"{'setup':<9} {'order':<13} {'graphs':>6} {'graph memory':>13} {'pool/chunks':>12} "
              f"{'driver':>10} {'capture s':>9}  tokens = eager  = greedy target  acceptance")]
    for r in results:
        driver = fmt_bytes(r["driver_bytes"]) if r["driver_bytes"] is not None else "n/m"
        lines.append(f"{r['setup']:<9} {r['order']:<13} {r['graphs']:>6} {fmt_bytes(r['graph_bytes']):>13} "
                     f"{fmt_bytes(r['pool_bytes']):>12} {driver:>10} {r['capture_seconds']:>9.3f}  "
                     f"{'yes' if r['tokens_equal_eager'] else 'NO':<14}  "
                     f"{'yes' if r['tokens_equal_greedy_target'] else 'no':<15}  {r['acceptance']:.2f}")
    lines.append("alone under graph_memory: " + ", ".join(
        f"{m} {fmt_bytes(a['pool_bytes'])} (survivors {fmt_bytes(a['survivor_bytes'])})" for m, a in alone.items()))
    if any(r["driver_bytes"] is None for r in results):
        lines.append("n/m: not measured: the device is the host, whose graphs keep no driver memory")
    return "\n".join(lines)


def _in_fresh_processes(backend: str, pairs: list[tuple[str, str]], args: argparse.Namespace) -> dict[str, Any]:
    """Each (setup, order) in a process of its own, then both models alone in one more; their figures together.
    Raises RuntimeError naming the part whose process failed."""
    common = ["--backend", backend, "-k", str(args.k), "--max-seqs", str(args.max_seqs), "--steps", str(args.steps),
              "--outputs", args.outputs] + (["--config", args.config] if args.config else [])
    parts = [(f"{setup}/{order}", ["--only", "pairs", "--setup", setup, "--order", order]) for setup, order in pairs]
    parts.append(("draft and target alone", ["--only", "alone"]))
    figures: dict[str, Any] = {"results": [], "alone": {}}
    for label, extra in parts:
        proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), *common, *extra], capture_output=True,
                              text=True, timeout=900)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        if not lines:
            raise RuntimeError(f"{label}: its process exited {proc.returncode} without figures: "
                               f"{(proc.stdout + proc.stderr).strip()[-600:]}")
        part = json.loads(lines[-1])
        figures["results"] += part["results"]
        figures["alone"].update(part["alone"])
    return figures


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default=None, help="hal backend (default: the best available)")
    parser.add_argument("--setup", action="append", choices=SETUPS, default=None,
                        help="memory setup (repeat it; default: all four)")
    parser.add_argument("--order", action="append", choices=ORDERS, default=None,
                        help="which loop captures first (repeat it; default: both)")
    parser.add_argument("--config", choices=sorted(CONFIGS), default=None,
                        help="model sizes (default: reference on a GPU, tiny otherwise)")
    parser.add_argument("--max-seqs", type=int, default=4)
    parser.add_argument("-k", type=int, default=3, help="tokens the draft proposes per round")
    parser.add_argument("--steps", type=int, default=6, help="new tokens per sequence")
    parser.add_argument("--outputs", choices=OUTPUTS, default="replay",
                        help="graphkit's outputs= for scope and switch: replay (these engines read a graph's logits "
                             "right after its own replay) or kept (graphkit's default: what a capture leaves "
                             "allocated gets memory of its own)")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    parser.add_argument("--fresh-processes", choices=("auto", "yes", "no"), default="auto",
                        help="measure each setup and order in a process of its own (auto: on a device, whose driver "
                             "keeps the memory of released graphs for the next setup of the same process)")
    parser.add_argument("--only", choices=("pairs", "alone"), default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    if graphkit.switch.active() is not None and set(args.setup or SETUPS) - {"switch"}:
        print("error: GRAPHKIT_GRAPH_MEMORY is set: the switch serves every capture of this process, so the other "
              "setups cannot be measured; unset it, or pass --setup switch")
        return 2
    name = select_backend_name(args.backend, requires=("graphs",))
    pairs = [(setup, order) for order in args.order or ORDERS for setup in args.setup or SETUPS]
    if args.only is None and (args.fresh_processes == "yes" or (args.fresh_processes == "auto" and name != "fake")):
        try:
            figures = _in_fresh_processes(name, pairs, args)
        except RuntimeError as exc:
            print(f"error: {exc}")
            return 2
        results, alone = figures["results"], figures["alone"]
        config = results[0]["config"]
    else:
        be = hal.get_backend(name, **(FAKE_OPTIONS if name == "fake" else {}))
        try:
            config = args.config or ("reference" if be.torch_device().type == "cuda" else "tiny")
            options = {"max_seqs": args.max_seqs, "k": args.k, "outputs": args.outputs}
            results = ([run_setup(be, setup, order, config, steps=args.steps, **options) for setup, order in pairs]
                       if args.only != "alone" else [])
            alone = ({m: run_alone(be, m, config, **options) for m in ("draft", "target")}
                     if args.only != "pairs" else {})
        except hal.HalError as exc:
            print(f"error: {exc}")
            return 2
        finally:
            be.close()
    if args.only is not None:
        print(json.dumps({"results": results, "alone": alone}))
        return 0 if all(r["tokens_equal_eager"] for r in results) else 1
    if args.json:
        print(json.dumps({"results": results, "alone": alone, "targets": judge(results, alone)}))
    else:
        print(f"{name}, config {config}: draft sizes {results[0]['draft_sizes']}, "
              f"target sizes {results[0]['target_sizes']}; graphkit's outputs={args.outputs}")
        print(table(results, alone))
        print(f"tokens: {results[0]['tokens']}")
        for line in judge(results, alone):
            print(line)
    ok = all(r["tokens_equal_eager"] for r in results)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
