"""The bench's outputs: a summary table on the terminal, a JSON file, a PNG plot."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from graphkit_bench.case_figures import confirmation_line
from graphkit_bench.strategies import DESCRIPTIONS, EVERY_SIZE
from graphkit_bench.targets import EXACT_LIMIT, executable_floor
from hal.types import fmt_bytes

log = logging.getLogger("graphkit.bench")

#: what each column of the summary table means, printed under it
COLUMNS = [
    ("columns: graph memory = device memory the captured graphs added, as the driver counts it, after every size "
     "was replayed once (captures = right after the captures); chunks = graphkit's physical chunks (vmm only);"),
    ("  capture s = seconds to capture every size; verify = the share of those the isolation check took; "
     "ms @1 = one step at batch 1 through the runner;"),
    ("  hand @1 = the runner's executable driven by a hand-written loop (copy in, replay, slice): the runner's own "
     "cost is the difference; max rel err = the worst error against eager, every size at its own batch and a few "
     "padded batches; ok = under 2e-2 and every size replayed."),
]
#: what each column of the accounting table means
ACCOUNTING_COLUMNS = [
    ("accounting: device = graph memory (after the replays) = chunks + executables' bytes + workspaces + the rest; "
     "survivors = of the chunks, those under memory that outlived its capture;"),
    ("  executables = alive / made (instantiations) / updates / refused updates, K = at most that many per "
     "topology (lazy: one per graph, made at its first replay; - : no budget, every graph instantiated at its "
     "capture's end: its bytes are in the rest, with the framework pools' memory); n/m = not measured (a host "
     "device keeps no driver memory)."),
]


def row_label(r: dict[str, Any]) -> str:
    """A row's strategy as the tables name it (the every-size row: ``vmm 1..N``)."""
    if r.get("variant") == EVERY_SIZE:
        return f"{r['strategy']} 1..{r['sizes_captured']}"
    return str(r["strategy"])


def row_ok(r: dict[str, Any]) -> bool:
    """Exact against eager at every batch checked, and every size replayed."""
    worst = max(r["max_rel_error"], r.get("max_rel_error_every_size", 0.0))
    return worst < EXACT_LIMIT and not r.get("unreplayable_sizes")


def _b(value: float | None) -> str:
    return fmt_bytes(int(value)) if value is not None else "n/m"


def accounting_table(out: dict[str, Any]) -> list[str]:
    """Where each row's graph memory went, and what its executables did."""
    rows = [r for r in out["results"] if "accounting" in r]
    if not rows:
        return []
    head = (f"{'strategy':<15} {'order':<11} {'sizes':>5} {'captures':>10} {'device':>10} {'chunks':>10} "
            f"{'survivors':>10} {'executables':>16} {'K':>3} {'exe bytes':>10} {'workspaces':>10} {'rest':>10}")
    lines = ["", head, "-" * len(head)]
    for r in rows:
        a, e = r["accounting"], r["executables"]
        counts = f"{e['count']}/{e['instantiations']}/{e['updates']}/{e['refused']}"
        budget = str(e["budget"]) if e["budget"] is not None else "-"
        exe_bytes = _b(a["executables_bytes"]) if e["budget"] is not None else "-"
        lines.append(f"{row_label(r):<15} {r['order']:<11} {r['sizes_captured']:>5} "
                     f"{fmt_bytes(r['capture_only_bytes']):>10} {fmt_bytes(a['device']):>10} "
                     f"{fmt_bytes(a['chunks']):>10} {fmt_bytes(a['survivors']):>10} {counts:>16} {budget:>3} "
                     f"{exe_bytes:>10} {fmt_bytes(a['workspaces']):>10} {fmt_bytes(a['rest']):>10}")
    return lines + ACCOUNTING_COLUMNS


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
    budget_floor = executable_floor(out)
    if budget_floor is not None:
        per = (fmt_bytes(int(budget_floor["per_executable_bytes"])) if budget_floor["measured"]
               else "none measured (a host device)")
        total = fmt_bytes(int(budget_floor["bytes"]))
        lines.insert(1, f"floor with the executables budget: the largest alone + one executable per further topology "
                        f"({budget_floor['topologies']} topolog{'y' if budget_floor['topologies'] == 1 else 'ies'}, "
                        f"{per} each) = {total}")
    head = (f"{'strategy':<15} {'order':<11} {'graph memory':>13} {'chunks':>10} {'driver':>10} {'capture s':>10} "
            f"{'verify':>7} {'ms @1':>8} {'hand @1':>8} {'max rel err':>11}  ok")
    lines += [head, "-" * len(head)]
    for r in out["results"]:
        chunks = fmt_bytes(r["chunk_bytes"]) if "chunk_bytes" in r else "-"
        ms1 = f"{r['replay_ms']['1']:.3f}" if "replay_ms" in r and "1" in r["replay_ms"] else "-"
        hand = f"{r['hand_loop_ms_batch1']:.3f}" if "hand_loop_ms_batch1" in r else "-"
        ok = "yes" if row_ok(r) else "NO"
        worst = max(r["max_rel_error"], r.get("max_rel_error_every_size", 0.0))
        verify = (f"{100 * r['verify_seconds'] / r['capture_seconds']:.1f}%"
                  if r.get("verified_graphs") and r.get("capture_seconds") else "-")
        driver = fmt_bytes(r["driver_bytes"]) if r.get("driver_bytes") is not None else "n/m"  # not measured
        lines.append(f"{row_label(r):<15} {r['order']:<11} {fmt_bytes(r['graph_memory_bytes']):>13} {chunks:>10} "
                     f"{driver:>10} {r['capture_seconds']:>10.3f} {verify:>7} {ms1:>8} {hand:>8} "
                     f"{worst:>11.2e}  {ok}")
        for size, why in (r.get("unreplayable_sizes") or {}).items():
            lines.append(f"  {row_label(r)} {r['order']}: size {size} does not replay: {why}")
    lines += [line for r in out["results"] if (line := confirmation_line(f"verify {r['strategy']} {r['order']}", r))]
    driver_why = next((r["driver_why"] for r in out["results"] if r.get("driver_why")), None)
    if driver_why:
        lines.append(f"driver (the driver's own memory of the graphs): n/m = {driver_why}")
    for name, why in out.get("left_out", {}).items():
        lines.append(f"{name}: left out: {why}")
    lines += COLUMNS
    lines += accounting_table(out)
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
    floor = executable_floor(out)
    for ax, order in zip(axes[0], orders, strict=True):
        for r in out["results"]:
            if r["order"] != order or "memory_after_each_capture" not in r or r.get("variant"):
                continue
            ys = [y / 2**20 for y in r["memory_after_each_capture"]]
            ours = r["strategy"] == "vmm"  # a wide band beneath thin dashed lines: equal lines both stay visible
            line = ax.plot(range(1, len(ys) + 1), ys, marker="o" if ours else ".", linewidth=5 if ours else 1.3,
                           alpha=0.7 if ours else 1.0, zorder=1.5 if ours else 3, linestyle="-" if ours else "--",
                           label=DESCRIPTIONS.get(r["strategy"], r["strategy"]))
            if "capture_only_bytes" in r:  # after every size was replayed once: lazy graphs paid their executables
                ax.plot([len(ys)], [r["graph_memory_bytes"] / 2**20], marker="*", markersize=12, linestyle="none",
                        color=line[0].get_color(), zorder=4)
        ax.axhline(out["largest_alone_bytes"] / 2**20, color="grey", linestyle=":", label="largest size alone")
        if floor is not None:  # the floor with a budget: the largest alone, plus an executable per further topology
            ax.axhline(floor["bytes"] / 2**20, color="grey", linestyle="--",
                       label=f"largest alone + one executable per topology ({floor['topologies']})")
        ax.plot([], [], marker="*", markersize=10, linestyle="none", color="grey",
                label="after every size replayed once")
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
