"""Timing helpers: device-synchronised wall clock, mean milliseconds per call."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import hal

Thunk = Callable[..., Any]
"""What the timers call, always with no arguments. ``...`` rather than ``[]``: mypy cannot match a lambda that
binds a loop value as a default (``lambda n=n: runner(**inputs[n])``) to ``Callable[[], Any]``."""


def ms_per_call(backend: hal.Backend, fn: Thunk, iters: int, warmup: int = 3) -> float:
    """Mean milliseconds per ``fn()`` over ``iters`` calls, synchronising the device at both ends.

    Calls are issued back to back, as a decode loop issues them; the device
    is synchronised once before and once after the timed calls.
    """
    for _ in range(warmup):
        fn()
    backend.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    backend.synchronize()
    return (time.perf_counter() - t0) * 1e3 / iters


def median_ms(backend: hal.Backend, fn: Thunk, iters: int, warmup: int = 1) -> float:
    """Median milliseconds of ``fn()`` over ``iters`` calls, each synchronised on both sides."""
    import statistics

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        backend.synchronize()
        t0 = time.perf_counter()
        fn()
        backend.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def rel_error(got: Any, want: Any) -> float:
    """Max absolute difference relative to the largest magnitude of ``want``."""
    got, want = got.float(), want.float()
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-12))
