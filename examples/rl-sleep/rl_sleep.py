"""An RL loop on one device: rollout in graphs, the engine asleep while a trainer step runs, new weights on wake.

The engine is the decode loop of ``examples/engine-decode`` (loaded from its
file): its weights live in a :class:`graphkit.MemorySaver` region with a
backup, its KV cache in a region without one, its graphs in
``graphkit.GraphPools(be, saver=saver)``. Each step of the loop:

1. **rollout**: greedy decoding of a batch of prompts, every step a graph replay;
2. **pause**: every tag (weights backed up to the host, the KV cache and the
   graphs' memory released);
3. **train**: a stand-in trainer moves its own copy of the weights to the device,
   takes the rest of the memory the engine gave back for its activations, and
   makes new weights (an update drawn from a seeded generator);
4. **wake**: the weights first, the new weights copied into the engine's weight
   tensors in place (the addresses the graphs hold), then the KV cache (cleared:
   it wakes without content) and the graphs;
5. **check**: a graph replay against the eager step on the same inputs, bit-exact.

Figures: the first and the steady (median, min-max of the later steps) pause
and resume, the weight load, the trainer's peak device memory, and the memory
held while asleep. With ``--impls graphkit,tms`` on CUDA the same loop runs with
torch_memory_saver (weights and KV cache in its regions; the graphs stay in the
engine's own pool, which it does not put to sleep), each in a fresh process.

    python examples/rl-sleep/rl_sleep.py --backend fake
    python examples/rl-sleep/rl_sleep.py --backend cuda --steps 5 --max-model-len 1024
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import json
import logging
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

import graphkit
import hal
from graphkit.graphs.capture import release_cached_memory
from graphkit_bench.elastic import device_empty
from graphkit_bench.fair import fmt_spread, interleaved, spread
from hal.registry import select_backend_name
from hal.types import fmt_bytes, round_up

log = logging.getLogger("rl_sleep")

ENGINE_PATH = Path(__file__).resolve().parents[1] / "engine-decode" / "engine.py"
IMPLS = ("graphkit", "tms")
FAKE_OPTIONS = {"granularity": 1 << 16}
#: what the trainer leaves of the memory the engine gave back, for the framework's rounding (a GPU)
DEVICE_SLACK = 256 << 20
#: the first pause of a process at most this many times its steady pauses
FIRST_PAUSE_RATIO = 1.2


def load_engine_module() -> ModuleType:
    """The engine of ``examples/engine-decode``, imported from its file."""
    name = "rl_sleep_engine_decode"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ENGINE_PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


def engine_weights(engine: Any) -> list[torch.Tensor]:
    """Every weight tensor of the engine, in a fixed order (what a weight update writes)."""
    return [engine.embed, engine.norm, *(p[k] for p in engine.layers for k in sorted(p))]


# -- sleep, one interface over graphkit and torch_memory_saver -------------------------------------------


class Sleeper:
    """Where the engine's memory lives and how it sleeps: regions for its parts, pause, a staged wake."""

    name = ""

    def region(self, part: str) -> AbstractContextManager[Any]:
        raise NotImplementedError

    def pools(self, be: hal.Backend) -> graphkit.GraphPools | None:
        """Pools for the graphs, or None for the engine's own pool."""
        return None

    def pause(self) -> None:
        raise NotImplementedError

    def wake_weights(self) -> None:
        raise NotImplementedError

    def wake_rest(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


class GraphkitSleeper(Sleeper):
    """A :class:`graphkit.MemorySaver`: weights backed up, the KV cache not (unless ``kv_backup``), the graphs'
    memory asleep too."""

    name = "graphkit"

    def __init__(self, be: hal.Backend, kv_backup: bool = False) -> None:
        self.saver = graphkit.MemorySaver(be)
        self.backed_up = {"weights", "kv_cache"} if kv_backup else {"weights"}

    def region(self, part: str) -> AbstractContextManager[Any]:
        return self.saver.region(part, backup=part in self.backed_up)

    def pools(self, be: hal.Backend) -> graphkit.GraphPools:
        return graphkit.GraphPools(be, saver=self.saver)

    def pause(self) -> None:
        self.saver.pause()

    def wake_weights(self) -> None:
        # the memory comes back at the same addresses without its backup: the new weights overwrite it next
        self.saver.resume("weights", restore=False)

    def wake_rest(self) -> None:
        self.saver.resume()

    def close(self) -> None:
        self.saver.close()


class TmsSleeper(Sleeper):
    """torch_memory_saver: weights with a CPU backup, the KV cache without (unless ``kv_backup``); graphs stay in
    the engine's pool."""

    name = "tms"

    def __init__(self, be: hal.Backend, kv_backup: bool = False) -> None:
        from torch_memory_saver import torch_memory_saver as tms

        from graphkit_bench.sleep import _tms_in_process

        _tms_in_process(tms)
        self.tms = tms
        self.backed_up = {"weights", "kv_cache"} if kv_backup else {"weights"}

    def region(self, part: str) -> AbstractContextManager[Any]:
        return self.tms.region(tag=part, enable_cpu_backup=part in self.backed_up)

    def pause(self) -> None:
        self.tms.pause()

    def wake_weights(self) -> None:
        self.tms.resume("weights")

    def wake_rest(self) -> None:
        self.tms.resume("kv_cache")  # torch_memory_saver refuses to resume a tag that is awake already


def tms_missing(be: hal.Backend) -> str | None:
    """Why torch_memory_saver cannot run here, or None."""
    if be.torch_device().type != "cuda":
        return "torch_memory_saver needs CUDA"
    if importlib.util.find_spec("torch_memory_saver") is None:
        return "torch_memory_saver is not installed (pip install torch_memory_saver)"
    return None


# -- the stand-in trainer ----------------------------------------------------------------------------------


def device_tensor(be: hal.Backend, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised tensor in device memory (a driver allocation of its own on ``fake``)."""
    if be.torch_device().type != "cpu":
        return torch.empty(tuple(shape), dtype=dtype, device=be.torch_device())
    nbytes = max(1, torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
    return device_empty(be, nbytes).view(dtype)[: torch.Size(shape).numel()].view(tuple(shape))


class Trainer:
    """Holds its own copy of the weights on the host; a step runs on the device in the memory the engine gave
    back and returns new weights on the host."""

    def __init__(self, be: hal.Backend, weights: list[torch.Tensor], lr: float = 1e-2, seed: int = 0) -> None:
        self.be, self.lr, self.seed = be, lr, seed
        pin = be.torch_device().type != "cpu"
        self.host = [w.detach().to("cpu", copy=True) for w in weights]
        if pin:
            self.host = [h.pin_memory() for h in self.host]

    def _device_bytes(self, t: torch.Tensor) -> int:
        nbytes = t.numel() * t.element_size()
        return round_up(nbytes, self.be.granularity) if self.be.torch_device().type == "cpu" else nbytes

    def step(self, step: int, budget: int) -> dict[str, Any]:
        """One update: weights to the device, ``budget`` bytes taken in all (weights and activations), new
        weights back on the host. Returns its seconds and its peak device memory above the start."""
        be = self.be
        be.synchronize()
        base = be.mem_info().used
        t0 = time.perf_counter()
        weights = []
        for h in self.host:
            w = device_tensor(be, h.shape, h.dtype)
            w.copy_(h, non_blocking=True)
            weights.append(w)
        held = sum(self._device_bytes(w) for w in weights)
        slack = DEVICE_SLACK if be.torch_device().type != "cpu" else 0
        activations = None  # forward and backward: the rest of the budget, really used, not only reserved
        if budget - held - slack > 0:
            activations = device_empty(be, budget - held - slack)
            activations.fill_(1)
        be.synchronize()
        peak = be.mem_info().used - base
        del activations  # freed before the optimizer step, as a trainer frees its activations
        gen = torch.Generator(device=weights[0].device).manual_seed(self.seed * 100_003 + step)
        for w, h in zip(weights, self.host, strict=True):
            w.add_(torch.randn(w.shape, generator=gen, device=w.device, dtype=w.dtype), alpha=self.lr)
            h.copy_(w, non_blocking=True)
        be.synchronize()
        seconds = time.perf_counter() - t0
        del weights
        gc.collect()
        release_cached_memory(be)
        return {"seconds": seconds, "peak_bytes": peak, "activation_bytes": max(0, budget - held - slack)}


# -- the loop --------------------------------------------------------------------------------------------


def _timed(be: hal.Backend, fn: Callable[[], Any]) -> float:
    be.synchronize()
    t0 = time.perf_counter()
    fn()
    be.synchronize()
    return time.perf_counter() - t0


def _used(be: hal.Backend) -> int:
    gc.collect()
    release_cached_memory(be)
    be.synchronize()
    return be.mem_info().used


def _prompts(n: int, vocab: int, step: int) -> list[list[int]]:
    return [[(7 * i + 13 * step + j) % vocab for j in range(2 + i % 3)] for i in range(n)]


def _run_steps(be: hal.Backend, engine: Any, sleeper: Sleeper, steps: int, sizes: Sequence[int],
               rollout_steps: int, seed: int, base: int) -> tuple[int, list[dict[str, Any]]]:
    """Capture, then the RL steps; the engine's awake footprint and one row of figures per step."""
    rows: list[dict[str, Any]] = []
    engine.capture_graphs(sizes)
    weights = engine_weights(engine)
    addresses = [w.data_ptr() for w in weights]
    trainer = Trainer(be, weights, seed=seed)
    awake = _used(be) - base
    for step in range(steps):
        rollout = engine.generate(_prompts(min(3, max(sizes)), engine.cfg.vocab, step), rollout_steps,
                                  keep_logits=False)
        before = _used(be)
        pause_s = _timed(be, sleeper.pause)
        asleep = _used(be) - base
        released = before - _used(be)
        train = trainer.step(step, released)
        wake_weights_s = _timed(be, sleeper.wake_weights)
        changed = not all(torch.equal(w.cpu(), h) for w, h in zip(weights, trainer.host, strict=True))
        load_s = _timed(be, lambda: [w.copy_(h, non_blocking=True)
                                     for w, h in zip(weights, trainer.host, strict=True)])
        wake_rest_s = _timed(be, sleeper.wake_rest)
        # the KV cache wakes without content; this attention reads whole blocks and masks, so it is cleared
        clear_s = _timed(be, lambda: [t.zero_() for t in (*engine.k_cache, *engine.v_cache)])
        batch = engine.example_batch(max(sizes), seed=step)
        graph_logits = engine.step(batch).clone()
        eager_logits = engine.step(batch, replay=False).clone()
        rows.append({
            "step": step, "rollout_tokens": rollout.tokens, "pause_s": pause_s,
            "resume_s": wake_weights_s + wake_rest_s, "resume_weights_s": wake_weights_s,
            "resume_rest_s": wake_rest_s, "load_weights_s": load_s, "clear_kv_s": clear_s,
            "released_bytes": released, "asleep_bytes": asleep, "trainer_s": train["seconds"],
            "trainer_peak_bytes": train["peak_bytes"],
            "replay_exact": bool(torch.equal(graph_logits, eager_logits)),
            "replay_max_abs_diff": float((graph_logits.float() - eager_logits.float()).abs().max()),
            "weights_loaded": all(torch.equal(w.cpu(), h) for w, h in zip(weights, trainer.host, strict=True)),
            "weights_in_place": [w.data_ptr() for w in weights] == addresses, "weights_changed": changed,
        })
        log.info("step %d: pause %.1f ms, resume %.1f ms, replay %s", step, pause_s * 1e3,
                 (wake_weights_s + wake_rest_s) * 1e3, "exact" if rows[-1]["replay_exact"] else "DIFFERENT")
    return awake, rows


def rl_loop(be: hal.Backend, impl: str = "graphkit", config: str = "tiny", steps: int = 2,
            sizes: Sequence[int] = (1, 2, 4, 8), max_model_len: int = 32, rollout_steps: int = 4,
            seed: int = 0, kv_backup: bool = False) -> dict[str, Any]:
    """Capture, then ``steps`` rounds of rollout, pause, train, wake with new weights, check; the figures.

    :param kv_backup: back the KV cache up too (its pause copies it to the host, its wake copies it back).
    """
    if impl not in IMPLS:
        raise hal.InvalidArgumentError(f"impl={impl!r} must be one of {', '.join(IMPLS)}", backend=be.name,
                                       call="rl_loop")
    if impl == "tms":
        why = tms_missing(be)
        if why:
            raise hal.UnsupportedError(why, backend=be.name, call="rl_loop")
    if not isinstance(steps, int) or steps < 1:
        raise hal.InvalidArgumentError(f"steps={steps!r} must be an int >= 1", backend=be.name, call="rl_loop")
    module = load_engine_module()
    base = _used(be)
    sleeper: Sleeper = GraphkitSleeper(be, kv_backup) if impl == "graphkit" else TmsSleeper(be, kv_backup)
    pools = sleeper.pools(be)
    engine = module.Engine(be, config, max_batch=max(sizes), max_model_len=max_model_len, seed=seed, pools=pools,
                           memory=sleeper.region)
    try:
        awake, rows = _run_steps(be, engine, sleeper, steps, sizes, rollout_steps, seed, base)
    finally:
        engine.close()
        if pools is not None:
            pools.close()
        del engine  # the regions' memory goes with the engine's tensors, before the saver closes
        gc.collect()
        sleeper.close()
    return {**summarise(impl, be, config, awake, rows), "kv_backup": kv_backup}


def summarise(impl: str, be: hal.Backend, config: str, awake: int, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The first step's pause and resume apart from the steady ones (median, min-max of the later steps)."""
    later = rows[1:]
    return {
        "impl": impl, "backend": be.name, "config": config, "steps": len(rows), "awake_bytes": awake,
        "first_pause_s": rows[0]["pause_s"], "first_resume_s": rows[0]["resume_s"],
        "steady_pause": spread(r["pause_s"] for r in later), "steady_resume": spread(r["resume_s"] for r in later),
        "load_weights": spread(r["load_weights_s"] for r in rows),
        "trainer_peak_bytes": max(r["trainer_peak_bytes"] for r in rows),
        "released_bytes": max(r["released_bytes"] for r in rows),
        "asleep_bytes": max(r["asleep_bytes"] for r in rows),
        "all_exact": all(r["replay_exact"] and r["weights_loaded"] and r["weights_in_place"] for r in rows),
        "rows": rows,
    }


# -- command line ------------------------------------------------------------------------------------------


def combine(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per implementation over its processes: the first pause and resume of each process (median,
    min-max), the steady ones over every later step of every process, the largest memory figures."""
    out = []
    for impl in IMPLS:
        runs = [r for r in results if r["impl"] == impl]
        if not runs:
            continue
        rows = [row for r in runs for row in r["rows"]]
        later = [row for r in runs for row in r["rows"][1:]]
        out.append({
            "impl": impl, "processes": len(runs), "backend": runs[0]["backend"], "config": runs[0]["config"],
            "steps": runs[0]["steps"], "awake_bytes": max(r["awake_bytes"] for r in runs),
            "first_pause": spread(r["first_pause_s"] for r in runs),
            "first_resume": spread(r["first_resume_s"] for r in runs),
            "steady_pause": spread(row["pause_s"] for row in later),
            "steady_resume": spread(row["resume_s"] for row in later),
            "load_weights": spread(row["load_weights_s"] for row in rows),
            "released_bytes": max(r["released_bytes"] for r in runs),
            "asleep_bytes": max(r["asleep_bytes"] for r in runs),
            "trainer_peak_bytes": max(r["trainer_peak_bytes"] for r in runs),
            "all_exact": all(r["all_exact"] for r in runs), "kv_backup": runs[0].get("kv_backup", False),
        })
        first, steady = out[-1]["first_pause"]["median"], out[-1]["steady_pause"]["median"]
        out[-1]["first_over_steady_pause"] = first / steady if first is not None and steady else None
    return out


def print_report(summary: list[dict[str, Any]], skipped: dict[str, str]) -> None:
    first = summary[0]
    print(f"backend {first['backend']}, config {first['config']}, {first['steps']} RL steps in each of "
          f"{first['processes']} process(es) per implementation; engine awake {fmt_bytes(first['awake_bytes'])}")
    print("ms as median (min-max): first = step 1 of each process, steady = steps 2.. of every process")
    print(f"{'impl':<10}{'first pause':>24}{'steady pause':>24}{'first resume':>24}{'steady resume':>24}"
          f"{'load ms':>10}{'released':>11}{'asleep':>10}{'trainer peak':>14}  exact")
    for r in summary:
        print(f"{r['impl']:<10}" + "".join(f"{fmt_spread(r[k], 1e3, 2):>24}" for k in (
              "first_pause", "steady_pause", "first_resume", "steady_resume"))
              + f"{r['load_weights']['median'] * 1e3:>10.2f}{fmt_bytes(r['released_bytes']):>11}"
              f"{fmt_bytes(r['asleep_bytes']):>10}{fmt_bytes(r['trainer_peak_bytes']):>14}  "
              f"{'yes' if r['all_exact'] else 'NO'}")
    for r in summary:
        ratio = r.get("first_over_steady_pause")
        if ratio is not None:
            print(f"{r['impl']}: first pause / steady pause {ratio:.2f} (target <= {FIRST_PAUSE_RATIO}: "
                  f"{'met' if ratio <= FIRST_PAUSE_RATIO else 'MISS'}); KV cache backed up: "
                  f"{'yes' if r['kv_backup'] else 'no'}")
    for impl, why in skipped.items():
        print(f"{impl}: skipped ({why})")


def _in_fresh_process(argv: list[str], impl: str) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, __file__, *argv, "--impls", impl, "--child"], capture_output=True,
                          text=True)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode not in (0, 1) or not lines:  # 1: ran, a replay differed; anything else: it broke
        raise SystemExit(f"{impl} run failed (exit code {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1])


@contextlib.contextmanager
def _backend(name: str | None) -> Iterator[hal.Backend]:
    name = select_backend_name(name, requires=("graphs", "custom_pool", "use_pool"))
    be = hal.get_backend(name, **(FAKE_OPTIONS if name == "fake" else {}))
    try:
        yield be
    finally:
        be.close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default=None, help="hal backend (default: the best available)")
    parser.add_argument("--config", choices=("tiny", "reference"), default=None,
                        help="model sizes (default: reference on a GPU, tiny otherwise)")
    parser.add_argument("--steps", type=int, default=3, help="RL steps (rollout, pause, train, wake)")
    parser.add_argument("--sizes", default=None, help="batch sizes to capture (default 1,2,4,8; 1..128 on a GPU)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="tokens per sequence: with the largest size, the KV cache's size (default 32; 1024 on "
                             "a GPU, a 15 GiB cache for the reference model)")
    parser.add_argument("--impls", default=None,
                        help="comma-separated, of graphkit,tms (default: both; tms where it can run)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="processes per implementation, the implementations alternating (the one that goes "
                             "first rotates every round); with more than one, every run is a fresh process")
    parser.add_argument("--kv-backup", action="store_true",
                        help="back the KV cache up too (by default only the weights are)")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    impls = [s.strip() for s in (args.impls or ",".join(IMPLS)).split(",") if s.strip()]
    if not impls or set(impls) - set(IMPLS):
        parser.error(f"--impls: choose from {', '.join(IMPLS)}")
    if args.steps < 1 or args.rounds < 1:
        parser.error("--steps and --rounds must be >= 1")
    results: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}
    try:
        with _backend(args.backend) as be:
            on_gpu = be.torch_device().type != "cpu"
            options = {"config": args.config or ("reference" if on_gpu else "tiny"),
                       "sizes": [int(s) for s in args.sizes.split(",")] if args.sizes else (
                           [1, 2, 4, 8, 16, 32, 64, 128] if on_gpu else [1, 2, 4, 8]),
                       "max_model_len": args.max_model_len or (1024 if on_gpu else 32)}
            if "tms" in impls and tms_missing(be):
                skipped["tms"] = tms_missing(be) or ""
                impls.remove("tms")
            if not args.child and (len(impls) > 1 or args.rounds > 1):  # fresh processes: no one-time cost
                child = ["--backend", be.name, "--config", options["config"], "--steps", str(args.steps),
                         "--sizes", ",".join(map(str, options["sizes"])), "--max-model-len",
                         str(options["max_model_len"]), *(["--kv-backup"] if args.kv_backup else [])]
                be.close()
                results = [_in_fresh_process(child, impl) for impl, _, _ in interleaved(impls, [None], args.rounds)]
            else:
                results = [rl_loop(be, impl, steps=args.steps, kv_backup=args.kv_backup, **options) for impl in impls]
    except hal.HalError as exc:
        print(f"error: {exc}")
        return 2
    if args.child:
        print(json.dumps(results[0]))
        return 0 if results[0]["all_exact"] else 1
    summary = combine(results)
    print_report(summary, skipped)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"summary": summary, "results": results, "skipped": skipped,
                                         "case_order": "alternated", "rounds": args.rounds}, indent=1))
        print(f"wrote {args.json}")
    return 0 if all(r["all_exact"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
