"""nano-vllm's graph memory and capture time per adoption mode, capture order and rank, in interleaved processes.

    python tests/cuda_scripts/nanovllm/bench.py --modes own,scope,port --orders descending,ascending \
        --rounds 3 [--tp 2] --out DIR

One process per (round, order, mode), the modes rotated from round to round; a first throwaway process fills
torch.compile's cache (nano-vllm compiles parts of its model during its first capture, and a cold cache would
charge whichever mode ran first). Also the largest size alone (the engine's own pool, one graph: the floor).
Writes DIR/nanovllm.json: per mode, order and rank the median, minimum and maximum of graph memory (the
driver's free memory before and after ``capture_cudagraph``) and capture seconds, and every run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

RUN = Path(__file__).with_name("run.py")


def one(args: argparse.Namespace, mode: str, order: str, out: Path, largest: bool = False) -> dict | None:
    cmd = [sys.executable, str(RUN), "--mode", mode, "--order", order, "--tp", str(args.tp), "--out", str(out),
           "--measure-only"]
    proc = subprocess.run(cmd + (["--largest-alone"] if largest else []), capture_output=True, text=True,
                          timeout=args.timeout)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if proc.returncode or line is None:
        print(f"FAILED {mode} {order}: {(proc.stdout + proc.stderr)[-1500:]}", flush=True)
        return None
    result = json.loads(line[len("RESULT "):])
    print(mode, order, {r: (f["graph_bytes"] >> 20, round(f["capture_s"], 2)) for r, f in result["ranks"].items()},
          flush=True)
    return result


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default="own,scope,port")
    parser.add_argument("--orders", default="descending,ascending")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    modes, orders = args.modes.split(","), args.orders.split(",")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    one(args, "own", "descending", out / "warm")  # torch.compile's cache, for every later process
    runs: list[dict] = []
    for r in range(args.rounds):
        for order in orders:
            for k in range(len(modes)):
                mode = modes[(k + r) % len(modes)]
                result = one(args, mode, order, out / f"{mode}-{order}-{r}")
                if result is not None:
                    runs.append(result)
    alone = one(args, "own", "descending", out / "alone", largest=True)
    summary: dict = {}
    for run in runs:
        for rank, figures in run["ranks"].items():
            cell = summary.setdefault(f"{run['mode']} {run['order']} rank {rank}", {"mib": [], "s": []})
            cell["mib"].append(figures["graph_bytes"] / 2**20)
            cell["s"].append(figures["capture_s"])
    table = {name: {"graph_mib": spread(c["mib"]), "capture_s": spread(c["s"])} for name, c in summary.items()}
    largest = {rank: f["graph_bytes"] / 2**20 for rank, f in alone["ranks"].items()} if alone else None
    (out / "nanovllm.json").write_text(json.dumps({"table": table, "largest_alone_mib": largest, "runs": runs},
                                                  indent=1))
    for name, cell in sorted(table.items()):
        print(f"{name:32s} {cell['graph_mib']['median']:8.1f} MiB "
              f"[{cell['graph_mib']['min']:.1f}-{cell['graph_mib']['max']:.1f}]  "
              f"{cell['capture_s']['median']:6.2f} s [{cell['capture_s']['min']:.2f}-{cell['capture_s']['max']:.2f}]")
    print("largest alone (own pool, one graph):", largest)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
