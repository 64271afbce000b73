"""The engine workloads of the bench: an engine's own capture loop, adopting graphkit or not.

``python -m graphkit bench --workload engine`` (the engine-shaped decode loop of
``examples/engine-decode``) and ``--workload hf`` (a Hugging Face transformers
Qwen3-shaped model) measure every strategy in every capture order:

* ``own-kept`` -- the engine's own shared pool, outputs kept (nano-vllm, SGLang);
* ``own-weakref`` -- the same pool, outputs weakly referenced (vLLM);
* ``graph_memory`` -- the engine's loop unchanged inside ``graphkit.graph_memory()``;
* ``graph_pools`` -- the one-line port, ``pool=pools.pool(batch_size)``.

Each case runs ``runs`` times, each time in a fresh process on a device (single
runs of one case have differed by 18 MiB on an H100). The cases go run by run,
the strategies of one order side by side in an order rotated every run (so no
strategy always runs first); the table gives each figure's median over the
runs with its range (min-max). Targets: graph memory of the graphkit
strategies at most the engines' best (``own-weakref``, descending) in every
order; capture time at most 1.1x the engine's own shared pool.
"""

from __future__ import annotations

import json
import logging
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import hal
from graphkit_bench.case_figures import CONFIRMATION, PARTS, confirmation_line
from graphkit_bench.fair import fmt_spread, interleaved, judge_ratio, spread
from hal.types import fmt_bytes

log = logging.getLogger("graphkit.bench")

ENGINE_STRATEGIES = ("own-kept", "own-weakref", "graph_memory", "graph_memory-replay", "graph_pools")
ENGINE_ORDERS = ("descending", "ascending", "random", "on-demand")
WORKLOADS = ("engine", "hf")
GRAPHKIT = ("graph_memory", "graph_memory-replay", "graph_pools")
#: the engines' best case, the memory target's reference
BASELINE = ("own-weakref", "descending")
CAPTURE_TIME_LIMIT = 1.1
ENGINE_SIZES = [1, 2, 4, 8, 16, 32, 64, 128]


def case_runner(workload: str) -> Callable[..., dict]:
    """``run_case(strategy, order, sizes, backend, config, seed, iters) -> dict`` of a workload."""
    if workload == "engine":
        from graphkit_bench.engine_cases import run_engine_case

        return lambda strategy, order, sizes, be, config, seed, iters: run_engine_case(
            strategy, order, sizes, be, config=config, seed=seed, iters=iters)
    if workload == "hf":
        from graphkit_bench.hf import run_hf_case

        return lambda strategy, order, sizes, be, config, seed, iters: run_hf_case(
            strategy, order, sizes, be, size=config, seed=seed, iters=iters)
    raise hal.InvalidArgumentError(f"workload={workload!r} must be one of {', '.join(WORKLOADS)}",
                                   call="graphkit bench")


def run_one(workload: str, strategy: str, order: str, sizes: list[int], backend: str | None, device: int,
            config: str, seed: int, iters: int) -> dict:
    """One case in this process."""
    be = hal.get_backend(backend, device=device, requires=("graphs",))
    try:
        result = case_runner(workload)(strategy, order, sizes, be, config, seed, iters)
    finally:
        be.close()
    result.update(workload=workload, config=config, backend=be.name)
    return result


def run_isolated(args: list[str]) -> dict:
    """One case in a fresh process: ``python -m graphkit_bench.engines ARGS`` prints its JSON last."""
    proc = subprocess.run([sys.executable, "-m", "graphkit_bench.engines", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"bench case {' '.join(args)} failed (exit code {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def median_of(runs: list[dict], key: str) -> float | None:
    values = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(values) if values else None


#: figures whose spread over the runs is kept next to their median
SPREAD_KEYS = ("graph_memory_bytes", "capture_seconds", "replay_ms_1", "replay_ms_max")


def summarise(results: list[dict]) -> list[dict]:
    """Median over the runs of each (strategy, order), and the spread (median, min, max) of :data:`SPREAD_KEYS`."""
    rows = []
    keys = sorted({(r["strategy"], r["order"]) for r in results},
                  key=lambda k: (ENGINE_STRATEGIES.index(k[0]), ENGINE_ORDERS.index(k[1])))
    for strategy, order in keys:
        runs = [r for r in results if (r["strategy"], r["order"]) == (strategy, order)]
        rows.append({
            "strategy": strategy, "order": order, "runs": len(runs),
            "graph_memory_bytes": median_of(runs, "graph_memory_bytes"),
            "chunk_bytes": median_of(runs, "chunk_bytes"),
            "capture_seconds": median_of(runs, "capture_seconds"),
            "map_calls": median_of(runs, "map_calls"),
            "map_seconds": median_of(runs, "map_seconds"),
            "verify_seconds": median_of(runs, "verify_seconds"),
            "verify_share": median_of([{"v": r["verify_seconds"] / r["capture_seconds"]} for r in runs
                                       if r.get("verify_seconds") is not None and r.get("capture_seconds")], "v"),
            "inspected_nodes": median_of(runs, "inspected_nodes"),
            "missed_nodes": median_of(runs, "missed_nodes"),
            **{name: median_of(runs, name) for name in CONFIRMATION},
            "replay_ms_1": median_of(runs, "replay_ms_1"),
            "replay_ms_max": median_of(runs, "replay_ms_max"),
            "graphkit_seconds": {part: median_of([{"v": r["graphkit_seconds"][part]} for r in runs
                                                  if r.get("graphkit_seconds")], "v") for part in PARTS},
            "graphkit_share": median_of(runs, "graphkit_share"),
            "max_abs_error": max((r.get("max_abs_error") or 0.0) for r in runs),
            "correct": all(r.get("ok", r.get("tokens_equal", True)) for r in runs),
            "spread": {key: spread(r.get(key) for r in runs) for key in SPREAD_KEYS},
        })
    return rows


def capture_ratios(results: list[dict], strategy: str, order: str) -> list[float]:
    """``strategy``'s capture time over the engine's own pool's (``own-kept``), run by run: the runs pair up, the
    cases of one run having gone side by side."""
    def by_run(name: str) -> dict[int, float]:
        return {r.get("run", i): r["capture_seconds"] for i, r in enumerate(x for x in results
                if (x["strategy"], x["order"]) == (name, order)) if r.get("capture_seconds")}
    ours, own = by_run(strategy), by_run("own-kept")
    return [ours[i] / own[i] for i in sorted(ours.keys() & own.keys())]


def check_targets(rows: list[dict], results: list[dict] | None = None) -> list[dict]:
    """Each target: met, or the measured gap; the capture time is judged run by run (:func:`capture_ratios`):
    met or missed only where the interval of the median ratio is clear of the limit, else not judged."""
    by = {(r["strategy"], r["order"]): r for r in rows}
    base = by.get(BASELINE)
    targets = []
    if base is not None:
        limit = base["graph_memory_bytes"]
        for r in rows:
            if r["strategy"] in GRAPHKIT:
                targets.append({"target": f"{r['strategy']} {r['order']}: graph memory <= own-weakref descending",
                                "measured": r["graph_memory_bytes"], "limit": limit,
                                "met": r["graph_memory_bytes"] <= limit})
    for order in ENGINE_ORDERS:
        own = by.get(("own-kept", order))
        for strategy in GRAPHKIT:
            row = by.get((strategy, order))
            if own and row and own["capture_seconds"]:
                ratios = capture_ratios(results or [], strategy, order)
                met, why = judge_ratio(ratios, CAPTURE_TIME_LIMIT)
                ratio = statistics.median(ratios) if ratios else row["capture_seconds"] / own["capture_seconds"]
                targets.append({"target": f"{strategy} {order}: capture time <= {CAPTURE_TIME_LIMIT}x own pool",
                                "measured": round(ratio, 3), "limit": CAPTURE_TIME_LIMIT, "met": met,
                                "detail": f"{len(ratios)} paired run(s); {why}"})
    return targets


def table(rows: list[dict]) -> str:
    lines = [(f"{'strategy':<14}{'order':<12}{'graph memory (min-max)':>30}{'chunks':>12}{'capture s (min-max)':>21}"
              f"{'map ms':>8}{'verify':>8}{'nodes':>8}{'replay ms @1':>21}{'@max':>21}  correct")]
    for r in rows:
        chunks = fmt_bytes(r["chunk_bytes"]) if r["chunk_bytes"] is not None else "-"
        map_ms = f"{r['map_seconds'] * 1e3:.1f}" if r.get("map_seconds") is not None else "-"
        verify = f"{r['verify_share'] * 100:.1f}%" if r.get("verify_share") is not None else "-"
        nodes = "-"
        if r.get("inspected_nodes"):
            missed = r.get("missed_nodes") or 0
            nodes = f"{100 * (1 - missed / r['inspected_nodes']):.0f}%" if missed else f"{r['inspected_nodes']:.0f}"
        spreads = r.get("spread", {})
        capture, at1, atmax = (fmt_spread(spreads.get(k) or spread([r[k]])) for k in
                               ("capture_seconds", "replay_ms_1", "replay_ms_max"))
        memory = spreads.get("graph_memory_bytes") or spread([r["graph_memory_bytes"]])
        mem = fmt_bytes(memory["median"]) + (f" ({fmt_bytes(memory['min'])}-{fmt_bytes(memory['max'])})"
                                             if memory["min"] != memory["max"] else "")
        lines.append(f"{r['strategy']:<14}{r['order']:<12}{mem:>30}{chunks:>12}"
                     f"{capture:>21}{map_ms:>8}{verify:>8}{nodes:>8}{at1:>21}"
                     f"{atmax:>21}  {'yes' if r['correct'] else 'NO'}")
    lines += [line for r in rows if (line := confirmation_line(f"verify {r['strategy']} {r['order']}", r))]
    return "\n".join(lines)


def share_table(rows: list[dict]) -> str:
    """graphkit's parts of each case's capture time (medians over the runs, milliseconds) and their share."""
    lines = [("graphkit's share of capture time (medians, ms): routing = graph_memory's router less verification; "
             "spaces = a new space and its pool; maps = chunks mapped (into new spaces and as captures grow)"),
             f"{'strategy':<14}{'order':<12}{'capture ms':>11}" + "".join(f"{p:>10}" for p in PARTS) + f"{'share':>8}"]
    for r in rows:
        parts = r.get("graphkit_seconds") or {}
        cells = "".join(f"{parts[p] * 1e3:>10.1f}" if parts.get(p) is not None else f"{'-':>10}" for p in PARTS)
        share = f"{r['graphkit_share'] * 100:.1f}%" if r.get("graphkit_share") is not None else "-"
        lines.append(f"{r['strategy']:<14}{r['order']:<12}{r['capture_seconds'] * 1e3:>11.1f}{cells}{share:>8}")
    return "\n".join(lines)


def run_engine_bench(workload: str, config: str, sizes: list[int], strategies: list[str], orders: list[str],
                     runs: int, backend: str | None, device: int, seed: int, iters: int, isolate: bool,
                     out_dir: Path, command: str, progress: bool = True) -> int:
    """Every strategy x order, ``runs`` times each, interleaved (:func:`graphkit_bench.fair.interleaved`);
    writes ``bench-<workload>.json`` and prints the table."""
    from tqdm.auto import tqdm

    cases = interleaved(strategies, orders, runs)
    results: list[dict] = []
    out = {"command": command, "workload": workload, "config": config, "sizes": sizes, "runs": runs,
           "isolated": isolate, "case_order": "interleaved", "results": results}
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"bench-{workload}.json"
    for strategy, order, i in tqdm(cases, desc=f"bench {workload}", unit="case", disable=not progress):
        args = [workload, strategy, order, ",".join(map(str, sizes)), backend or "", str(device), config,
                str(seed + i), str(iters)]
        results.append({**(run_isolated(args) if isolate else
                           run_one(workload, strategy, order, sizes, backend, device, config, seed + i, iters)),
                        "run": i})
        path.write_text(json.dumps({**out, "partial": True}, indent=1))  # an interrupted run keeps its cases
    rows = summarise(results)
    targets = check_targets(rows, results)
    out.update(summary=rows, targets=targets)
    path.write_text(json.dumps(out, indent=1))
    print(table(rows))
    print(share_table(rows))
    for t in targets:
        state = {True: "met ", False: "MISS", None: "not judged"}[t["met"]]
        print(f"  {state}  {t['target']}: {t['measured']} (limit {t['limit']})"
              + (f" -- {t['detail']}" if t.get("detail") else ""))
    print(f"wrote {path}")
    return 0 if all(r["correct"] for r in rows) else 1


def _main(argv: list[str]) -> int:
    """Child process: run one case, print its JSON on the last line."""
    workload, strategy, order, sizes, backend, device, config, seed, iters = argv
    result = run_one(workload, strategy, order, [int(s) for s in sizes.split(",")], backend or None, int(device),
                     config, int(seed), int(iters))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
