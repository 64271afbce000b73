"""The driver's own memory per instantiated graph, as graph nodes and the number of graphs grow.

Every instantiated graph keeps device memory of the driver's (its
executable form, kernel parameters, per-node state) that no pool accounts
for and no sharing of pools can reduce. Measured here as the device's
used-memory growth over the capture less graphkit's chunk bytes (vmm pools:
the pools' whole memory is the chunks), after each capture of a decode step
of the reference-shaped decoder with ``L`` layers (more layers, more nodes
per graph), sizes captured largest first:

    python -m graphkit_bench.graphmem --sizes 1,2,4,8,16,32,64,128,256 --layers 1,4,16,28

Each layer count runs in a fresh process (the driver keeps the memory of
destroyed graphs for reuse, which would hide the next count's). A host
device (``fake``) has no driver memory: every row says so instead of a number.

``python -m graphkit_bench.graphmem sweep --out-dir DIR`` measures instead how
the driver's memory grows with graph nodes and with the number of variants
(sizes x models x pieces), and what two levers save: lazy instantiation and
one executable graph per topology (:mod:`graphkit_bench.drivermem`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

import torch

import graphkit
import hal
from graphkit.graphs.capture import release_cached_memory
from graphkit.graphs.report import driver_memory
from graphkit_bench.model import Decoder, DecoderConfig
from hal.types import fmt_bytes

log = logging.getLogger("graphkit.bench.graphmem")

DEFAULT_SIZES = [1, 2, 4, *range(8, 257, 8)]
DEFAULT_LAYERS = [1, 4, 16, 28]


def graph_nodes(be: hal.Backend, model: Decoder, batch: int) -> int | None:
    """Nodes of one graph of ``model``'s step at ``batch`` (None where the backend cannot read graphs)."""
    if not be.supports("graph_addresses"):
        return None
    graph = be.create_graph()
    inputs = model.example_inputs(batch)  # made before the capture: a host-to-device copy cannot be captured
    try:
        with torch.no_grad(), be.capture(graph, stream=be.create_stream(), inspect=True):
            model.step(**inputs)
        return be.graph_addresses(graph).nodes
    finally:
        be.release_graph(graph)


def measure(backend: str | None, layers: int, sizes: Sequence[int], config: DecoderConfig | None = None,
            seed: int = 0) -> dict[str, Any]:
    """Capture ``sizes`` (largest first) of a decoder of ``layers`` layers into vmm pools; after each capture,
    the chunk bytes, the device's growth and their difference (the driver's memory of the graphs so far).

    ``driver_bytes`` is None, with ``driver_why``, where the device is the host.
    """
    be = hal.get_backend(backend, requires=("graphs",))
    try:
        cfg = dataclasses.replace(config or DecoderConfig(), layers=layers)
        device = be.torch_device()
        model = Decoder(cfg, max(sizes), device, seed=seed)
        release_cached_memory(be)
        runner = graphkit.GraphRunner(model.step, sorted(set(sizes)), backend=be, fill=model.padding(),
                                      progress=False, kind="vmm", measure_memory=True)
        try:
            runner.capture(model.example_inputs(max(sizes)), order="descending")
            report = runner.report()
            rows: list[dict[str, Any]] = []
            grown = 0
            for k, size in enumerate(report.sizes, start=1):
                grown += size.memory_delta
                chunks = size.chunk_bytes or 0
                driver, why = driver_memory(be, grown, chunks)
                rows.append({"graphs": k, "size": size.size, "device_bytes": grown, "chunk_bytes": chunks,
                             "driver_bytes": driver})
        finally:
            runner.close()
        nodes = graph_nodes(be, model, min(sizes))  # after the runs: a destroyed graph's memory is kept for reuse
        last = rows[-1]
        per_graph = last["driver_bytes"] / last["graphs"] if last["driver_bytes"] is not None else None
        return {"backend": be.name, "layers": layers, "nodes_per_graph": nodes, "rows": rows,
                "driver_bytes": last["driver_bytes"], "driver_per_graph_bytes": per_graph,
                "driver_per_node_bytes": per_graph / nodes if per_graph is not None and nodes else None,
                "driver_why": why, "config": cfg.as_dict(), "sizes": sorted(set(sizes))}
    finally:
        be.close()


def table(results: list[dict[str, Any]]) -> str:
    """One row per layer count: nodes, graphs, chunks, the device's growth, the driver's memory in all, per graph
    and per node; then how it grew with the number of graphs for the deepest model."""
    lines = [(f"{'layers':>6} {'nodes/graph':>11} {'graphs':>6} {'chunks':>10} {'device +':>10} {'driver':>10} "
              f"{'per graph':>10} {'per node':>9}")]
    for r in results:
        last = r["rows"][-1]
        nodes = str(r["nodes_per_graph"]) if r["nodes_per_graph"] is not None else "-"
        if r["driver_bytes"] is None:
            driver = per_graph = per_node = "n/m"
        else:
            driver, per_graph = fmt_bytes(r["driver_bytes"]), fmt_bytes(r["driver_per_graph_bytes"])
            per_node = f"{r['driver_per_node_bytes']:.0f} B" if r["driver_per_node_bytes"] is not None else "-"
        lines.append(f"{r['layers']:>6} {nodes:>11} {last['graphs']:>6} {fmt_bytes(last['chunk_bytes']):>10} "
                     f"{fmt_bytes(last['device_bytes']):>10} {driver:>10} {per_graph:>10} {per_node:>9}")
    deepest = max(results, key=lambda r: r["layers"])
    lines.append(f"layers {deepest['layers']}, as graphs are added (largest size first):")
    for row in deepest["rows"]:
        driver = fmt_bytes(row["driver_bytes"]) if row["driver_bytes"] is not None else "n/m"
        lines.append(f"  {row['graphs']:>4} graph(s) (last size {row['size']:>4}): chunks "
                     f"{fmt_bytes(row['chunk_bytes']):>10}, device +{fmt_bytes(row['device_bytes']):>10}, "
                     f"driver {driver}")
    if results[0]["driver_why"]:
        lines.append(f"n/m: {results[0]['driver_why']}")
    return "\n".join(lines)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["sweep"]:
        from graphkit_bench import drivermem

        return drivermem.main(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m graphkit_bench.graphmem", description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default=None, help="hal backend (default: the best available)")
    parser.add_argument("--sizes", type=_ints, default=DEFAULT_SIZES, help="comma-separated batch sizes")
    parser.add_argument("--layers", type=_ints, default=DEFAULT_LAYERS, help="comma-separated layer counts")
    parser.add_argument("--config", choices=("reference", "tiny"), default=None,
                        help="decoder shape besides the layers (default: reference on a GPU, tiny otherwise)")
    parser.add_argument("--in-process", action="store_true",
                        help="measure every layer count in this process (the driver may reuse memory between them)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    if not args.sizes or not args.layers or min(args.sizes) < 1 or min(args.layers) < 1:
        parser.error("--sizes and --layers need positive integers")
    config = args.config
    if config is None:
        with hal.get_backend(args.backend, requires=("graphs",)) as be:
            config = "reference" if be.torch_device().type != "cpu" else "tiny"
    cfg = DecoderConfig() if config == "reference" else DecoderConfig.tiny()
    results = []
    for layers in args.layers:
        if args.in_process:
            results.append(measure(args.backend, layers, args.sizes, cfg))
            continue
        command = [sys.executable, "-m", "graphkit_bench.graphmem", "--in-process", "--json", "--config", config,
                   "--layers", str(layers), "--sizes", ",".join(map(str, args.sizes))]
        if args.backend:
            command += ["--backend", args.backend]
        out = subprocess.run(command, capture_output=True, text=True, check=False)
        if out.returncode:
            print(f"error: layers {layers}: {out.stderr.strip()[-2000:]}")
            return 2
        results += json.loads(out.stdout.splitlines()[-1])
    print(json.dumps(results) if args.json else table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
