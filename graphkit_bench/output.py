"""The bench's outputs: a summary table on the terminal, a JSON file, a PNG plot."""

from __future__ import annotations

import json
import logging
import statistics
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
     "step ms @1 = one step at batch 1 through the runner: the mean of back-to-back steps on the wall clock, "
     "measured as the eager line above;"),
    ("  runner/hand = the runner's step at batch 1 over a hand-written loop's (copy in, replay, slice) on the same "
     "executable, the two timed in the same rounds in turns (on the wall clock on a device, on this process's CPU "
     "time on a host device), the median of the rounds' ratios: the runner's own cost is what exceeds 1 (target "
     "4); max rel err = the worst error against eager, every size at its own batch and a few padded batches; ok = "
     "under 2e-2 and every size replayed."),
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
            f"{'survivors':>10} {'executables':>16} {'K':>4} {'exe bytes':>10} {'workspaces':>10} {'rest':>10}")
    lines = ["", head, "-" * len(head)]
    for r in rows:
        a, e = r["accounting"], r["executables"]
        counts = f"{e['count']}/{e['instantiations']}/{e['updates']}/{e['refused']}"
        budget = str(e["budget"]) if e["budget"] is not None else "-"
        exe_bytes = _b(a["executables_bytes"]) if e["budget"] is not None else "-"
        lines.append(f"{row_label(r):<15} {r['order']:<11} {r['sizes_captured']:>5} "
                     f"{fmt_bytes(r['capture_only_bytes']):>10} {fmt_bytes(a['device']):>10} "
                     f"{fmt_bytes(a['chunks']):>10} {fmt_bytes(a['survivors']):>10} {counts:>16} {budget:>4} "
                     f"{exe_bytes:>10} {fmt_bytes(a['workspaces']):>10} {fmt_bytes(a['rest']):>10}")
    return lines + ACCOUNTING_COLUMNS


def runner_over_hand(r: dict[str, Any]) -> float | None:
    """The runner's step over the hand-written loop's at batch 1, from the rounds timed in turns (None: not
    timed)."""
    if r.get("hand_loop_ratios"):
        return statistics.median(r["hand_loop_ratios"])
    if "runner_ms_batch1" in r and r.get("hand_loop_ms_batch1"):
        return float(r["runner_ms_batch1"]) / r["hand_loop_ms_batch1"]
    return None


def memory_summary(out: dict[str, Any]) -> list[str]:
    """One line: vmm's graph memory over the orders run, against the largest size alone, one shared pool's best
    and worst row and a pool per graph's (none without a vmm row)."""
    rows = [r for r in out["results"] if not r.get("variant")]
    vmm = [r for r in rows if r["strategy"] == "vmm"]
    if not vmm:
        return []
    low, high = (f(r["graph_memory_bytes"] for r in vmm) for f in (min, max))
    orders = f"each of the {len(vmm)} orders run" if len(vmm) > 1 else f"the {vmm[0]['order']} order"
    text = (f"vmm {fmt_bytes(high)} in {orders}" if low == high
            else f"vmm {fmt_bytes(low)} to {fmt_bytes(high)} over {orders}")
    parts = [text + (f" (the largest size alone: {fmt_bytes(out['largest_alone_bytes'])})"
                     if out.get("largest_alone_bytes") is not None else "")]
    shared = sorted((r for r in rows if r["strategy"].startswith("shared-")), key=lambda r: r["graph_memory_bytes"])
    if shared:
        best, worst = shared[0], shared[-1]
        parts.append(f"one shared pool {fmt_bytes(best['graph_memory_bytes'])} ({best['strategy']}, {best['order']})"
                     f" to {fmt_bytes(worst['graph_memory_bytes'])} ({worst['strategy']}, {worst['order']}: "
                     f"{worst['graph_memory_bytes'] / max(high, 1):.2f} x vmm's)")
    private = [r["graph_memory_bytes"] for r in rows if r["strategy"] == "private"]
    if private:
        parts.append(f"a pool per graph {fmt_bytes(max(private))} ({max(private) / max(high, 1):.2f} x)")
    return ["graph memory: " + "; ".join(parts)]


def summary_table(out: dict[str, Any]) -> str:
    """One row per strategy and order, a line on graph memory, then the targets."""
    m = out["machine"]
    floor = (out.get("graph_floor") or {}).get("per_graph_bytes")
    granule = f"; {fmt_bytes(m['granularity'])} granules" if m.get("granularity") else ""
    lines = [(f"backend {m['backend']} ({m.get('device_name', m['processor'])}{granule}), torch {m['torch']}, "
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
        count = budget_floor.get("executables", budget_floor["topologies"])
        each = budget_floor.get("each", "topology")
        lines.insert(1, f"floor with the executables budget: the largest alone + one executable per further {each} "
                        f"({count} executable{'' if count == 1 else 's'}, {per} each) = {total}")
    head = (f"{'strategy':<15} {'order':<11} {'graph memory':>13} {'chunks':>10} {'driver':>10} {'capture s':>10} "
            f"{'verify':>7} {'step ms @1':>11} {'runner/hand':>12} {'max rel err':>11}  ok")
    lines += [head, "-" * len(head)]
    for r in out["results"]:
        chunks = fmt_bytes(r["chunk_bytes"]) if "chunk_bytes" in r else "-"
        ms1 = f"{r['replay_ms']['1']:.3f}" if "replay_ms" in r and "1" in r["replay_ms"] else "-"
        over = runner_over_hand(r)
        turns = f"{over:.3f}" if over is not None else "-"
        ok = "yes" if row_ok(r) else "NO"
        worst = max(r["max_rel_error"], r.get("max_rel_error_every_size", 0.0))
        verify = (f"{100 * r['verify_seconds'] / r['capture_seconds']:.1f}%"
                  if r.get("verified_graphs") and r.get("capture_seconds") else "-")
        driver = fmt_bytes(r["driver_bytes"]) if r.get("driver_bytes") is not None else "n/m"  # not measured
        lines.append(f"{row_label(r):<15} {r['order']:<11} {fmt_bytes(r['graph_memory_bytes']):>13} {chunks:>10} "
                     f"{driver:>10} {r['capture_seconds']:>10.3f} {verify:>7} {ms1:>11} {turns:>12} "
                     f"{worst:>11.2e}  {ok}")
        for size, why in (r.get("unreplayable_sizes") or {}).items():
            lines.append(f"  {row_label(r)} {r['order']}: size {size} does not replay: {why}")
    lines += memory_summary(out)
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
        shown = f"{t['ratio']:.3f}" if t["ratio"] is not None else "-"
        lines.append(f"  {t['id']}. [{state}] {t['target']} — ratio {shown}: {t['detail']}")
    return "\n".join(lines)


def write_json(out: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2))


def figure(out: dict[str, Any]) -> Any:
    """The plot as a matplotlib figure: graph memory against the number of captured sizes, one line per strategy,
    a panel per order; x ticks at whole numbers of sizes only, one legend below the panels (it hides no data).
    None without matplotlib (a warning names the extra to install)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        log.warning("matplotlib is not installed: no plot written, the JSON and the table are (for the plot: "
                    "pip install 'hal-graphkit[bench]')")
        return None
    orders = [o for o in ("descending", "ascending", "random", "on-demand")
              if any(r["order"] == o and "memory_after_each_capture" in r for r in out["results"])]
    fig, axes = plt.subplots(1, max(len(orders), 1), figsize=(5 * max(len(orders), 1), 4.6), squeeze=False,
                             sharey=True)
    floor = executable_floor(out)
    for ax, order in zip(axes[0], orders, strict=False):
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
        if out.get("largest_alone_bytes") is not None:
            ax.axhline(out["largest_alone_bytes"] / 2**20, color="grey", linestyle=":", label="largest size alone")
        if floor is not None:  # the floor with a budget: the largest alone, plus an executable per further topology
            ax.axhline(floor["bytes"] / 2**20, color="grey", linestyle="--",
                       label=f"largest alone + one executable per further {floor.get('each', 'topology')}")
        ax.plot([], [], marker="*", markersize=10, linestyle="none", color="grey",
                label="after every size replayed once")
        ax.set_title(f"capture order: {order}")
        ax.set_xlabel("number of captured sizes")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # a count of sizes: no tick at 1.5
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("graph memory (MiB, device used)")
    m = out.get("machine", {})
    fig.suptitle(f"graph memory per strategy — {m.get('device_name', m.get('backend', ''))}, torch "
                 f"{m.get('torch', '')}", fontsize=10)
    entries: dict[str, Any] = {}  # label -> handle, over every panel (an order may lack a strategy)
    for ax in axes[0]:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            entries.setdefault(label, handle)
    handles, labels = list(entries.values()), list(entries)
    fig.tight_layout(rect=(0, 0.2, 1, 1))  # the bottom fifth holds the legend, outside every panel
    if handles:
        fig.legend(handles, labels, loc="lower center", ncol=2, fontsize=7, frameon=False,
                   bbox_to_anchor=(0.5, 0.0))
    return fig


def plot(out: dict[str, Any], path: Path) -> bool:
    """Write :func:`figure` to ``path``; False (and a warning) without matplotlib."""
    fig = figure(out)
    if fig is None:
        return False
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
