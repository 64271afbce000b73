"""Timing helpers: device-synchronised wall clock, mean milliseconds per call."""

from __future__ import annotations

import contextlib
import gc
import random
import time
from collections.abc import Callable, Iterator, Mapping
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


def interleaved_ms(backend: hal.Backend, fns: Mapping[str, Thunk], rounds: int, calls: int,
                   warmup: int = 3) -> dict[str, list[float]]:
    """Milliseconds per call of each of ``fns``, measured in turns: one figure per round and function.

    Each round times ``calls`` back-to-back calls of every function (the
    device synchronised at both ends of each; :func:`work_clock`), in an order
    that changes from round to round (the first rotates, the rest are
    shuffled), so that load from other processes, the device's clocks and
    what ran just before weigh on all of them alike. Compare two functions round by round
    (:func:`round_ratios`), not through their means.
    """
    names = list(fns)
    for name in names:
        for _ in range(warmup):
            fns[name]()
    clock = work_clock(backend)
    out: dict[str, list[float]] = {name: [] for name in names}
    for i in range(rounds):
        order = names[i % len(names):] + names[:i % len(names)]  # each goes first as often as the others
        random.Random(i).shuffle(order_rest := order[1:])  # and follows each of the others about as often
        for name in (order[0], *order_rest):
            fn = fns[name]
            backend.synchronize()
            t0 = clock()
            for _ in range(calls):
                fn()
            backend.synchronize()
            out[name].append((clock() - t0) * 1e3 / calls)
    return out


def work_clock(backend: hal.Backend) -> Callable[[], float]:
    """The clock that times a call's work: the wall clock on a device; this process's CPU time where the device
    is the CPU (``fake``), whose work is all this process's own, and which the load of other processes on a shared
    machine does not stretch as it stretches the wall clock."""
    return time.process_time if backend.torch_device().type == "cpu" else time.perf_counter


def round_ratios(times: Mapping[str, list[float]], numerator: str, denominator: str) -> list[float]:
    """``numerator`` over ``denominator``, round by round, from :func:`interleaved_ms`."""
    return [a / b for a, b in zip(times[numerator], times[denominator], strict=True)]


def settle() -> None:
    """Collect the garbage there is, then put every object alive (the model, the modules imported, the figures so
    far) out of the garbage collector's sight: later collections read only what was made since."""
    gc.collect()
    gc.freeze()


@contextlib.contextmanager
def settled_heap() -> Iterator[Callable[[], None]]:
    """A block of runs that each close with a garbage collection (a runner's close, a sleep case): ``settle()``
    (:func:`settle`) before each keeps those collections to what the run made (on a CPU 0.15 s less each); every
    object goes back to the collector's sight when the block ends."""
    try:
        yield settle
    finally:
        gc.unfreeze()
