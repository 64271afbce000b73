"""Time mapping N chunks into one range: cuMemSetAccess per chunk vs one per contiguous run.

Prints one line per variant with microseconds per chunk (map + access), and
the unmap cost.
"""

from __future__ import annotations

import argparse
import time

import hal


def run(be: hal.Backend, n: int, deferred: bool) -> tuple[float, float]:
    g = be.granularity
    va = be.create_vir_ptr(n * g)
    handles = [be.create_phy_mem_handle(g) for _ in range(n)]
    t0 = time.perf_counter()
    if deferred:
        with be.plugin.deferred_access():
            for i, h in enumerate(handles):
                be.map(va + i * g, g, h)
    else:
        for i, h in enumerate(handles):
            be.map(va + i * g, g, h)
    t_map = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i in range(n):
        be.unmap(va + i * g, g)
    t_unmap = time.perf_counter() - t0
    for h in handles:
        be.release_phy_mem_handle(h)
    be.release_vir_ptr(va, n * g)
    return t_map / n * 1e6, t_unmap / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--chunks", default="16,256")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    with hal.get_backend("cuda") as be:
        print(f"granularity {be.granularity >> 20} MiB (recommended {be.recommended_granularity >> 20} MiB)")
        run(be, 4, False)
        for n in (int(c) for c in args.chunks.split(",")):
            for deferred in (False, True, False, True):
                best = min(run(be, n, deferred) for _ in range(args.repeat))
                label = "one cuMemSetAccess per run " if deferred else "cuMemSetAccess per chunk  "
                print(f"{n:4d} chunks, {label}: map+access {best[0]:7.1f} us/chunk, unmap {best[1]:6.1f} us/chunk")


if __name__ == "__main__":
    main()
