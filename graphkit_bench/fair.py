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

import math
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


def median_interval(values: Sequence[float], confidence: float = 0.95) -> tuple[float, float] | None:
    """A distribution-free confidence interval of the median of ``values``: two of their order statistics.

    The ``k``-th smallest and the ``k``-th largest, with ``k`` the largest index
    for which a median outside them has probability at most ``1 - confidence``
    (the binomial law of how many values fall below the median). None when
    there are too few values for any interval at that confidence (5 or fewer
    at 95%).
    """
    ordered = sorted(values)
    n = len(ordered)
    alpha = (1 - confidence) / 2
    k, below = 0, 0.0
    while k < n // 2:
        below += math.comb(n, k) / 2 ** n  # P(fewer than k + 1 values below the median)
        if below > alpha:
            break
        k += 1
    if k == 0:
        return None
    return ordered[k - 1], ordered[n - k]


def judge_ratio(ratios: Sequence[float], limit: float, confidence: float = 0.95) -> tuple[bool | None, str]:
    """Whether ratios measured in turns stay at or under ``limit``: met, missed, or None when the noise cannot tell.

    Met when the whole confidence interval of their median is at or under the
    limit, missed when it is wholly above; None (not judged) when it straddles
    the limit or there are too few ratios. The second value says why, in words.
    """
    interval = median_interval(ratios, confidence)
    if interval is None:
        return None, f"not judged: {len(ratios)} ratio(s) are too few for a {confidence:.0%} interval of the median"
    low, high = interval
    where = f"median {statistics.median(ratios):.3f}, {confidence:.0%} interval {low:.3f}-{high:.3f}"
    if high <= limit:
        return True, where
    if low > limit:
        return False, where
    return None, f"not judged: {where} straddles {limit:g} (too noisy here to tell)"
