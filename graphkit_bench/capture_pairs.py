"""``python -m graphkit_bench.capture_pairs``: graphkit's capture time against the engine's own pool, judged.

Each pair is two fresh processes, one capturing every size with graphkit
(vmm with its default executables budget), one with the engine's own pool,
the one that goes first alternating from pair to pair:

* ``--workload reference``: the bench's decoder and 35 sizes through
  :class:`graphkit.GraphRunner`, ``vmm`` against ``shared-weakref``, largest
  first (:data:`graphkit_bench.strategies.STRATEGIES`);
* ``--workload engine`` / ``hf``: the engine-shaped loop of
  ``examples/engine-decode`` / a transformers Qwen3-shaped model, largest
  first, ``graph_memory`` (the loop unchanged inside ``graphkit.graph_memory()``)
  against ``own-kept`` (the engine's own shared pool), as
  :mod:`graphkit_bench.engines` runs them.

The ratio of each pair (graphkit's capture seconds over the engine's) is one
sample; the target -- at most 1.1 x -- is judged with
:func:`graphkit_bench.fair.judge_ratio`: met or missed when the 95% interval
of the median ratio lies on one side of 1.1, not judged when it straddles it
(or there are too few pairs: 6 at least). Every process gets ``--timeout``.

    python -m graphkit_bench.capture_pairs --workload reference --pairs 10 --backend cuda --out-dir pairs-out
"""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import hal
from graphkit_bench.fair import judge_ratio, spread
from graphkit_bench.helptext import OneDefaultFormatter

log = logging.getLogger("graphkit.bench.capture_pairs")

#: the target: graphkit's capture time at most this many times the engine's own pool's
LIMIT = 1.1
#: workload -> (graphkit's strategy, the engine's own pool)
PAIRS = {"reference": ("vmm", "shared-weakref"), "engine": ("graph_memory", "own-kept"),
         "hf": ("graph_memory", "own-kept")}
#: pairs the target asks for
PAIRS_ASKED = 10


def default_sizes(workload: str, config: str) -> list[int]:
    from graphkit_bench.engines import ENGINE_SIZES
    from graphkit_bench.run import REFERENCE_SIZES

    if workload == "reference":
        return list(REFERENCE_SIZES) if config == "reference" else [1, 2, 4, 8, 16, 24, 32]
    return list(ENGINE_SIZES) if config == "reference" else [1, 2, 4, 8]


def host_threads(backend: str | None, device: int) -> None:
    """One torch thread where the device is the host (``fake``): small ops gain nothing from threads that wait
    on each other, and another process's load would stretch them."""
    import torch

    with hal.get_backend(backend, device=device) as be:
        if be.torch_device().type == "cpu":
            torch.set_num_threads(1)


def prime_capture(be: hal.Backend) -> None:
    """One throwaway capture: what the first capture of a process sets up (2 s on ``fake``) is no strategy's."""
    import torch

    x = torch.ones(8, device=be.torch_device())
    graph = be.create_graph()
    try:
        with torch.no_grad(), be.capture(graph):
            x * 2
    finally:
        be.release_graph(graph)


def capture_case(workload: str, strategy: str, config: str, sizes: list[int], backend: str | None, device: int,
                 seed: int) -> dict[str, Any]:
    """Capture every size, largest first, with ``strategy``, in this process, after a throwaway capture (as the
    engine workloads make one): its capture seconds."""
    if workload != "reference":
        from graphkit_bench.engines import run_one

        result = run_one(workload, strategy, "descending", sizes, backend, device, config, seed, 1)
        return {"strategy": strategy, "capture_seconds": result["capture_seconds"],
                "graph_memory_bytes": result.get("graph_memory_bytes")}
    import graphkit
    from graphkit_bench import verifier
    from graphkit_bench.model import Decoder, DecoderConfig
    from graphkit_bench.strategies import STRATEGIES

    be = hal.get_backend(backend, device=device, requires=("graphs",))
    try:
        workload_cfg = DecoderConfig() if config == "reference" else DecoderConfig.tiny()
        model = Decoder(workload_cfg, max(sizes), be.torch_device(), seed=seed)
        prime_capture(be)
        runner = graphkit.GraphRunner(model.step, sizes, backend=be, outputs="view", fill=model.padding(),
                                      progress=False, verify=verifier.on(), **STRATEGIES[strategy])
        t0 = time.perf_counter()
        runner.capture(model.example_inputs(max(sizes), seed=seed), order="descending")
        wall = time.perf_counter() - t0
        report = runner.report()
        memory = runner.graph_bytes()
        runner.close()
    finally:
        be.close()
    return {"strategy": strategy, "capture_seconds": report.capture_seconds, "capture_wall_seconds": wall,
            "graph_memory_bytes": memory}


def run_child(argv: list[str], strategy: str, path: Path, timeout: float) -> dict[str, Any]:
    """One case in a fresh process (``argv``: this command's own), within ``timeout`` seconds."""
    cmd = [sys.executable, "-m", "graphkit_bench.capture_pairs", *argv, "--child", str(path), "--case", strategy]
    try:
        done = subprocess.run(cmd, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise hal.HalError(f"capture of {strategy} ran past --timeout {timeout:g} s") from None
    if done.returncode != 0 or not path.exists():
        raise hal.HalError(f"capture of {strategy} failed in its process (exit code {done.returncode}; its error "
                           "is above)")
    result: dict[str, Any] = json.loads(path.read_text())
    path.unlink()
    return result


def run_pairs(argv: list[str], workload: str, pairs: int, out_dir: Path, timeout: float,
              progress: bool = True) -> list[dict[str, Any]]:
    """``pairs`` pairs of fresh processes, graphkit first in even pairs, the engine's pool first in odd ones."""
    from tqdm.auto import tqdm

    ours, theirs = PAIRS[workload]
    out = []
    for i in tqdm(range(pairs), desc=f"capture pairs ({workload})", unit="pair", disable=not progress):
        order = (ours, theirs) if i % 2 == 0 else (theirs, ours)
        got = {s: run_child(argv, s, out_dir / f".pair-{i}-{s}.json", timeout) for s in order}
        out.append({"pair": i, "first": order[0], "ours": got[ours], "theirs": got[theirs],
                    "ratio": got[ours]["capture_seconds"] / max(got[theirs]["capture_seconds"], 1e-9)})
    return out


def judge_pairs(pairs: list[dict[str, Any]], limit: float = LIMIT) -> dict[str, Any]:
    """The target from the pairs' ratios: met, missed, or not judged (None) when the interval straddles
    ``limit`` or the pairs are too few."""
    ratios = [p["ratio"] for p in pairs]
    met, why = judge_ratio(ratios, limit)
    return {"met": met, "why": why, "limit": limit, "ratio": spread(ratios),
            "ours_seconds": spread(p["ours"]["capture_seconds"] for p in pairs),
            "theirs_seconds": spread(p["theirs"]["capture_seconds"] for p in pairs)}


def markdown(result: dict[str, Any]) -> str:
    ours, theirs = PAIRS[result["workload"]]
    t = result["target"]
    state = {True: "met", False: "MISSED", None: "not judged"}[t["met"]]
    lines = [f"# Capture time, paired processes: {result['workload']} ({ours} against {theirs})", "",
             f"* backend {result['backend']}, config {result['config']}, {len(result['sizes'])} sizes, largest first",
             f"* command: `{result['command']}`", "",
             "| pair | first | " + f"{ours} s | {theirs} s | ratio |", "|---:|---|---:|---:|---:|"]
    for p in result["pairs"]:
        lines.append(f"| {p['pair']} | {p['first']} | {p['ours']['capture_seconds']:.3f} | "
                     f"{p['theirs']['capture_seconds']:.3f} | {p['ratio']:.3f} |")
    lines += ["", (f"* [{state}] {ours} capture time <= {t['limit']:g} x {theirs}'s, {len(result['pairs'])} paired "
              f"fresh processes: {t['why']}")]
    if len(result["pairs"]) < PAIRS_ASKED:
        lines.append(f"* {len(result['pairs'])} pairs: the target asks for {PAIRS_ASKED} at least")
    return "\n".join(lines) + "\n"


def parser() -> argparse.ArgumentParser:
    from graphkit_bench.cli import CliParser, int_in, parse_sizes, positive_float

    p = CliParser(prog="python -m graphkit_bench.capture_pairs", description=__doc__.split("\n\n")[0],
                  formatter_class=OneDefaultFormatter)
    p.add_argument("--workload", choices=sorted(PAIRS), default="reference",
                   help="reference: vmm against shared-weakref; engine, hf: graph_memory against own-kept")
    p.add_argument("--pairs", type=int_in(1), default=PAIRS_ASKED,
                   help=f"pairs of fresh processes (the target asks for {PAIRS_ASKED}; 6 at least are judged)")
    p.add_argument("--config", choices=["reference", "tiny"], default="reference", help="model size")
    p.add_argument("--sizes", type=parse_sizes, default=None,
                   help="batch sizes (default: the bench's 35 for reference, the engines' 8 for engine and hf)")
    p.add_argument("--backend", default=None, help="hal backend (default: the best available)")
    p.add_argument("--device", type=int_in(0), default=0, help="device index")
    p.add_argument("--seed", type=int_in(0), default=0, help="seed of weights and inputs")
    p.add_argument("--timeout", type=positive_float, default=900.0, help="seconds each process may take")
    p.add_argument("--out-dir", type=Path, default=Path("pairs-out"),
                   help="where capture-pairs-WORKLOAD.json and .md go")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--case", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = parser()
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    sizes = args.sizes or default_sizes(args.workload, args.config)
    if args.child is not None:  # one process of a pair
        if args.case not in PAIRS[args.workload]:
            p.error(f"--case {args.case!r} is not a strategy of the {args.workload} pairs")
        host_threads(args.backend, args.device)
        result = capture_case(args.workload, args.case, args.config, sizes, args.backend, args.device, args.seed)
        args.child.write_text(json.dumps(result))
        return 0
    from graphkit_bench.cli import backend_error, out_dir_error

    if args.workload == "hf":
        import importlib.util

        if importlib.util.find_spec("transformers") is None:
            p.error("--workload hf needs transformers (pip install 'transformers>=4.51')")
    for why in (backend_error(args.backend, args.device), out_dir_error(args.out_dir)):
        if why:
            p.error(why)
    pairs = run_pairs(argv, args.workload, args.pairs, args.out_dir, args.timeout, progress=not args.no_progress)
    target = judge_pairs(pairs)
    result = {"command": "python -m graphkit_bench.capture_pairs " + shlex.join(argv), "workload": args.workload,
              "config": args.config, "sizes": sizes, "backend": hal.registry.select_backend_name(args.backend),
              "strategies": list(PAIRS[args.workload]), "pairs": pairs, "target": target,
              "median_ratio": statistics.median(p["ratio"] for p in pairs)}
    text = markdown(result)
    stem = args.out_dir / f"capture-pairs-{args.workload}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1))
    stem.with_suffix(".md").write_text(text)
    log.info("%s\nwrote %s.json and %s.md", text, stem, stem)
    return 0


if __name__ == "__main__":
    sys.exit(main())
