"""``python -m graphkit bench --elastic``: elastic growth against a bare map and allocate-and-copy, in one run.

* Grow latency per granule, each the median over many single-granule grows of
  a :class:`graphkit.ElasticBuffer`: (a) mapping chunks pre-created into an
  :class:`graphkit.ElasticReservation`'s free list, (b) with a fresh physical
  allocation per granule, and (c) the baseline measured in the same run,
  interleaved with them: a bare ``be.map`` of one granule (on CUDA hal's map
  is ``cuMemMap`` + ``cuMemSetAccess``). These are host-side driver calls,
  timed without synchronising the device.
* (d) Allocate-and-copy regrowth at each size (1, 4 and 16 GiB on a device,
  16 and 64 MiB on a CPU): the time to grow a tensor of that size by one
  granule by allocating size + granule and copying, next to an elastic
  buffer of that size growing by one granule. Sizes the device cannot hold
  twice are left out.
* (e) Physical bytes against used bytes over a growing run of one elastic
  buffer, growing by uneven steps; a stamp written into each new part is
  read back at the end, and the address must never move.

Copies are counted, not assumed: every elastic growth runs inside a mode that
counts the bytes of every framework copy issued (``copy_``, ``cat``, ``clone``...).
"""

from __future__ import annotations

import functools
import gc
import json
import logging
import random
import statistics
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch.overrides import TorchFunctionMode

import graphkit
import hal
from graphkit.graphs.capture import release_cached_memory
from graphkit_bench.fair import fmt_spread, rotated, spread
from graphkit_bench.timing import Thunk
from hal.types import fmt_bytes, round_up

log = logging.getLogger("graphkit.bench")

GIB = 1 << 30
DEVICE_SIZES = [1 * GIB, 4 * GIB, 16 * GIB]
CPU_SIZES = [16 << 20, 64 << 20]
#: free-list growth must cost at most this many times a bare map of one granule
FREE_LIST_RATIO = 1.3
#: single-granule grows: granules per round and rounds (device, CPU)
DEVICE_GROWS = (64, 8)
CPU_GROWS = (8, 16)
#: steps of the growing run
TRACE_STEPS = 256
#: regrowth and elastic grows per size (the median is shown)
CYCLES = 5
#: leave this share of the device's free memory alone
HEADROOM = 0.9


class CopyCounter(TorchFunctionMode):
    """Counts the bytes moved by every framework copy issued inside it (``copy_``, ``cat``, ``t[a:b] = x``...)."""

    SOURCE_ARG: ClassVar[dict[str, int]] = {"copy_": 1, "clone": 0, "index_copy": 3, "index_copy_": 3, "__setitem__": 2}
    CONCAT: ClassVar[set[str]] = {"cat", "concat", "concatenate"}

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0
        self.calls = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        moved: list[Any] = []
        if name in self.CONCAT:
            moved = list(args[0] if args else kwargs.get("tensors", ()))
        elif name in self.SOURCE_ARG and len(args) > self.SOURCE_ARG[name]:
            moved = [args[self.SOURCE_ARG[name]]]
        sizes = [t.numel() * t.element_size() for t in moved if isinstance(t, torch.Tensor)]
        if sizes:
            self.bytes += sum(sizes)
            self.calls += 1
        return func(*args, **kwargs)


# -- plain device memory -------------------------------------------------------------------------


class _Plain:
    """Owner of one plain allocation; it goes when the last tensor over it does."""


def _release_plain(be: hal.Backend, ptr: int, size: int, handle: Any) -> None:
    if be.closed:
        return
    be.unmap(ptr, size, wait=True)  # the last tensor over it may have work still queued
    be.release_phy_mem_handle(handle)
    be.release_vir_ptr(ptr, size)


def device_empty(be: hal.Backend, nbytes: int) -> torch.Tensor:
    """``nbytes`` of device memory as a ``uint8`` tensor, as a plain allocation gets it.

    ``torch.empty`` on a device; where the framework's device is the CPU (``fake``),
    one driver allocation of its own, rounded to the granularity, so that the fake
    device's memory counts it.
    """
    dev = be.torch_device()
    if dev.type != "cpu":
        return torch.empty(nbytes, dtype=torch.uint8, device=dev)
    size = round_up(max(nbytes, 1), be.granularity)
    ptr = be.create_vir_ptr(size)
    try:
        handle = be.create_phy_mem_handle(size)
        try:
            be.map(ptr, size, handle)
        except BaseException:
            be.release_phy_mem_handle(handle)
            raise
    except BaseException:
        be.release_vir_ptr(ptr, size)
        raise
    owner = _Plain()
    weakref.finalize(owner, _release_plain, be, ptr, size, handle)
    return be.tensor_at(ptr, nbytes, owner=owner)


def _release_cached(be: hal.Backend) -> None:
    """Collect what Python dropped, then give the framework's cached memory back to the device."""
    gc.collect()
    release_cached_memory(be)


@contextmanager
def _quiet_gc() -> Iterator[None]:
    """No garbage collection inside timed loops."""
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _host_timed(fn: Thunk) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _device_timed(be: hal.Backend, fn: Thunk) -> float:
    be.synchronize()
    t0 = time.perf_counter()
    fn()
    be.synchronize()
    return time.perf_counter() - t0


def _summary(samples: list[float]) -> dict[str, Any]:
    ordered = sorted(samples)
    return {"median_s": statistics.median(ordered), "p10_s": ordered[len(ordered) // 10],
            "p90_s": ordered[(9 * len(ordered)) // 10], "min_s": ordered[0], "samples": len(ordered)}


# -- (a), (b), (c): one granule at a time ------------------------------------------------------------


def grow_cases(be: hal.Backend, granules: int, rounds: int) -> dict[str, Any]:
    """Single-granule grows from the free list, with fresh chunks, and bare maps, round by round in turn."""
    g = be.granularity
    calls = be.accounting.calls
    # (c) the baseline: a range and chunks of its own, mapped one granule at a time by hal directly
    base_ptr = be.create_vir_ptr(granules * g)
    handles = [be.create_phy_mem_handle(g) for _ in range(granules)]
    # (a) the free list: every chunk pre-created
    warm = graphkit.ElasticReservation(be, reserve_bytes=granules * g, precreate_bytes=granules * g)
    warm_buf = warm.buffer(granules * g)
    # (b) fresh: nothing pre-created, the free list emptied after every round
    cold = graphkit.ElasticReservation(be, reserve_bytes=granules * g)
    cold_buf = cold.buffer(granules * g)
    bare: list[float] = []
    free_list: list[float] = []
    fresh: list[float] = []
    driver_allocs = {"free_list": 0, "fresh": 0}
    copies = CopyCounter()
    try:
        with _quiet_gc():
            def bare_round() -> None:
                for i in range(granules):
                    bare.append(_host_timed(lambda i=i: be.map(base_ptr + i * g, g, handles[i])))
                for i in range(granules):
                    be.unmap(base_ptr + i * g, g)

            def grow_round(buf: graphkit.ElasticBuffer, samples: list[float], kind: str) -> None:
                """Grow ``buf`` a granule at a time to the full range, timing each grow, then shrink it to 0."""
                made = calls["create_phy_mem_handle"]
                with copies:
                    for i in range(1, granules + 1):
                        samples.append(_host_timed(lambda i=i: buf.resize(i * g)))
                driver_allocs[kind] += calls["create_phy_mem_handle"] - made
                buf.resize(0)  # the chunks go back to the free list

            def free_list_round() -> None:
                grow_round(warm_buf, free_list, "free_list")

            def fresh_round() -> None:
                grow_round(cold_buf, fresh, "fresh")
                cold.trim()  # the next round allocates again

            for r in range(rounds):  # which kind goes first rotates from round to round
                for kind in rotated([bare_round, free_list_round, fresh_round], r):
                    kind()
    finally:
        warm.close()
        cold.close()
        for h in handles:
            be.release_phy_mem_handle(h)
        be.release_vir_ptr(base_ptr, granules * g)
    return {"granules": granules, "rounds": rounds, "bare_map": _summary(bare), "free_list": _summary(free_list),
            "fresh": _summary(fresh), "driver_allocations": driver_allocs, "copied_bytes": copies.bytes}


# -- (d): allocate-and-copy at each size ------------------------------------------------------------------


def _free_bytes(be: hal.Backend) -> int:
    _release_cached(be)
    return be.mem_info().free


def _grow_copy(be: hal.Backend, old: torch.Tensor, nbytes: int, g: int, holder: list[torch.Tensor]) -> None:
    """Allocate ``nbytes + g`` and copy ``old`` (``nbytes``) into its start: growth by reallocation."""
    new = device_empty(be, nbytes + g)
    new[:nbytes].copy_(old)
    holder.append(new)


def regrow_case(be: hal.Backend, nbytes: int, cycles: int) -> dict[str, Any]:
    """Grow ``nbytes`` by one granule: allocate-and-copy and an elastic buffer of the same size, alternating
    cycle by cycle (the one that goes first swaps every cycle); medians with their range."""
    g = be.granularity
    row: dict[str, Any] = {"bytes": nbytes}
    need = 3 * nbytes + 2 * g  # the tensor, its regrown copy and the elastic buffer, alive together
    free = _free_bytes(be)
    if need > HEADROOM * free:
        row["skipped"] = f"needs {fmt_bytes(need)}, {fmt_bytes(free)} free"
        return row
    stride = max(nbytes // 4096, 1)
    source = [device_empty(be, nbytes)]  # emptied at the end: the last reference goes before the cache is released
    source[0].fill_(0x5A)
    buf = graphkit.ElasticBuffer(be, max_bytes=nbytes + g)
    regrows: list[float] = []
    grows: list[float] = []
    state = {"regrow_copied": 0, "elastic_copied": 0, "exact": True}

    def regrow() -> None:
        holder: list[torch.Tensor] = []
        with CopyCounter() as copies:
            # bound, not closed over: the `del` below must drop the last reference
            regrows.append(_device_timed(be, functools.partial(_grow_copy, be, source[0], nbytes, g, holder)))
        state["regrow_copied"] = copies.bytes
        state["exact"] = state["exact"] and bool((holder[0][:nbytes:stride] == 0x5A).all())
        del holder
        _release_cached(be)

    def elastic() -> None:
        with CopyCounter() as copies:
            grows.append(_host_timed(lambda: buf.resize(nbytes + g)))
            buf.resize(nbytes)  # the granule back to the buffer's free list; the next grow maps it again
        state["elastic_copied"] += copies.bytes

    try:
        buf.resize(nbytes)
        view = buf.view(torch.uint8, (nbytes,))
        view.fill_(0xA5)
        ptr = buf.ptr
        for i in range(cycles):
            for case in rotated([regrow, elastic], i):
                case()
        exact = bool(state["exact"]) and buf.ptr == ptr and bool((view[::stride] == 0xA5).all())
        del view
        row.update({"regrow_s": statistics.median(regrows), "regrow": spread(regrows),
                    "regrow_copied_bytes": state["regrow_copied"], "elastic_grow_s": statistics.median(grows),
                    "elastic_grow": spread(grows), "elastic_first_grow_s": grows[0],
                    "elastic_copied_bytes": state["elastic_copied"], "exact": exact, "alternations": cycles})
    finally:
        source.clear()
        buf.close()
        _release_cached(be)
    return row


# -- (e): physical against used over a growing run --------------------------------------------------------


def growing_run(be: hal.Backend, total: int, steps: int = TRACE_STEPS, seed: int = 0) -> dict[str, Any]:
    """One elastic buffer grown by uneven steps up to ``total``: used, physical and device bytes at every step."""
    g = be.granularity
    rng = random.Random(seed)
    mean = total / steps
    sizes, used = [], 0
    while used < total:
        used = min(total, used + max(256, round(rng.uniform(0.25, 1.75) * mean / 256) * 256))
        sizes.append(used)
    _release_cached(be)
    base = be.mem_info().used
    buf = graphkit.ElasticBuffer(be, max_bytes=total)
    ptr, trace, stamps, prev = buf.ptr, [], [], 0
    copies = CopyCounter()
    try:
        for i, used in enumerate(sizes):
            with copies:
                buf.resize(used)
            be.synchronize()
            trace.append({"step": i, "used": used, "physical": buf.mapped_bytes + buf.reservation.free_bytes,
                          "device": be.mem_info().used - base})
            stamp = i % 251 + 1
            buf.view(torch.uint8, (used,))[prev] = stamp  # a byte in the part this step added
            stamps.append((prev, stamp))
            prev = used
        whole = buf.view(torch.uint8, (total,))
        where = torch.tensor([p for p, _ in stamps], dtype=torch.long, device=whole.device)
        want = torch.tensor([s for _, s in stamps], dtype=torch.uint8, device=whole.device)
        intact = bool(torch.equal(whole[where], want))
        del whole
        moved = buf.ptr != ptr
    finally:
        buf.close()
        _release_cached(be)
    return {"total_bytes": total, "steps": len(trace), "granularity": g, "trace": trace,
            "max_slack_bytes": max(r["physical"] - r["used"] for r in trace),
            "max_device_slack_bytes": max(r["device"] - r["used"] for r in trace),
            "copied_bytes": copies.bytes, "moved": moved, "intact": intact}


# -- the whole bench ----------------------------------------------------------------------------------------


def run_elastic_bench(backend: str | None, device: int, sizes_bytes: list[int] | None, out_dir: Path,
                      command: str, alternations: int = CYCLES) -> int:
    """Grow latencies, regrowth at every size, a growing run; targets, JSON and a table."""
    be = hal.get_backend(backend, device=device, requires=("graphs",))
    try:
        on_cpu = be.torch_device().type == "cpu"
        sizes = sizes_bytes or (CPU_SIZES if on_cpu else DEVICE_SIZES)
        g = be.granularity
        granules, rounds = CPU_GROWS if on_cpu else DEVICE_GROWS
        if 3 * granules * g > HEADROOM * _free_bytes(be):
            granules = max(1, int(HEADROOM * _free_bytes(be)) // (3 * g))
        grow = grow_cases(be, granules, rounds)
        rows = [regrow_case(be, nbytes, alternations) for nbytes in sizes]
        total = round_up(max(sizes), g)
        if total > HEADROOM * _free_bytes(be):
            total = max(g, int(HEADROOM * _free_bytes(be)) // g * g)
        trace = growing_run(be, total)
        name = be.name
    finally:
        be.close()
    bare, free_list, fresh = (grow[k]["median_s"] for k in ("bare_map", "free_list", "fresh"))
    ratio = free_list / bare
    copied = grow["copied_bytes"] + trace["copied_bytes"] + sum(r.get("elastic_copied_bytes", 0) for r in rows)
    targets = [
        {"target": f"growing run to {fmt_bytes(trace['total_bytes'])}: physical <= used + one granule "
                   f"({fmt_bytes(g)}) at every step", "measured": trace["max_slack_bytes"], "limit": g,
         "met": trace["max_slack_bytes"] <= g},
        {"target": "zero bytes copied on elastic growth (every grow of the run, counted)", "measured": copied,
         "limit": 0, "met": copied == 0 and not trace["moved"]},
        {"target": f"free-list growth median <= {FREE_LIST_RATIO} x a bare map + access of one granule",
         "measured": ratio, "limit": FREE_LIST_RATIO, "met": ratio <= FREE_LIST_RATIO},
    ]
    out = {"command": command, "backend": name, "granularity": g, "grow": grow, "regrow": rows,
           "growing_run": trace, "targets": targets}
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "bench-elastic.json"
    path.write_text(json.dumps(out, indent=1))

    us = 1e6
    print(f"backend {name}, granularity {fmt_bytes(g)}")
    print(f"grow by one granule, median of {grow['bare_map']['samples']} ({grow['granules']} granules x "
          f"{grow['rounds']} rounds, interleaved, the first kind rotating by round):")
    print(f"  bare map + access      {bare * us:>9.1f} us")
    print(f"  elastic, free list     {free_list * us:>9.1f} us  ({ratio:.2f}x the bare map; "
          f"{grow['driver_allocations']['free_list']} driver allocations)")
    print(f"  elastic, fresh chunk   {fresh * us:>9.1f} us  ({fresh / bare:.2f}x; "
          f"{grow['driver_allocations']['fresh']} driver allocations)")
    print(f"grow by one granule at each size, {alternations} alternations, ms as median (min-max):")
    print(f"{'size':>10}{'regrow ms':>26}{'copied':>12}{'elastic ms':>26}{'copied':>10}  exact")
    for r in rows:
        if "skipped" in r:
            print(f"{fmt_bytes(r['bytes']):>10}  left out: {r['skipped']}")
            continue
        print(f"{fmt_bytes(r['bytes']):>10}{fmt_spread(r['regrow'], 1e3):>26}{fmt_bytes(r['regrow_copied_bytes']):>12}"
              f"{fmt_spread(r['elastic_grow'], 1e3):>26}{fmt_bytes(r['elastic_copied_bytes']):>10}  "
              f"{'yes' if r['exact'] else 'NO'}")
    print(f"growing run to {fmt_bytes(trace['total_bytes'])} in {trace['steps']} uneven steps: physical - used "
          f"at most {fmt_bytes(trace['max_slack_bytes'])} ({trace['max_slack_bytes']} B), device - used at most "
          f"{fmt_bytes(trace['max_device_slack_bytes'])}; address {'MOVED' if trace['moved'] else 'fixed'}, "
          f"data {'intact' if trace['intact'] else 'LOST'}")
    for t in targets:
        print(f"  {'met ' if t['met'] else 'MISS'}  {t['target']}")
    print(f"wrote {path}")
    exact = all(r.get("exact", True) for r in rows) and trace["intact"] and not trace["moved"]
    return 0 if exact else 1
