"""``python -m graphkit bench --sleep``: pause and resume against torch_memory_saver, in one run.

For each size: a tag of that many bytes made through :meth:`MemorySaver.region`,
paused and resumed without and with a backup, device memory while asleep
against the baseline, and the same with torch_memory_saver where it is
installed. The pinned host<->device copy bandwidth is measured in the same
run and printed as the limit a backup can reach.
"""

from __future__ import annotations

import gc
import json
import logging
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import graphkit
import hal
from hal.types import fmt_bytes

log = logging.getLogger("graphkit.bench")

GIB = 1 << 30
DEVICE_SIZES = [1 * GIB, 4 * GIB, 16 * GIB]
CPU_SIZES = [16 << 20, 64 << 20]
#: a backup must reach this share of the pinned copy bandwidth
BANDWIDTH_SHARE = 0.8


def copy_bandwidth(be: hal.Backend, nbytes: int, repeats: int = 3) -> dict[str, float]:
    """Pinned host<->device bytes per second, best of ``repeats`` (the limit a backup can reach)."""
    dev = be.torch_device()
    pin = dev.type != "cpu"
    device_buf = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    out: dict[str, float] = {}
    for name, dst, src in (("d2h", host, device_buf), ("h2d", device_buf, host)):
        best = float("inf")
        for _ in range(repeats):
            be.synchronize()
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=pin)
            be.synchronize()
            best = min(best, time.perf_counter() - t0)
        out[name] = nbytes / best
    del device_buf, host
    return out


def _timed(be: hal.Backend, fn: Callable[[], Any]) -> float:
    be.synchronize()
    t0 = time.perf_counter()
    fn()
    be.synchronize()
    return time.perf_counter() - t0


def graphkit_case(be: hal.Backend, nbytes: int, backup: bool, cycles: int) -> dict[str, Any]:
    """Pause and resume one tag of ``nbytes`` through graphkit."""
    gc.collect()
    saver = graphkit.MemorySaver(be)
    used0 = be.mem_info().used
    with saver.region("bench", backup=backup):
        data = torch.empty(nbytes, dtype=torch.uint8, device=be.torch_device())
    data.random_(0, 255)
    expected = data[:: max(nbytes // 4096, 1)].clone() if backup else None
    pauses, resumes, asleep = [], [], []
    for _ in range(cycles):
        pauses.append(_timed(be, lambda: saver.pause("bench")))
        asleep.append(be.mem_info().used - used0)
        resumes.append(_timed(be, lambda: saver.resume("bench")))
    exact = expected is None or torch.equal(data[:: max(nbytes // 4096, 1)], expected)
    del data, expected
    saver.close()
    gc.collect()
    if be.torch_device().type != "cpu":
        getattr(torch, be.torch_device().type).empty_cache()
    return {"impl": "graphkit", "bytes": nbytes, "backup": backup, "pause_s": statistics.median(pauses),
            "resume_s": statistics.median(resumes), "asleep_bytes": max(asleep), "asleep_each": asleep,
            "exact": exact}


def _tms_in_process(tms: Any) -> None:
    """Use torch_memory_saver's in-process allocator hook unless it was preloaded.

    Its default hook needs ``LD_PRELOAD`` set before Python starts; the
    ``"torch"`` hook goes through torch's pluggable allocator and needs nothing.
    """
    import os

    if "torch_memory_saver" in os.environ.get("LD_PRELOAD", "") or getattr(tms, "_impl", None) is not None:
        return
    tms.hook_mode = "torch"
    log.info("torch_memory_saver: hook_mode='torch' (no LD_PRELOAD)")


def tms_case(be: hal.Backend, nbytes: int, backup: bool, cycles: int) -> dict[str, Any] | None:
    """The same through torch_memory_saver, where it is installed (CUDA only)."""
    if be.torch_device().type != "cuda":
        return None
    try:
        from torch_memory_saver import torch_memory_saver as tms
    except ImportError:
        return None
    _tms_in_process(tms)
    gc.collect()
    used0 = be.mem_info().used
    tag = f"bench-{nbytes}-{int(backup)}"
    with tms.region(tag=tag, enable_cpu_backup=backup):
        data = torch.empty(nbytes, dtype=torch.uint8, device=be.torch_device())
    data.random_(0, 255)
    expected = data[:: max(nbytes // 4096, 1)].clone() if backup else None
    pauses, resumes, asleep = [], [], []
    for _ in range(cycles):
        pauses.append(_timed(be, lambda: tms.pause(tag)))
        asleep.append(be.mem_info().used - used0)
        resumes.append(_timed(be, lambda: tms.resume(tag)))
    exact = expected is None or torch.equal(data[:: max(nbytes // 4096, 1)], expected)
    del data
    gc.collect()
    torch.cuda.empty_cache()
    return {"impl": "torch_memory_saver", "bytes": nbytes, "backup": backup, "pause_s": statistics.median(pauses),
            "resume_s": statistics.median(resumes), "asleep_bytes": max(asleep), "asleep_each": asleep,
            "exact": exact}


def run_sleep_bench(backend: str | None, device: int, sizes: list[int] | None, cycles: int, out_dir: Path,
                    command: str) -> int:
    """Every size, without and with backup, graphkit and torch_memory_saver; JSON and a table."""
    be = hal.get_backend(backend, device=device, requires=("graphs", "custom_pool", "use_pool"))
    try:
        sizes = sizes or (CPU_SIZES if be.torch_device().type == "cpu" else DEVICE_SIZES)
        bandwidth = copy_bandwidth(be, min(max(sizes), GIB))
        # one small untimed cycle of each kind first: the driver's one-time setup of pinned copies and
        # of the hooks is process-wide, not memory of the tag measured next
        for case in (graphkit_case, tms_case):
            for backup in (False, True):
                case(be, min(sizes), backup, 1)
        rows = []
        for nbytes in sizes:
            for backup in (False, True):
                for case in (graphkit_case, tms_case):
                    row = case(be, nbytes, backup, cycles)
                    if row is not None:
                        rows.append(row)
        granularity = be.granularity
        name = be.name
    finally:
        be.close()
    targets = []
    for row in rows:
        if row["impl"] != "graphkit":
            continue
        targets.append({"target": f"asleep {fmt_bytes(row['bytes'])}: device memory within one granule of the "
                                  "baseline", "measured": row["asleep_bytes"], "limit": granularity,
                        "met": row["asleep_bytes"] <= granularity})
        if row["backup"]:
            for what, key, bw in (("pause", "pause_s", "d2h"), ("resume", "resume_s", "h2d")):
                rate = row["bytes"] / row[key]
                targets.append({"target": f"{what} with backup {fmt_bytes(row['bytes'])}: >= {BANDWIDTH_SHARE:.0%} "
                                          f"of the pinned {bw} bandwidth", "measured": rate,
                                "limit": BANDWIDTH_SHARE * bandwidth[bw],
                                "met": rate >= BANDWIDTH_SHARE * bandwidth[bw]})
        else:
            tms = next((r for r in rows if r["impl"] == "torch_memory_saver" and r["bytes"] == row["bytes"]
                        and not r["backup"]), None)
            if tms is not None:
                ours, theirs = row["pause_s"] + row["resume_s"], tms["pause_s"] + tms["resume_s"]
                targets.append({"target": f"pause + resume {fmt_bytes(row['bytes'])} without backup: no slower than "
                                          "torch_memory_saver", "measured": ours, "limit": theirs,
                                "met": ours <= theirs})
    out = {"command": command, "backend": name, "bandwidth": bandwidth, "rows": rows, "targets": targets}
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "bench-sleep.json"
    path.write_text(json.dumps(out, indent=1))
    print(f"pinned copy bandwidth (the limit of a backup): d2h {bandwidth['d2h'] / 1e9:.1f} GB/s, "
          f"h2d {bandwidth['h2d'] / 1e9:.1f} GB/s")
    print(f"{'impl':<20}{'size':>10}{'backup':>8}{'pause ms':>11}{'resume ms':>11}{'asleep':>11}  exact")
    for r in rows:
        print(f"{r['impl']:<20}{fmt_bytes(r['bytes']):>10}{'yes' if r['backup'] else 'no':>8}"
              f"{r['pause_s'] * 1e3:>11.2f}{r['resume_s'] * 1e3:>11.2f}{fmt_bytes(r['asleep_bytes']):>11}  "
              f"{'yes' if r['exact'] else 'NO'}")
    for t in targets:
        print(f"  {'met ' if t['met'] else 'MISS'}  {t['target']}")
    print(f"wrote {path}")
    return 0 if all(r["exact"] for r in rows) else 1
