"""The bench's outputs: a summary table on the terminal, a JSON file, a PNG plot."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from graphkit_bench.case_figures import confirmation_line
from graphkit_bench.strategies import DESCRIPTIONS
from hal.types import fmt_bytes

log = logging.getLogger("graphkit.bench")

#: what each column of the summary table means, printed under it
COLUMNS = [
    ("columns: graph memory = device memory the captured graphs added, as the driver counts it; "
     "chunks = graphkit's physical chunks (vmm only);"),
    ("  capture s = seconds to capture every size; verify = the share of those the isolation check took; "
     "ms @1 = one step at batch 1 through the runner;"),
    ("  hand @1 = the runner's graph driven by a hand-written loop (copy in, replay, slice): the runner's own "
     "cost is the difference; max rel err = the worst error against eager; ok = under 2e-2."),
]


def summary_table(out: dict[str, Any]) -> str:
    """One row per strategy and order, then the targets."""
    m = out["machine"]
    floor = (out.get("graph_floor") or {}).get("per_graph_bytes")
    lines = [(f"backend {m['backend']} ({m.get('device_name', m['processor'])}), torch {m['torch']}, "
              f"{len(out['sizes'])} sizes {out['sizes'][0]}..{out['sizes'][-1]}; "
              f"largest size alone: {fmt_bytes(out['largest_alone_bytes'])}"
              + (f"; the driver's memory per graph: {fmt_bytes(int(floor))} (no pool shares it)"
                 if floor is not None else "")),
             "eager ms/step: " + ", ".join(f"batch {k}: {v:.3f}" for k, v in out["eager_ms"].items())]
    head = (f"{'strategy':<15} {'order':<11} {'graph memory':>13} {'chunks':>10} {'driver':>10} {'capture s':>10} "
            f"{'verify':>7} {'ms @1':>8} {'hand @1':>8} {'max rel err':>11}  ok")
    lines += [head, "-" * len(head)]
    for r in out["results"]:
        chunks = fmt_bytes(r["chunk_bytes"]) if "chunk_bytes" in r else "-"
        ms1 = f"{r['replay_ms']['1']:.3f}" if "replay_ms" in r and "1" in r["replay_ms"] else "-"
        hand = f"{r['hand_loop_ms_batch1']:.3f}" if "hand_loop_ms_batch1" in r else "-"
        ok = "yes" if r["max_rel_error"] < 2e-2 else "NO"
        verify = (f"{100 * r['verify_seconds'] / r['capture_seconds']:.1f}%"
                  if r.get("verified_graphs") and r.get("capture_seconds") else "-")
        driver = fmt_bytes(r["driver_bytes"]) if r.get("driver_bytes") is not None else "n/m"  # not measured
        lines.append(f"{r['strategy']:<15} {r['order']:<11} {fmt_bytes(r['graph_memory_bytes']):>13} {chunks:>10} "
                     f"{driver:>10} {r['capture_seconds']:>10.3f} {verify:>7} {ms1:>8} {hand:>8} "
                     f"{r['max_rel_error']:>11.2e}  {ok}")
    lines += [line for r in out["results"] if (line := confirmation_line(f"verify {r['strategy']} {r['order']}", r))]
    driver_why = next((r["driver_why"] for r in out["results"] if r.get("driver_why")), None)
    if driver_why:
        lines.append(f"driver (the driver's own memory of the graphs): n/m = {driver_why}")
    for name, why in out.get("left_out", {}).items():
        lines.append(f"{name}: left out: {why}")
    lines += COLUMNS
    lines.append("targets:")
    for t in out.get("targets", []):
        state = {True: "met", False: "MISSED", None: "not judged"}[t["met"]]
        ratio = f"{t['ratio']:.3f}" if t["ratio"] is not None else "-"
        lines.append(f"  {t['id']}. [{state}] {t['target']} — ratio {ratio}: {t['detail']}")
    return "\n".join(lines)


def write_json(out: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2))


def plot(out: dict[str, Any], path: Path) -> bool:
    """Graph memory against the number of captured sizes, one line per strategy; a panel per order."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: no plot written, the JSON and the table are (for the plot: "
                    "pip install 'hal-graphkit[bench]')")
        return False
    orders = [o for o in ("descending", "ascending", "random", "on-demand")
              if any(r["order"] == o and "memory_after_each_capture" in r for r in out["results"])]
    fig, axes = plt.subplots(1, len(orders), figsize=(5 * len(orders), 4), squeeze=False, sharey=True)
    for ax, order in zip(axes[0], orders, strict=True):
        for r in out["results"]:
            if r["order"] != order or "memory_after_each_capture" not in r:
                continue
            ys = [y / 2**20 for y in r["memory_after_each_capture"]]
            ours = r["strategy"] == "vmm"  # a wide band beneath thin dashed lines: equal lines both stay visible
            ax.plot(range(1, len(ys) + 1), ys, marker="o" if ours else ".", linewidth=5 if ours else 1.3,
                    alpha=0.7 if ours else 1.0, zorder=1.5 if ours else 3, linestyle="-" if ours else "--",
                    label=DESCRIPTIONS.get(r["strategy"], r["strategy"]))
        ax.axhline(out["largest_alone_bytes"] / 2**20, color="grey", linestyle=":", label="largest size alone")
        floor = (out.get("graph_floor") or {}).get("per_graph_bytes")
        if floor:  # the physical floor: the largest alone, plus the driver's memory of every further graph
            n = len(out["sizes"])
            ax.plot(range(1, n + 1), [(out["largest_alone_bytes"] + k * floor) / 2**20 for k in range(n)],
                    color="grey", linestyle="--", label="largest alone + the driver's memory per graph")
        ax.set_title(f"capture order: {order}")
        ax.set_xlabel("number of captured sizes")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    axes[0][0].set_ylabel("graph memory (MiB, device used)")
    m = out["machine"]
    fig.suptitle(f"graph memory per strategy — {m.get('device_name', m['backend'])}, torch {m['torch']}",
                 fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
