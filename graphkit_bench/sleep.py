"""``python -m graphkit bench --sleep``: pause and resume against torch_memory_saver, in one run.

For each size (1, 4 and 16 GiB on a device; ``--sleep-sizes`` in MiB): a tag of
that many bytes made through :meth:`MemorySaver.region`, an
:class:`graphkit.ElasticBuffer` of that many bytes grown in eight steps, hal's
bare calls on one chunk of that many bytes (the driver's share; with a backup,
a pinned copy each way around them), and torch_memory_saver where it is
installed, each paused and resumed without and with a backup, with device
memory while asleep against the baseline. A size the device (or, for the
backup rows, the host) has not the memory for is left out with the reason
printed. The pinned host<->device copy bandwidth is measured in the same run
and printed as the limit a backup can reach.

Every timed pause and resume starts on an idle device (the work queued before
it, such as the writes of the memory paused, is waited for untimed) and ends
once the device is idle again.

graphkit and torch_memory_saver alternate: ``rounds`` rounds per size and
backup, each running both with a fresh tag of ``cycles`` cycles, the one that
goes first swapping every round. Each figure is the median of every cycle of
every round with its range (min-max); the first pause and resume of each fresh
tag (where one-time costs such as pinning host memory fall) are reported
apart, as their own median and range over the rounds.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import graphkit
import hal
from graphkit_bench.fair import fmt_spread, rotated, spread
from graphkit_bench.timing import settled_heap
from hal.types import fmt_bytes, round_up

log = logging.getLogger("graphkit.bench")

GIB = 1 << 30
DEVICE_SIZES = [1 * GIB, 4 * GIB, 16 * GIB]
CPU_SIZES = [16 << 20, 64 << 20]
#: a backup must reach this share of the pinned copy bandwidth
BANDWIDTH_SHARE = 0.8
#: a tag's first pause at most this many times its steady pause
FIRST_PAUSE_RATIO = 1.2
#: an elastic buffer's pause + resume without backup at most this many times torch_memory_saver's
ELASTIC_TMS_RATIO = 2.0
#: leave this share of the device's (and the host's) free memory alone
HEADROOM = 0.9
#: steps an elastic buffer grows in before it is paused (a chunk each)
ELASTIC_STEPS = 8
#: the rows, in the order shown
IMPLS = ("graphkit", "graphkit-elastic", "torch_memory_saver", "hal calls")


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
    """Seconds ``fn`` takes from an idle device to an idle device: queued work is waited for first, untimed."""
    be.synchronize()
    t0 = time.perf_counter()
    fn()
    be.synchronize()
    return time.perf_counter() - t0


def _touch(data: torch.Tensor, backup: bool) -> None:
    """Write memory that woke without its bytes (untimed), as an engine writes its KV cache before it pauses again:
    releasing memory that was written can cost more than releasing memory that never was (on ``fake``, freeing the
    pages), so every pause must find it written, the first as the later ones."""
    if not backup:
        data.fill_(1)


def _cycle_tag(be: hal.Backend, saver: graphkit.MemorySaver, data: torch.Tensor, expected: torch.Tensor | None,
               backup: bool, cycles: int, used0: int) -> dict[str, Any]:
    """Pause and resume the saver's tag ``bench`` ``cycles`` times: median pause and resume, the memory used above
    ``used0`` while asleep, and whether ``data`` (bytes) woke equal to ``expected``, every 4096th of it, when kept."""
    pauses, resumes, asleep = [], [], []
    for _ in range(cycles):
        pauses.append(_timed(be, lambda: saver.pause("bench")))
        asleep.append(be.mem_info().used - used0)
        resumes.append(_timed(be, lambda: saver.resume("bench")))
        _touch(data, backup)
    exact = expected is None or torch.equal(data[:: max(data.numel() // 4096, 1)], expected)
    return {"pause_s": statistics.median(pauses), "resume_s": statistics.median(resumes), "asleep_bytes": max(asleep),
            "asleep_each": asleep, "pauses": pauses, "resumes": resumes, "exact": exact}


def graphkit_case(be: hal.Backend, nbytes: int, backup: bool, cycles: int) -> dict[str, Any]:
    """Pause and resume one tag of ``nbytes`` through graphkit."""
    gc.collect()
    saver = graphkit.MemorySaver(be)
    used0 = be.mem_info().used
    with saver.region("bench", backup=backup):
        data = torch.empty(nbytes, dtype=torch.uint8, device=be.torch_device())
    data.random_(0, 255)
    expected = data[:: max(nbytes // 4096, 1)].clone() if backup else None
    saver.wait_for_backups("bench")  # the buffers made in the background: done, as an engine's work between lets them
    cycled = _cycle_tag(be, saver, data, expected, backup, cycles, used0)
    del data, expected
    saver.close()
    gc.collect()
    if be.torch_device().type != "cpu":
        getattr(torch, be.torch_device().type).empty_cache()
    return {"impl": "graphkit", "bytes": nbytes, "backup": backup, **cycled}


def elastic_case(be: hal.Backend, nbytes: int, backup: bool, cycles: int) -> dict[str, Any]:
    """The same through an :class:`graphkit.ElasticBuffer` grown in eight steps, as a KV cache grows: a chunk per
    step (eight unmaps and releases a pause, eight creations and maps a resume), and with ``backup`` its host copy
    made in the background as it grows.

    The background work is let finish before the first pause, as the rollout between growth and a pause lets
    it in an engine: the first pause then shows what a first copy into fresh host memory costs, nothing else.
    """
    gc.collect()
    saver = graphkit.MemorySaver(be)
    used0 = be.mem_info().used
    buf = graphkit.ElasticBuffer(be, max_bytes=nbytes, saver=saver, tag="bench", backup=backup)
    for step in range(1, ELASTIC_STEPS + 1):
        buf.resize(nbytes * step // ELASTIC_STEPS)
    chunks = buf.chunk_count
    data = buf.view(torch.uint8, (nbytes,))
    data.random_(0, 255)
    expected = data[:: max(nbytes // 4096, 1)].clone() if backup else None
    buf.wait_for_backup()
    cycled = _cycle_tag(be, saver, data, expected, backup, cycles, used0)
    del data, expected
    buf.close()
    saver.close()
    return {"impl": "graphkit-elastic", "bytes": nbytes, "backup": backup, **cycled, "pin_s": buf.pin_seconds,
            "chunks": chunks}


def hal_case(be: hal.Backend, nbytes: int, backup: bool, cycles: int) -> dict[str, Any]:
    """The driver's share: one chunk of the same bytes unmapped and released, then made and mapped again, by hal's
    calls alone (no saver, no region); with ``backup``, a pinned copy to the host before the unmap and back after
    the map (the host buffer made untimed, once). graphkit's pause and resume less these is graphkit's own."""
    gc.collect()
    size = round_up(nbytes, be.granularity)
    used0 = be.mem_info().used
    ptr = be.create_vir_ptr(size)
    chunk = [be.create_phy_mem_handle(size)]
    be.map(ptr, size, chunk[0])
    be.tensor_at(ptr, nbytes).random_(0, 255)
    pin = be.torch_device().type != "cpu"
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin) if backup else None
    expected = be.tensor_at(ptr, nbytes)[:: max(nbytes // 4096, 1)].clone() if backup else None

    def pause() -> None:
        if host is not None:
            host.copy_(be.tensor_at(ptr, nbytes), non_blocking=pin)
            be.synchronize()
        be.unmap(ptr, size)
        be.release_phy_mem_handle(chunk.pop())

    def resume() -> None:
        chunk.append(be.create_phy_mem_handle(size))
        be.map(ptr, size, chunk[0])
        if host is not None:
            be.tensor_at(ptr, nbytes).copy_(host, non_blocking=pin)
            be.synchronize()

    pauses, resumes, asleep = [], [], []
    for _ in range(cycles):
        pauses.append(_timed(be, pause))
        asleep.append(be.mem_info().used - used0)
        resumes.append(_timed(be, resume))
        _touch(be.tensor_at(ptr, nbytes), backup)
    exact = expected is None or torch.equal(be.tensor_at(ptr, nbytes)[:: max(nbytes // 4096, 1)], expected)
    be.synchronize()  # nothing queued on the chunk when it goes
    host = None
    pause()
    be.release_vir_ptr(ptr, size)
    return {"impl": "hal calls", "bytes": nbytes, "backup": backup, "pause_s": statistics.median(pauses),
            "resume_s": statistics.median(resumes), "asleep_bytes": max(asleep), "asleep_each": asleep,
            "pauses": pauses, "resumes": resumes, "exact": exact}


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
        _touch(data, backup)
    exact = expected is None or torch.equal(data[:: max(nbytes // 4096, 1)], expected)
    del data
    gc.collect()
    torch.cuda.empty_cache()
    return {"impl": "torch_memory_saver", "bytes": nbytes, "backup": backup, "pause_s": statistics.median(pauses),
            "resume_s": statistics.median(resumes), "asleep_bytes": max(asleep), "asleep_each": asleep,
            "pauses": pauses, "resumes": resumes, "exact": exact}


def merge_rounds(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One row from the rounds of one (impl, size, backup): medians of every cycle with their spread, and the
    first pause and resume of each round's fresh tag apart."""
    pauses = [t for r in rounds for t in r["pauses"]]
    resumes = [t for r in rounds for t in r["resumes"]]
    asleep = [b for r in rounds for b in r["asleep_each"]]
    first = rounds[0]
    steady = statistics.median(pauses)
    first_pause = spread(r["pauses"][0] for r in rounds)
    row = {"impl": first["impl"], "bytes": first["bytes"], "backup": first["backup"], "rounds": len(rounds),
           "pause_s": steady, "resume_s": statistics.median(resumes),
           "pause": spread(pauses), "resume": spread(resumes), "first_pause": first_pause,
           "first_over_steady": first_pause["median"] / steady if steady else None,
           "first_resume": spread(r["resumes"][0] for r in rounds),
           "asleep_bytes": max(asleep), "asleep_each": asleep, "exact": all(r["exact"] for r in rounds)}
    if "chunks" in first:
        row["chunks"] = first["chunks"]
    return row


def _row(rows: list[dict[str, Any]], impl: str, nbytes: int, backup: bool) -> dict[str, Any] | None:
    return next((r for r in rows if r["impl"] == impl and r["bytes"] == nbytes and r["backup"] == backup), None)


def vs_bare_calls(rows: list[dict[str, Any]]) -> None:
    """Each row's pause + resume over that of hal's bare calls at the same size and backup (``vs_hal``)."""
    for row in rows:
        bare = _row(rows, "hal calls", row["bytes"], row["backup"])
        total = bare["pause_s"] + bare["resume_s"] if bare is not None else 0
        row["vs_hal"] = (row["pause_s"] + row["resume_s"]) / total if total else None


def room_for(be: hal.Backend, nbytes: int, backup: bool) -> str | None:
    """Why a case of ``nbytes`` (with ``backup``: that much host memory too) cannot run now; None if it can."""
    gc.collect()
    if be.torch_device().type != "cpu":
        getattr(torch, be.torch_device().type).empty_cache()
    free = be.mem_info().free
    if nbytes > HEADROOM * free:
        return f"needs {fmt_bytes(nbytes)} of device memory, more than {HEADROOM:.0%} of the {fmt_bytes(free)} free"
    if backup and be.torch_device().type != "cpu":
        try:
            host = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError):
            return None
        if nbytes > HEADROOM * host:
            return (f"needs {fmt_bytes(nbytes)} of host memory for the backup, more than {HEADROOM:.0%} of the "
                    f"{fmt_bytes(host)} available")
    return None


def sleep_targets(rows: list[dict[str, Any]], granularity: int, bandwidth: dict[str, float],
                  pinned: bool = True) -> list[dict[str, Any]]:
    """graphkit's targets, judged on the rows: memory asleep, backup bandwidth, torch_memory_saver without backup,
    and the first pause of a fresh tag against its steady pauses.

    :param pinned: whether backups are pinned copies over a bus; without (the device is the host) the bandwidth
        targets are not judged (``met`` None).
    """
    targets = []
    for row in rows:
        if row["impl"] == "graphkit-elastic" and not row["backup"]:
            tms = _row(rows, "torch_memory_saver", row["bytes"], False)
            if tms is not None:
                ours, theirs = row["pause_s"] + row["resume_s"], tms["pause_s"] + tms["resume_s"]
                targets.append({"target": f"graphkit-elastic pause + resume {fmt_bytes(row['bytes'])} without "
                                          f"backup: <= {ELASTIC_TMS_RATIO} x torch_memory_saver",
                                "measured": ours, "limit": ELASTIC_TMS_RATIO * theirs,
                                "met": ours <= ELASTIC_TMS_RATIO * theirs})
        if row["impl"] in ("graphkit", "graphkit-elastic"):
            first, steady = row["first_pause"]["median"], row["pause_s"]
            backup = "with" if row["backup"] else "without"
            targets.append({"target": f"{row['impl']} {fmt_bytes(row['bytes'])} {backup} backup: first pause <= "
                                      f"{FIRST_PAUSE_RATIO} x the steady pause",
                            "measured": first / steady, "limit": FIRST_PAUSE_RATIO,
                            "met": first <= FIRST_PAUSE_RATIO * steady})
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
                                "met": rate >= BANDWIDTH_SHARE * bandwidth[bw] if pinned else None})
            continue
        tms = _row(rows, "torch_memory_saver", row["bytes"], False)
        if tms is not None:
            ours, theirs = row["pause_s"] + row["resume_s"], tms["pause_s"] + tms["resume_s"]
            targets.append({"target": f"pause + resume {fmt_bytes(row['bytes'])} without backup: no slower than "
                                      "torch_memory_saver", "measured": ours, "limit": theirs, "met": ours <= theirs})
    return targets


def run_sleep_bench(backend: str | None, device: int, sizes: list[int] | None, cycles: int, out_dir: Path,
                    command: str, rounds: int = 3) -> int:
    """Every size, without and with backup, graphkit and torch_memory_saver alternating for ``rounds`` rounds;
    JSON and a table."""
    be = hal.get_backend(backend, device=device, requires=("graphs", "custom_pool", "use_pool"))
    skipped: list[dict[str, Any]] = []
    try:
        sizes = sizes or (CPU_SIZES if be.torch_device().type == "cpu" else DEVICE_SIZES)
        fits = [n for n in sizes if room_for(be, n, False) is None]
        bandwidth = copy_bandwidth(be, min(max(fits, default=be.granularity), GIB))
        # one small untimed cycle of each kind first: the driver's one-time setup of pinned copies and
        # of the hooks is process-wide, not memory of the tag measured next
        cases = [graphkit_case, tms_case, elastic_case, hal_case]
        rows = []
        with settled_heap() as settle:  # every case collects garbage before it is timed
            for case in cases if fits else []:
                for backup in (False, True):
                    settle()
                    case(be, min(fits), backup, 1)
            for nbytes in sizes:
                for backup in (False, True):
                    why = room_for(be, nbytes, backup)
                    if why is not None:
                        skipped.append({"bytes": nbytes, "backup": backup, "reason": why})
                        log.warning("sleep bench: %s %s backup left out: %s", fmt_bytes(nbytes),
                                    "with" if backup else "without", why)
                        continue
                    measured: dict[str, list[dict[str, Any]]] = {}
                    for i in range(rounds):  # the one that goes first changes every round
                        for case in rotated(cases, i):
                            settle()
                            row = case(be, nbytes, backup, cycles)
                            if row is not None:
                                measured.setdefault(row["impl"], []).append(row)
                    rows += [merge_rounds(measured[impl]) for impl in IMPLS if impl in measured]
        granularity = be.granularity
        name = be.name
        pinned = be.torch_device().type != "cpu"
    finally:
        be.close()
    vs_bare_calls(rows)
    targets = sleep_targets(rows, granularity, bandwidth, pinned=pinned)
    out = {"command": command, "backend": name, "bandwidth": bandwidth, "rounds": rounds, "cycles": cycles,
           "case_order": "alternated", "rows": rows, "skipped": skipped, "targets": targets}
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "bench-sleep.json"
    path.write_text(json.dumps(out, indent=1))
    print(f"pinned copy bandwidth (the limit of a backup): d2h {bandwidth['d2h'] / 1e9:.1f} GB/s, "
          f"h2d {bandwidth['h2d'] / 1e9:.1f} GB/s")
    print(f"{rounds} rounds of {cycles} cycles, alternated; ms as median (min-max); first/steady: the first pause "
          "of a fresh tag over the steady one; vs hal: pause + resume over hal's bare calls (same size and backup)")
    print(f"{'impl':<20}{'size':>10}{'backup':>8}{'pause ms':>24}{'resume ms':>24}{'first pause ms':>24}"
          f"{'first/steady':>14}{'first resume ms':>24}{'vs hal':>8}{'asleep':>11}  exact")
    for r in rows:
        ratio = "-" if r["first_over_steady"] is None else f"{r['first_over_steady']:.2f}"
        bare = "-" if r["vs_hal"] is None else f"{r['vs_hal']:.2f}"
        print(f"{r['impl']:<20}{fmt_bytes(r['bytes']):>10}{'yes' if r['backup'] else 'no':>8}"
              + "".join(f"{fmt_spread(r[k], 1e3, 2):>24}" for k in ("pause", "resume", "first_pause"))
              + f"{ratio:>14}{fmt_spread(r['first_resume'], 1e3, 2):>24}{bare:>8}"
              + f"{fmt_bytes(r['asleep_bytes']):>11}  {'yes' if r['exact'] else 'NO'}")
    for skip in skipped:
        print(f"{'(every impl)':<20}{fmt_bytes(skip['bytes']):>10}{'yes' if skip['backup'] else 'no':>8}  "
              f"left out: {skip['reason']}")
    if not any(r["impl"] == "torch_memory_saver" for r in rows):
        print("torch_memory_saver: no rows (it runs on CUDA only, where it is installed: pip install "
              "torch_memory_saver)")
    for t in targets:
        state = {True: "met ", False: "MISS", None: "not judged (no pinned copies on this device)"}[t["met"]]
        print(f"  {state}  {t['target']}")
    print(f"wrote {path}")
    return 0 if all(r["exact"] for r in rows) else 1
