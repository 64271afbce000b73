"""``python -m graphkit bench --kv-sizing``: a KV cache sized after capture against one sized from an estimate.

Engines size their KV cache before they capture graphs, from the memory
left less an estimate of what the graphs will take; when the estimate is
low, capture runs out of memory (or eats the headroom meant for the run),
and when it is high the difference is KV cache never used. With graph
memory known exactly after capture, an elastic KV cache can be sized then.

Both approaches run the engine of ``examples/engine-decode`` (``kv="elastic"``,
the capture loop unchanged inside ``graphkit.graph_memory``) on the same
sizes, each in a fresh process on a device, the two alternating run by run:

* ``estimate``: before capture, the cache takes the free memory less the
  estimate and the margin; then the graphs are captured. The estimate is
  the peak of an eager decode step at the largest batch (the profile run
  engines make; the framework's allocator stats, so 0 where the framework's
  device is the host, as on ``fake``) unless one is given.
* ``after-capture``: the graphs are captured first, then the cache grows
  to the free memory less the margin (:meth:`Engine.grow_kv`).

Per run: the KV bytes, whether capture ran out of memory, the graph memory
(device memory capture took), the memory left free afterwards, and whether
the decoded tokens equal eager.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

import graphkit
import hal
from graphkit.graphs.capture import release_cached_memory
from graphkit_bench.engine_cases import MAX_MODEL_LEN, load_engine_module
from graphkit_bench.fair import interleaved, spread
from hal.types import fmt_bytes

log = logging.getLogger("graphkit.bench")

APPROACHES = ("estimate", "after-capture")
#: device memory left alone by both approaches (a GPU; 1 MiB on the host-backed fake device)
DEVICE_MARGIN = 1 << 30
FAKE_MARGIN = 1 << 20
#: the fake device for this bench: small, so that "what is left" is a cache of a few hundred blocks
FAKE_OPTIONS: dict[str, Any] = {"granularity": 1 << 14, "capacity": 8 << 20}


def _free(be: hal.Backend) -> int:
    release_cached_memory(be)
    be.synchronize()
    return be.mem_info().free


def profile_peak(be: hal.Backend, engine: Any) -> int:
    """Bytes an eager decode step at the largest batch allocates at its peak (the framework's allocator stats;
    0 where the framework has none for the device, e.g. ``fake``, whose activations live on the host)."""
    dev = be.torch_device()
    module = getattr(torch, dev.type, None)
    inputs = engine.static_inputs(engine.max_batch)
    if dev.type == "cpu" or module is None or not hasattr(module, "max_memory_allocated"):
        return 0
    be.synchronize()
    module.reset_peak_memory_stats(dev)
    start = module.memory_allocated(dev)
    with torch.no_grad():
        out = engine.forward(**inputs)
    be.synchronize()
    peak = module.max_memory_allocated(dev) - start
    del out
    release_cached_memory(be)
    return int(peak)


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, (hal.DeviceOutOfMemoryError, torch.OutOfMemoryError)) or "out of memory" in str(exc)


def run_kv_case(approach: str, be: hal.Backend, config: str, sizes: list[int], margin: int,
                estimate: int | None = None, seed: int = 0) -> dict[str, Any]:
    """One approach on a fresh engine; its KV bytes, whether capture ran out of memory, and the checks."""
    if approach not in APPROACHES:
        raise hal.InvalidArgumentError(f"approach={approach!r} must be one of {', '.join(APPROACHES)}",
                                       backend=be.name, call="run_kv_case")
    module = load_engine_module()
    engine = module.Engine(be, config, max_batch=max(sizes), max_model_len=MAX_MODEL_LEN[config], seed=seed,
                           kv="elastic")
    pools = graphkit.GraphPools(be)
    row: dict[str, Any] = {"approach": approach, "margin_bytes": margin, "sizes": sizes}
    try:
        if approach == "estimate":
            source = "given" if estimate is not None else "profile"
            estimate = estimate if estimate is not None else profile_peak(be, engine)
            engine.resize_kv(engine.kv_blocks_for(_free(be), margin + estimate))
            row.update(estimate_bytes=estimate, estimate_source=source)
        free_before = _free(be)
        try:
            with graphkit.graph_memory(be, pools=pools):
                engine.capture_graphs(sizes)
            row["oom"] = None
        except Exception as exc:  # an estimate too low: what engines report as OOM at capture
            if not _is_oom(exc):
                raise
            row["oom"] = f"{type(exc).__name__}: {exc}"[:400]
        free_after = _free(be)
        row["graph_memory_bytes"] = free_before - free_after
        if approach == "after-capture" and row["oom"] is None:
            engine.grow_kv(margin)
        row.update(kv_blocks=engine.num_blocks, kv_bytes=engine.kv_bytes, free_after_bytes=_free(be))
        row["headroom_kept"] = row["free_after_bytes"] >= margin
        if row["oom"] is None:
            n = min(3, max(sizes))
            prompts = [[(7 * i + j) % engine.cfg.vocab for j in range(2 + i % 3)] for i in range(n)]
            row["tokens_equal"] = (engine.generate(prompts, 4, keep_logits=False).tokens
                                   == engine.generate(prompts, 4, use_graphs=False, keep_logits=False).tokens)
        else:
            row["tokens_equal"] = None
    finally:
        engine.close()
        pools.close()
    return row


def run_one(approach: str, backend: str | None, device: int, config: str, sizes: list[int], margin: int | None,
            estimate: int | None, seed: int) -> dict[str, Any]:
    """One case in this process, on a backend of its own."""
    name = hal.registry.select_backend_name(backend, requires=("graphs",))
    be = hal.get_backend(name, device=device, **(FAKE_OPTIONS if name == "fake" else {}))
    try:
        if margin is None:
            margin = FAKE_MARGIN if name == "fake" else DEVICE_MARGIN
        row = run_kv_case(approach, be, config, sizes, margin, estimate, seed)
    finally:
        be.close()
    row.update(backend=name, config=config)
    return row


def _run_isolated(args: list[str]) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-m", "graphkit_bench.kv_sizing", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"kv-sizing case {' '.join(args)} failed (exit code {proc.returncode}):\n"
                         f"{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def summarise(results: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per approach: KV bytes and graph memory as median (min-max) over the runs, OOMs, correctness."""
    out = {}
    for approach in APPROACHES:
        runs = [r for r in results if r["approach"] == approach]
        if runs:
            out[approach] = {"runs": len(runs), "kv_bytes": spread(r["kv_bytes"] for r in runs),
                             "graph_memory_bytes": spread(r["graph_memory_bytes"] for r in runs),
                             "free_after_bytes": spread(r["free_after_bytes"] for r in runs),
                             "ooms": sum(r["oom"] is not None for r in runs),
                             "headroom_kept": all(r["headroom_kept"] for r in runs),
                             "correct": all(r["tokens_equal"] is not False for r in runs)}
    return out


def run_kv_sizing_bench(backend: str | None, device: int, config: str, sizes: list[int], runs: int,
                        margin: int | None, estimate: int | None, seed: int, isolate: bool, out_dir: Path,
                        command: str) -> int:
    """Both approaches, ``runs`` times each, alternating; writes ``bench-kv-sizing.json`` and prints the two."""
    results: list[dict[str, Any]] = []
    for approach, _, i in interleaved(list(APPROACHES), [None], runs):
        args = [approach, backend or "", str(device), config, ",".join(map(str, sizes)),
                "" if margin is None else str(margin), "" if estimate is None else str(estimate), str(seed + i)]
        results.append(_run_isolated(args) if isolate else
                       run_one(approach, backend, device, config, sizes, margin, estimate, seed + i))
    summary = summarise(results)
    after, est = summary["after-capture"], summary["estimate"]
    # the estimate's KV counts only where it kept what both approaches promise: capture done, the margin free
    fair = est["ooms"] == 0 and est["headroom_kept"]
    met = after["ooms"] == 0 and after["correct"] and after["headroom_kept"] and (
        not fair or after["kv_bytes"]["min"] >= est["kv_bytes"]["max"])
    targets = [{"target": "KV bytes sized after capture >= sized from the pre-capture estimate (where that kept the "
                          "margin), no OOM at capture", "measured": after["kv_bytes"]["median"],
                "limit": est["kv_bytes"]["median"], "met": met,
                "estimate_kept_margin": fair, "estimate_ooms": est["ooms"]}]
    out = {"command": command, "config": config, "sizes": sizes, "runs": runs, "isolated": isolate,
           "case_order": "alternated", "results": results, "summary": summary, "targets": targets}
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "bench-kv-sizing.json"
    path.write_text(json.dumps(out, indent=1))
    first = results[0]
    print(f"backend {first['backend']}, engine config {config}, {len(sizes)} sizes up to {max(sizes)}, "
          f"margin {fmt_bytes(first['margin_bytes'])}, {runs} run(s) per approach, alternating")
    print(f"{'approach':<15}{'KV bytes':>14}{'graph memory':>14}{'free after':>12}{'OOM at capture':>16}  correct")
    for approach, s in summary.items():
        ooms = f"{s['ooms']} of {s['runs']}"
        print(f"{approach:<15}{fmt_bytes(s['kv_bytes']['median']):>14}"
              f"{fmt_bytes(s['graph_memory_bytes']['median']):>14}{fmt_bytes(s['free_after_bytes']['median']):>12}"
              f"{ooms:>16}  {'yes' if s['correct'] else 'NO'}{'' if s['headroom_kept'] else ' (margin not kept)'}")
    estimates = sorted({(r.get('estimate_source'), r.get('estimate_bytes')) for r in results
                        if r["approach"] == "estimate"}, key=str)
    for source, nbytes in estimates:
        print(f"estimate ({source}): {fmt_bytes(nbytes or 0)}")
    for t in targets:
        print(f"  {'met ' if t['met'] else 'MISS'}  {t['target']}")
    print(f"wrote {path}")
    return 0 if after["correct"] and est["correct"] else 1


def _main(argv: list[str]) -> int:
    """Child process: one case, its JSON on the last line."""
    approach, backend, device, config, sizes, margin, estimate, seed = argv
    row = run_one(approach, backend or None, int(device), config, [int(s) for s in sizes.split(",")],
                  int(margin) if margin else None, int(estimate) if estimate else None, int(seed))
    print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
