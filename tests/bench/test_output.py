"""The bench's table and plot: columns that say what they measured, a memory line, whole-number ticks and a legend
that hides no data."""

from __future__ import annotations

from typing import Any

import pytest

from graphkit_bench import output

MACHINE = {"backend": "fake", "processor": "x", "torch": "2", "granularity": 16 << 10}


def _row(strategy: str, order: str, memory: int, **more: Any) -> dict[str, Any]:
    return {"strategy": strategy, "order": order, "graph_memory_bytes": memory, "capture_seconds": 1.0,
            "max_rel_error": 0.0, "memory_after_each_capture": [memory // 2, memory], **more}


def _out(results: list[dict[str, Any]]) -> dict[str, Any]:
    return {"machine": MACHINE, "sizes": [1, 2], "largest_alone_bytes": 672 << 10, "eager_ms": {"1": 5.0},
            "results": results, "targets": []}


def _cells(table: str, strategy: str, order: str) -> list[str]:
    return next(line for line in table.splitlines() if line.split()[:2] == [strategy, order]).split()


def test_the_table_explains_its_columns() -> None:
    table = output.summary_table(_out([]))
    head = next(line for line in table.splitlines() if line.startswith("strategy"))
    columns = ["graph memory", "chunks", "capture s", "verify", "step ms @1", "runner/hand", "max rel err", "ok"]
    explained = table[table.index("columns:"):]
    assert all(c in head for c in columns) and all(f"{c} = " in explained for c in columns), explained
    assert "ms @1 " not in head.replace("step ms @1", "") and "hand @1" not in head  # no figure of another kind


def test_runner_over_hand_comes_from_the_rounds_in_turns_not_from_the_back_to_back_steps() -> None:
    """A step at batch 1 timed back to back on the wall clock (36.8 ms, another process busy) is no figure to set
    beside the hand loop's median in turns (15.9 ms): the ratio column is the runner over the loop, round by round,
    from the same rounds (the runner's own median there, 16.0 ms, is what the loop is compared with)."""
    vmm = _row("vmm", "descending", 672 << 10, replay_ms={"1": 36.8}, runner_ms_batch1=16.0,
               hand_loop_ms_batch1=15.9, hand_loop_ratios=[1.0, 1.01, 0.99, 1.02, 1.0])
    old = _row("vmm", "ascending", 672 << 10, replay_ms={"1": 36.8}, runner_ms_batch1=31.8,
               hand_loop_ms_batch1=15.9)  # figures of a bench that kept only the two medians
    table = output.summary_table(_out([vmm, old, _row("private", "ascending", 2 << 20)]))
    assert _cells(table, "vmm", "descending")[-4:-2] == ["36.800", "1.000"]  # step ms @1, runner/hand
    assert _cells(table, "vmm", "ascending")[-3] == "2.000"
    assert _cells(table, "private", "ascending")[-4:-2] == ["-", "-"]  # neither timed
    assert "16.000" not in table and "15.900" not in table  # no figure of the rounds beside another clock's


def test_the_memory_line_sets_vmm_beside_one_shared_pool_and_a_pool_per_graph() -> None:
    rows = [_row("vmm", o, 672 << 10) for o in ("descending", "ascending", "on-demand")]
    rows += [_row("shared-weakref", "descending", 672 << 10), _row("shared-kept", "ascending", 1216 << 10),
             _row("shared-weakref", "on-demand", 928 << 10), _row("private", "descending", 2176 << 10)]
    (line,) = output.memory_summary(_out(rows))
    assert line == ("graph memory: vmm 672.0 KiB in each of the 3 orders run (the largest size alone: 672.0 KiB); "
                    "one shared pool 672.0 KiB (shared-weakref, descending) to 1.2 MiB (shared-kept, ascending: "
                    "1.81 x vmm's); a pool per graph 2.1 MiB (3.24 x)")
    spread = output.memory_summary(_out([_row("vmm", "descending", 1 << 20), _row("vmm", "random", 2 << 20)]))
    assert spread == [("graph memory: vmm 1.0 MiB to 2.0 MiB over each of the 2 orders run (the largest size "
                       "alone: 672.0 KiB)")]
    assert output.memory_summary(_out([_row("private", "descending", 1)])) == []  # no vmm row: none to set beside
    assert "16.0 KiB granules" in output.summary_table(_out(rows)).splitlines()[0]


def _figure(orders: tuple[str, ...] = ("descending", "ascending")) -> Any:
    pytest.importorskip("matplotlib")
    same = [1 << 20, 1 << 20, 2 << 20]  # three captured sizes: ticks 1, 2, 3 and nothing between
    out = {"machine": {"backend": "fake", "torch": "2"}, "largest_alone_bytes": 2 << 20, "sizes": [1, 2, 4],
           "results": [{"strategy": s, "order": o, "memory_after_each_capture": same, "graph_memory_bytes": 2 << 20,
                        "capture_only_bytes": 2 << 20}
                       for o in orders for s in ("private", "shared-kept", "shared-weakref", "vmm")]}
    return output.figure(out)


def test_the_plot_ticks_whole_numbers_of_captured_sizes_only() -> None:
    fig = _figure()
    fig.canvas.draw()
    for ax in fig.axes:
        low, high = ax.get_xlim()
        shown = [t for t in ax.get_xticks() if low <= t <= high]
        assert shown and all(float(t).is_integer() for t in shown), shown


def test_the_plot_has_one_legend_outside_every_panel() -> None:
    fig = _figure(("descending", "ascending", "on-demand"))
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    assert all(ax.get_legend() is None for ax in fig.axes)  # none over a panel's data
    (legend,) = fig.legends
    box = legend.get_window_extent(renderer)
    labels = [t.get_text() for t in legend.get_texts()]
    assert output.DESCRIPTIONS["vmm"] in labels and "largest size alone" in labels and len(labels) == len(set(labels))
    for ax in fig.axes:
        assert not box.overlaps(ax.get_window_extent(renderer)), (box, ax.get_window_extent(renderer))
    width, height = fig.get_size_inches() * fig.dpi
    assert box.x0 >= 0 and box.y0 >= 0 and box.x1 <= width and box.y1 <= height  # inside the image


def test_the_plot_shows_graphkits_line_on_top() -> None:
    fig = _figure()
    for ax in fig.axes:
        lines = {line.get_label(): line for line in ax.get_lines()}
        ours = lines[output.DESCRIPTIONS["vmm"]]
        others = [line for line in lines.values() if line is not ours]
        assert ours.get_linestyle() == "-" and all(o.get_linestyle() != "-" for o in others)  # dashed over it
        assert all(ours.get_linewidth() >= 3 * o.get_linewidth() for o in others)  # a band wider than each
