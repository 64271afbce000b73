"""nano-vllm at several tensor-parallel sizes, with and without graphkit: graph memory and capture time per rank.

    python tests/cuda_scripts/tp_report.py --tps 2,4 --modes own,switch,port \
        --orders descending,ascending --rounds 3 --out DIR [--timeout 300]

Every run is a fresh engine (``nanovllm/run.py --measure-only``: the engine starts, captures its 8 decode sizes
in every rank, and exits), so the processes of different modes interleave: per round, for each TP size and
order, the modes in a rotated order. A first throwaway run per TP size fills torch.compile's cache; a last one
per TP size captures the largest size alone in the engine's own pool (the floor). Each run has its own
rendezvous port and is killed at ``--timeout`` seconds (its ranks with it); a failed or killed run is recorded
with the end of its output and the report goes on.

Per rank, graph memory is the driver's free memory of the rank's device before and after the engine's
``capture_cudagraph``. Where graphkit served the rank, its shared chunks are read from its report (the
switch's line, the port's pools report): *shared* is those chunks, *fixed* the rest of the rank's graph
memory (the first capture's driver cost, library workspaces, the driver's memory per graph), which every
mode pays alike. Writes DIR/tp_report.json (every run, and per TP size, mode, order and rank the median,
minimum, maximum and count) and DIR/tp_report.md (the table, with the ratios to the engine's own pool in the
same order and smallest first, and to the largest size alone). ``--append`` adds this call's runs to those
of an earlier call into the same DIR (rounds split over several calls that each fit a time limit).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

RUN = Path(__file__).resolve().parent / "nanovllm" / "run.py"
ROOT = Path(__file__).resolve().parents[2]
#: the switch's report line (``graphkit: process N, cuda:R: graph pools on cuda (vmm): K key(s), X MiB of chunks``)
SWITCH_LINE = re.compile(r"graphkit: process \d+, cuda:(\d+): graph pools on \w+ \(\w+\): (\d+) key\(s\)[^;]*; "
                         r"memory ([\d.]+) (B|KiB|MiB|GiB) of chunks")
POOLS_REPORT = re.compile(r"(\d+) key\(s\)[^;]*; memory ([\d.]+) (B|KiB|MiB|GiB) of chunks")
UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def gpus() -> int | None:
    """GPUs on this machine, from nvidia-smi (the launcher makes no CUDA context); None where it cannot tell."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return sum(line.startswith("GPU ") for line in out.splitlines())


def run_one(args: argparse.Namespace, mode: str, order: str, tp: int, out: Path, port: int,
            largest: bool = False) -> dict[str, Any]:
    """One engine start in a process group of its own, killed at the deadline; its RESULT, or why none came."""
    cmd = [sys.executable, str(RUN), "--mode", mode, "--order", order, "--tp", str(tp), "--out", str(out),
           "--port", str(port)] + ([] if args.replayed and not largest else ["--measure-only"]) + \
        (["--largest-alone"] if largest else [])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               NANOVLLM_TIMEOUT=str(args.timeout))
    started = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)  # its ranks share its group: one kill takes them all
    try:
        output, _ = proc.communicate(timeout=args.timeout + 30)
        killed = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        killed = True
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # a rank its launcher left behind (the launcher's own timeout)
    record: dict[str, Any] = {"mode": mode, "order": order, "tp": tp, "largest_alone": largest,
                              "wall_s": round(time.monotonic() - started, 1)}
    line = next((x for x in output.splitlines() if x.startswith("RESULT ")), None)
    if killed or proc.returncode or line is None:
        why = "killed at the deadline" if killed else f"exit {proc.returncode}"
        print(f"FAILED tp={tp} {mode} {order}: {why}\n{output[-1500:]}", flush=True)
        return {**record, "failed": why, "tail": output[-4000:]}
    result = json.loads(line[len("RESULT "):])
    shared = shared_bytes(mode, result, output)
    ranks = {rank: {"device": f["device"], "graph_bytes": f["graph_bytes"], "capture_s": f["capture_s"],
                    "contexts": f.get("contexts"), "shared_bytes": shared.get(rank),
                    **{k: f.get(k) for k in ("torch_default_bytes", "torch_pool_bytes", "graphs", "graph_nodes",
                                             "graph_bytes_replayed", "executables")},
                    "survivor_bytes": (f.get("served_chunks") or (result.get("scope_chunks") if rank == "0" else None)
                                       or {}).get("survivor_bytes")}
             for rank, f in result["ranks"].items()}
    print(f"tp={tp} {mode:6s} {order:10s}", {r: (f["graph_bytes"] >> 20, round(f["capture_s"], 2))
                                              for r, f in ranks.items()}, flush=True)
    return {**record, "ranks": ranks}


def shared_bytes(mode: str, result: dict[str, Any], output: str) -> dict[str, int]:
    """Per rank, the bytes of graphkit's chunks where it served: what the rank recorded (the switch's pools, the
    scope's), else the last report line of each device."""
    found: dict[str, int] = {}
    if mode in ("switch", "scope"):  # the scope's spawned ranks are served through the variable it sets
        for match in SWITCH_LINE.finditer(output):
            found[match.group(1)] = int(float(match.group(3)) * UNITS[match.group(4)])
    for rank, figures in result["ranks"].items():
        match = POOLS_REPORT.search(figures.get("pools_report") or "")
        if match is not None:
            found[rank] = int(float(match.group(2)) * UNITS[match.group(3)])
    if mode == "scope" and result.get("scope_report"):
        match = POOLS_REPORT.search(result["scope_report"])
        if match is not None:
            found["0"] = int(float(match.group(2)) * UNITS[match.group(3)])
    if mode == "scope" and result.get("scope_chunks"):
        found["0"] = result["scope_chunks"]["chunk_bytes"]
    for rank, figures in result["ranks"].items():
        if figures.get("served_chunks"):
            found[rank] = figures["served_chunks"]["chunk_bytes"]
    return found


def spread(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def items(mode: str, f: dict[str, Any]) -> dict[str, float] | None:
    """One rank's graph memory split per item, in MiB: the graph pool (graphkit's chunks, or the engine's own
    pool's segments), torch's default pool (workspaces made during the capture) and the rest (the driver's
    memory of the executable graphs, libraries' own allocations, kernels first loaded by the capture); None
    where the run did not record the parts."""
    if f.get("torch_default_bytes") is None:
        return None
    pool = f["shared_bytes"] if mode != "own" else f.get("torch_pool_bytes")
    if pool is None:
        return None
    rest = f["graph_bytes"] - pool - f["torch_default_bytes"]
    split = {"pool": pool / 2**20, "torch_default": f["torch_default_bytes"] / 2**20, "driver_rest": rest / 2**20}
    if f.get("survivor_bytes") is not None:
        split["survivors"] = f["survivor_bytes"] / 2**20
    if f.get("graph_nodes"):
        split["nodes"] = float(f["graph_nodes"])
        split["rest_kib_per_node"] = rest / 1024 / f["graph_nodes"]
    return split


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per (tp, mode, order, rank): the spread of graph MiB, capture seconds, shared MiB and of each item."""
    cells: dict[str, dict[str, list[float]]] = {}
    for run in runs:
        if "ranks" not in run or run["largest_alone"]:
            continue
        for rank, f in run["ranks"].items():
            cell = cells.setdefault(f"{run['tp']}|{run['mode']}|{run['order']}|{rank}",
                                    {"mib": [], "s": [], "shared": [], "replayed": []})
            cell["mib"].append(f["graph_bytes"] / 2**20)
            if f.get("graph_bytes_replayed") is not None:  # --replayed: once every graph was replayed
                cell["replayed"].append(f["graph_bytes_replayed"] / 2**20)
            cell["s"].append(f["capture_s"])
            if f["shared_bytes"] is not None:
                cell["shared"].append(f["shared_bytes"] / 2**20)
            for name, value in (items(run["mode"], f) or {}).items():
                cell.setdefault(name, []).append(value)
    return {key: {"graph_mib": spread(c.pop("mib")), "capture_s": spread(c.pop("s")),
                  "shared_mib": spread(c.pop("shared")), "replayed_mib": spread(c.pop("replayed")),
                  "items": {k: spread(v) for k, v in c.items()}}
            for key, c in cells.items()}


def markdown(table: dict[str, Any], alone: dict[int, dict[str, float]], meta: dict[str, Any]) -> str:
    """The table: per TP size, mode, order and rank, with the ratios the targets are stated in."""
    def median(tp: int, mode: str, order: str, rank: str, what: str) -> float | None:
        cell = table.get(f"{tp}|{mode}|{order}|{rank}")
        return cell[what]["median"] if cell and cell[what] else None

    intro = (f"nano-vllm, 8 decode sizes, {meta['rounds']} round(s) of interleaved processes; {meta['device']}; "
             "medians [min-max] (n). *own* = the engine's own pool in the same order, *own asc* = its own pool "
             "smallest first, *alone* = the largest size alone in its own pool.")
    header = ("| TP | mode | order | rank | graph MiB | shared MiB | fixed MiB | x own | x own asc | x alone "
              "| capture s | x own capture |")
    rows = [intro, "", header, "|" + "---|" * 12]
    for key in sorted(table, key=lambda k: (int(k.split("|")[0]), k)):
        tp_text, mode, order, rank = key.split("|")
        tp, cell = int(tp_text), table[key]
        mib, s, shared = cell["graph_mib"], cell["capture_s"], cell["shared_mib"]

        def ratio(value: float | None, base: float | None) -> str:
            return f"{value / base:.2f}" if value is not None and base else "--"

        own = median(tp, "own", order, rank, "graph_mib")
        own_asc = median(tp, "own", "ascending", rank, "graph_mib")
        own_s = median(tp, "own", order, rank, "capture_s")
        shared_text = f"{shared['median']:.1f}" if shared else "--"
        fixed = f"{mib['median'] - shared['median']:.1f}" if shared else "--"
        rows.append(f"| {tp} | {mode} | {order} | {rank} | {mib['median']:.1f} [{mib['min']:.1f}-{mib['max']:.1f}] "
                    f"({mib['n']}) | {shared_text} | {fixed} | {ratio(mib['median'], own)} | "
                    f"{ratio(mib['median'], own_asc)} | {ratio(mib['median'], alone.get(tp, {}).get(rank))} | "
                    f"{s['median']:.2f} [{s['min']:.2f}-{s['max']:.2f}] | {ratio(s['median'], own_s)} |")
    legend = ("Per rank, per item (medians, MiB): *pool* = graphkit's chunks or the engine's own graph pool, "
              "*torch default* = what torch's default pool grew by during the capture (workspaces), *rest* = the "
              "driver and libraries (the executable graphs' memory, kernels first loaded by the capture).")
    rows += ["", legend, "",
             "| TP | mode | order | rank | pool | of it survivors | torch default | rest | nodes | rest KiB per node |",
             "|" + "---|" * 10]
    for key in sorted(table, key=lambda k: (int(k.split("|")[0]), k)):
        parts = table[key].get("items") or {}
        if "pool" not in parts:
            continue

        def med(name: str, digits: int = 1, parts: dict[str, Any] = parts) -> str:
            return f"{parts[name]['median']:.{digits}f}" if parts.get(name) else "--"

        rows.append(f"| {' | '.join(key.split('|'))} | {med('pool')} | {med('survivors')} | {med('torch_default')} "
                    f"| {med('driver_rest')} "
                    f"| {med('nodes', 0)} | {med('rest_kib_per_node', 2)} |")
    replayed = [k for k in table if table[k].get("replayed_mib")]
    if replayed:  # --replayed: the same ranks once every graph was replayed (a budget's executables made by then)
        rows += ["", ("Once every graph was replayed (the harness's check; the executables budget has made the "
                 "executables the replays needed by then), MiB per rank:"), "",
                 "| TP | mode | order | rank | after replays | x own | x own asc |", "|" + "---|" * 7]
        for key in sorted(replayed, key=lambda k: (int(k.split("|")[0]), k)):
            tp_text, mode, order, rank = key.split("|")
            value = table[key]["replayed_mib"]["median"]
            own = median(int(tp_text), "own", order, rank, "replayed_mib")
            own_asc = median(int(tp_text), "own", "ascending", rank, "replayed_mib")
            cells_text = [f"{value / base:.2f}" if base else "--" for base in (own, own_asc)]
            rows.append(f"| {tp_text} | {mode} | {order} | {rank} | {value:.1f} | {' | '.join(cells_text)} |")
    rows += ["", f"Largest size alone (MiB per rank): {json.dumps(alone)}", f"Command: `{meta['command']}`"]
    return "\n".join(rows) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tps", default="2,4")
    parser.add_argument("--modes", default="own,switch,port")
    parser.add_argument("--orders", default="descending,ascending")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=300, help="seconds per engine start (all its ranks)")
    parser.add_argument("--base-port", type=int, default=30100)
    parser.add_argument("--out", required=True)
    parser.add_argument("--append", action="store_true",
                        help="keep the runs of DIR/tp_report.json and add this call's (a report over several calls)")
    parser.add_argument("--no-own", action="store_true",
                        help="do not add the engine's own pool to --modes (with --append: its runs are there already)")
    parser.add_argument("--replayed", action="store_true",
                        help="let each engine replay every graph once after its capture (the harness's check) and "
                             "measure again: what an executables budget holds once every size was used")
    parser.add_argument("--no-alone", action="store_true",
                        help="skip the run that captures the largest size alone (the floor)")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    modes, orders = args.modes.split(","), args.orders.split(",")
    if "own" not in modes and not args.no_own:
        modes.insert(0, "own")  # the reference of every ratio
    have = gpus()
    tps = [tp for tp in map(int, args.tps.split(",")) if have is None or tp <= have]
    skipped = sorted(set(map(int, args.tps.split(","))) - set(tps))
    if skipped:
        print(f"skipping TP sizes {skipped}: {have} GPU(s) here", flush=True)
    ports = iter(range(args.base_port, args.base_port + 100_000, 7))
    previous = out / "tp_report.json"
    runs: list[dict[str, Any]] = json.loads(previous.read_text())["runs"] if args.append and previous.exists() else []
    stamp = time.strftime("%H%M%S")  # this call's folders, apart from an earlier call's
    for tp in tps:  # torch.compile's cache, for every later process of this size
        run_one(args, "own", "descending", tp, out / f"warm-tp{tp}-{stamp}", next(ports))
    for r in range(args.rounds):
        for tp in tps:
            for order in orders:
                for k in range(len(modes)):
                    mode = modes[(k + r) % len(modes)]
                    folder = out / f"tp{tp}-{mode}-{order}-{r}-{stamp}"
                    runs.append(run_one(args, mode, order, tp, folder, next(ports)))
                    (out / "tp_runs.json").write_text(json.dumps(runs, indent=1))  # kept if this call is cut short
                    print(json.dumps({k: v for k, v in runs[-1].items() if k != "tail"}), flush=True)
    for tp in ([] if args.no_alone else tps):
        if not any(run["largest_alone"] and run["tp"] == tp and "ranks" in run for run in runs):
            runs.append(run_one(args, "own", "descending", tp, out / f"alone-tp{tp}-{stamp}", next(ports),
                                largest=True))
    alone = {run["tp"]: {rank: f["graph_bytes"] / 2**20 for rank, f in run["ranks"].items()}
             for run in runs if run["largest_alone"] and "ranks" in run}
    table = summarise(runs)
    meta = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "rounds": args.rounds,
            "device": subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                                     capture_output=True, text=True).stdout.strip().replace("\n", "; ")
            if shutil.which("nvidia-smi") else "unknown device",
            "failed": [{k: v for k, v in run.items() if k != "tail"} for run in runs if "failed" in run]}
    (out / "tp_report.json").write_text(json.dumps({"meta": meta, "table": table, "largest_alone_mib": alone,
                                                    "runs": runs}, indent=1))
    text = markdown(table, alone, meta)
    (out / "tp_report.md").write_text(text)
    print(text, flush=True)
    return 1 if meta["failed"] else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
