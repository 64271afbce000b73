"""What a shareable handle type costs: the driver's VMM calls per granule with and without it, interleaved.

``python tests/cuda_scripts/bench_shareable.py [GRANULES] [ROUNDS]`` on a GPU. Each round makes GRANULES chunks
(cuMemCreate), maps them side by side (cuMemMap + cuMemSetAccess), unmaps and releases them, once with
``hal.get_backend("cuda", shareable=True)`` and once without, in alternating order; it prints the median
microseconds per granule of each step for both and their ratio (JSON), and the device memory used while the chunks
were held (what a handle type could add is bookkeeping, not device memory).
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import hal

STEPS = ("create", "map", "unmap", "release")


def one_round(shareable: bool, granules: int) -> tuple[dict[str, float], int]:
    """Microseconds per granule of each step, and the device memory the chunks took."""
    with hal.get_backend("cuda", shareable=shareable) as be:
        g = be.granularity
        va = be.create_vir_ptr(granules * g)
        used0 = be.mem_info().used
        times = [time.perf_counter()]
        handles = [be.create_phy_mem_handle(g) for _ in range(granules)]
        times.append(time.perf_counter())
        for i, h in enumerate(handles):
            be.map(va + i * g, g, h)
        times.append(time.perf_counter())
        used = be.mem_info().used - used0
        for i in range(granules):
            be.unmap(va + i * g, g)
        times.append(time.perf_counter())
        for h in handles:
            be.release_phy_mem_handle(h)
        times.append(time.perf_counter())
        be.release_vir_ptr(va, granules * g)
    per = {step: (times[i + 1] - times[i]) / granules * 1e6 for i, step in enumerate(STEPS)}
    return per, used


def spread(rounds: list[dict[str, float]]) -> dict[str, list[float]]:
    """The fastest and slowest round of each step."""
    return {step: [round(min(p[step] for p in rounds), 2), round(max(p[step] for p in rounds), 2)] for step in STEPS}


def main() -> None:
    granules = int(sys.argv[1]) if len(sys.argv) > 1 else 512
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    seen: dict[bool, list[dict[str, float]]] = {True: [], False: []}
    used: dict[bool, int] = {}
    one_round(True, 16)  # the driver's first calls, outside the figures
    for r in range(rounds):
        for shareable in ((True, False) if r % 2 else (False, True)):
            per, used[shareable] = one_round(shareable, granules)
            seen[shareable].append(per)
    med = {s: {step: statistics.median(p[step] for p in seen[s]) for step in STEPS} for s in seen}
    print(json.dumps({
        "granules": granules, "rounds": rounds,
        "us_per_granule_shareable": med[True], "us_per_granule_plain": med[False],
        "ratio": {step: round(med[True][step] / med[False][step], 3) for step in STEPS},
        "spread_shareable": spread(seen[True]), "spread_plain": spread(seen[False]),
        "device_bytes_used": {"shareable": used[True], "plain": used[False]},
    }, indent=1))


if __name__ == "__main__":
    main()
