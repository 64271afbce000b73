"""How fast an executable graph replays, by how it was made: at its capture's end, at its first replay, or updated
to run another capture's work (``cuGraphExecUpdate``), with and without an explicit upload (``cuGraphUpload``).

    python tests/cuda_scripts/exec_update_probe.py [--rounds 12] [--calls 40] [--out FILE]

The reference decoder's decode step (graphkit_bench.model) at batch 1 is captured several times with torch's own
graph API; every variant runs batch 1's work on the same static inputs, timed with CUDA events on the current
stream, the variants in turns round by round. Prints one ``RESULT {json}`` line: per variant the median and the
spread of the milliseconds per replay, and whether its output equals the plainly made graph's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch
from cuda.bindings import driver

from graphkit_bench.model import Decoder, DecoderConfig


def check(err: object) -> None:
    code = err[0] if isinstance(err, tuple) else err
    if int(code):
        raise RuntimeError(f"driver error {code}")


def capture(step, inputs, keep: bool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    graph = torch.cuda.CUDAGraph(keep_graph=keep)
    with torch.cuda.graph(graph):
        out = step(**inputs)
    return graph, out


def update(target: torch.cuda.CUDAGraph, source: torch.cuda.CUDAGraph, upload: bool) -> None:
    exe = driver.CUgraphExec(int(target.raw_cuda_graph_exec()))
    err, *_ = driver.cuGraphExecUpdate(exe, driver.CUgraph(int(source.raw_cuda_graph())))
    check(err)
    if upload:
        check(driver.cuGraphUpload(exe, driver.CUstream(torch.cuda.current_stream().cuda_stream)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--out")
    args = parser.parse_args()
    model = Decoder(DecoderConfig(), 8, torch.device("cuda"), seed=0)
    one, two = model.example_inputs(1, seed=1), model.example_inputs(2, seed=2)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side), torch.no_grad():
        for inputs in (one, two):
            model.step(**inputs)
    torch.cuda.synchronize()
    variants: dict[str, torch.cuda.CUDAGraph] = {}
    outs: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        variants["at capture end (torch default)"], outs["at capture end (torch default)"] = capture(
            model.step, one, keep=False)
        g, outs["kept, instantiated at once"] = capture(model.step, one, keep=True)
        g.instantiate()
        variants["kept, instantiated at once"] = g
        lazy, outs["kept, at its first replay"] = capture(model.step, one, keep=True)
        variants["kept, at its first replay"] = lazy
        for upload in (False, True):
            name = f"size 2's executable updated to size 1{' + upload' if upload else ''}"
            host, _ = capture(model.step, two, keep=True)
            src, outs[name] = capture(model.step, one, keep=True)
            host.instantiate()
            update(host, src, upload)
            variants[name], variants[name + " (source)"] = host, src
            name = f"size 1's updated to size 2 and back{' + upload' if upload else ''}"
            own, outs[name] = capture(model.step, one, keep=True)
            other, _ = capture(model.step, two, keep=True)
            own.instantiate()
            update(own, other, upload)
            update(own, own, upload)
            variants[name], variants[name + " (other)"] = own, other
    timed = {k: v for k, v in variants.items() if not k.endswith(")") or "default" in k}
    times: dict[str, list[float]] = {k: [] for k in timed}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    reference = None
    for r in range(args.rounds):
        names = list(timed)
        names = names[r % len(names):] + names[:r % len(names)]
        for name in names:
            graph = timed[name]
            type(graph).replay(graph)  # a first replay (instantiates a lazy one) outside the timing
            torch.cuda.synchronize()
            start.record()
            for _ in range(args.calls):
                type(graph).replay(graph)
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) / args.calls)
    result = {}
    for name in timed:
        type(timed[name]).replay(timed[name])
        torch.cuda.synchronize()
        got = outs[name].float().clone()
        if reference is None:
            reference = got
        result[name] = {"median_ms": statistics.median(times[name]), "min_ms": min(times[name]),
                        "max_ms": max(times[name]), "equal": bool(torch.equal(got, reference))}
    text = json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "variants": result})
    print("RESULT " + text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
