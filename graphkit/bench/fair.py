"""Fair comparisons: cases in an order that gives no strategy a fixed place, figures as a median and its spread.

What runs first in a process (or right after another strategy) pays costs
that are not its own: first-call setup, the framework's caches, the
device's clocks. Measured on one H100, swapping which of two KV caches ran
first moved a decode-step gap from +9.5% to -0.8%. So every bench here runs
its strategies run by run, each run visiting every strategy once in a
rotated order, and reports each figure as the median of the runs with their
minimum and maximum.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from typing import Any, TypeVar

T = TypeVar("T")
K = TypeVar("K")


def rotated(items: Sequence[T], shift: int) -> list[T]:
    """``items`` rotated left by ``shift`` (modulo their number): run ``i`` starts with item ``i``."""
    if not items:
        return []
    k = shift % len(items)
    return [*items[k:], *items[:k]]


def interleaved(strategies: Sequence[T], orders: Sequence[K], runs: int) -> list[tuple[T, K, int]]:
    """``(strategy, order, run)`` cases, run-major: every run visits every strategy in every order once,
    the strategies of one order next to each other and rotated by one from run to run, so that over
    ``len(strategies)`` runs each strategy takes each place once."""
    return [(s, o, i) for i in range(runs) for o in orders for s in rotated(strategies, i)]


def spread(values: Iterable[float | int | None]) -> dict[str, Any]:
    """The median of ``values`` (``None`` left out) with the minimum, the maximum and how many there were.

    All ``None`` when there is no value.
    """
    kept = [v for v in values if v is not None]
    if not kept:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": statistics.median(kept), "min": min(kept), "max": max(kept), "n": len(kept)}


def fmt_spread(s: dict[str, Any], scale: float = 1.0, digits: int = 3) -> str:
    """``median (min-max)`` of a :func:`spread`, each multiplied by ``scale``; ``-`` when empty."""
    if s.get("median") is None:
        return "-"
    if s["n"] == 1 or s["min"] == s["max"]:
        return f"{s['median'] * scale:.{digits}f}"
    return f"{s['median'] * scale:.{digits}f} ({s['min'] * scale:.{digits}f}-{s['max'] * scale:.{digits}f})"
