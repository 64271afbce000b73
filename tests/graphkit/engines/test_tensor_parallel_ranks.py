"""Tensor parallelism on ``fake``: N rank processes, each under ``GRAPHKIT_GRAPH_MEMORY`` alone, on its own device.

Each rank is a process of its own (``python this_file.py RANK ORDER DIR``), started with the variable, the
machine's device count (``HAL_FAKE_DEVICE_COUNT``) and nothing else from graphkit. It does what an engine's
tensor-parallel worker does: sets its device (``fake.set_device(rank)``, as ``torch.cuda.set_device``), loads
its shard of a two-layer MLP (the first weight split by columns, the second by rows), captures the shard's step
for every batch size in its capture order into graphs it keeps, with static buffers sized for the largest,
then serves a sequence of batches: replay the bucket, all-reduce the partial outputs with the other ranks,
feed the sum to the next step. ``fake`` has no collectives, so the all-reduce runs between replays through
files (every rank sums the N partials in rank order); an engine's NCCL all-reduce inside the graph is what a
device run covers. The same loop runs eagerly for the reference. Each rank prints one ``RESULT`` line.

The test checks, on every rank: every step bit-exact against eager; the switch served this rank's device and
no other; the graph memory of all sizes equal to the largest size alone (captured afterwards in a
``graph_memory()`` scope of its own); the rank's report line, naming its device, with that memory.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.ranks import explain, rank_env, run_ranks

WORLD = 4
SIZES = (1024, 768, 512, 256, 128)  # the buckets; the largest fills several of the switch's 2 MiB chunks
HIDDEN, INTER = 128, 2048  # INTER is split over the ranks
BATCHES = (5, 1024, 130, 700, 513)  # the batches served, one step each
EXCHANGE_TIMEOUT = 60.0
KEPT: list[Any] = []


def _weights(rank: int) -> tuple[Any, Any]:
    """This rank's shard: columns of the first weight, rows of the second (the same on every run)."""
    import torch

    gen = torch.Generator().manual_seed(1234)
    w1 = torch.randn(HIDDEN, INTER, generator=gen) / HIDDEN**0.5
    w2 = torch.randn(INTER, HIDDEN, generator=gen) / INTER**0.5
    shard = INTER // WORLD
    return w1[:, rank * shard:(rank + 1) * shard].contiguous(), w2[rank * shard:(rank + 1) * shard].contiguous()


def _all_reduce(folder: Path, tag: str, rank: int, partial: Any) -> Any:
    """Sum ``partial`` over the ranks (in rank order, so every rank gets the same bits), through files."""
    import torch

    mine = folder / f"{tag}.{rank}"
    tmp = folder / f".{tag}.{rank}.tmp"
    tmp.write_bytes(partial.contiguous().numpy().tobytes())
    os.replace(tmp, mine)
    deadline = time.monotonic() + EXCHANGE_TIMEOUT
    total = None
    for peer in range(WORLD):
        path = folder / f"{tag}.{peer}"
        while not path.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {rank}: rank {peer} never wrote {path.name}")
            time.sleep(0.005)
        data = torch.frombuffer(bytearray(path.read_bytes()), dtype=partial.dtype).view(partial.shape)
        total = data.clone() if total is None else total + data
    return total


def rank_main(rank: int, order: str, folder: Path) -> dict[str, Any]:
    """One tensor-parallel worker that never imports graphkit until its engine work is done."""
    import torch

    import hal
    from hal.backends import fake

    torch.set_num_threads(1)
    fake.set_device(rank)
    be = hal.get_backend("fake")  # the current device, as an engine's torch.cuda calls mean it
    w1, w2 = _weights(rank)

    def step(x: Any) -> Any:
        return torch.relu(x @ w1) @ w2  # the partial sum of this rank's shard

    static = torch.zeros(max(SIZES), HIDDEN)
    graphs, outputs = {}, {}
    for n in sorted(SIZES, reverse=order == "descending"):
        graph = be.create_graph()
        with be.capture(graph):
            outputs[n] = step(static[:n])
        graphs[n] = graph

    def serve(replayed: bool, tag: str) -> list[Any]:
        x, results = torch.randn(BATCHES[0], HIDDEN, generator=torch.Generator().manual_seed(7)), []
        for k, batch in enumerate(BATCHES):
            bucket = min(n for n in SIZES if n >= batch)
            padded = torch.zeros(bucket, HIDDEN)
            padded[:batch] = x[:batch]
            if replayed:
                static[:bucket] = padded
                be.replay(graphs[bucket])
                partial = outputs[bucket][:batch].clone()
            else:
                partial = step(padded)[:batch]
            reduced = _all_reduce(folder, f"{tag}-{k}", rank, partial)
            results.append(reduced)
            following = BATCHES[(k + 1) % len(BATCHES)]
            x = reduced.repeat(-(-following // batch), 1)[:following]  # the next step reads this one's output
        return results

    replayed, eager = serve(True, "graph"), serve(False, "eager")
    mismatched = [k for k, (a, b) in enumerate(zip(replayed, eager, strict=True)) if not torch.equal(a, b)]

    switch = sys.modules.get("graphkit.switch")
    scope = switch.active() if switch is not None else None  # type: ignore[attr-defined]
    served = sorted(f"{b}:{d}" for b, d in scope.pools) if scope is not None else None
    pools = scope.pools.get(("fake", rank)) if scope is not None else None
    report = pools.report(measure=False) if pools is not None else None

    import graphkit

    with graphkit.graph_memory(be) as alone:  # the largest size alone, as the floor
        graph = be.create_graph()
        with be.capture(graph):
            out = step(static)
        alone_bytes = alone.report(measure=False).chunk_bytes
    be.release_graph(graph)
    del out
    alone.close()
    KEPT.append((graphs, outputs))  # the engine's graphs live as long as the process, as an engine's do
    return {"rank": rank, "pid": os.getpid(), "device": be.device, "devices": be.device_count(),
            "served": served, "mismatched_steps": mismatched, "steps": len(replayed),
            "keys": len(report.keys) if report else None, "chunk_bytes": report.chunk_bytes if report else None,
            "survivor_bytes": report.survivor_bytes if report else None,
            "pools_device": pools.backend.device if pools is not None else None, "alone_bytes": alone_bytes}


@pytest.mark.slow  # four interpreters that import torch
@pytest.mark.parametrize("order", ["descending", "ascending"])
def test_ranks_each_under_the_switch_stay_on_their_device_and_pay_the_largest_size(tmp_path: Path,
                                                                                   order: str) -> None:
    from hal.types import fmt_bytes

    env = rank_env(GRAPHKIT_GRAPH_MEMORY="report=0", HAL_FAKE_DEVICE_COUNT=str(WORLD), OMP_NUM_THREADS="1")
    results = run_ranks(Path(__file__), WORLD, timeout=240, env=env, args=[order, str(tmp_path)])
    assert all(r.ok for r in results), explain(results)
    for r in results:
        line = next((x for x in r.output.splitlines() if x.startswith("RESULT ")), None)
        assert line is not None, explain([r])
        seen = json.loads(line[len("RESULT "):])
        where = f"fake:{r.rank}"
        assert seen["device"] == r.rank and seen["devices"] == WORLD, seen
        assert seen["served"] == [where] and seen["pools_device"] == r.rank, seen  # nothing on another device
        assert seen["mismatched_steps"] == [] and seen["steps"] == len(BATCHES), seen
        assert seen["keys"] == len(SIZES), seen
        # the largest size alone (several chunks: a real floor), plus the granules under the outputs each rank
        # keeps (each its key's alone, as in an engine's own pool)
        assert seen["alone_bytes"] > 2 << 20, seen
        assert seen["chunk_bytes"] <= seen["alone_bytes"] + seen["survivor_bytes"], seen
        lines = [x for x in r.output.splitlines() if x.startswith(f"graphkit: process {seen['pid']}, ")]
        assert len(lines) == 1, explain([r])  # one device, one line (at exit)
        assert f", {where}: graph pools on fake (vmm): {len(SIZES)} key(s) holding " in lines[0], lines[0]
        assert f"{fmt_bytes(seen['chunk_bytes'])} of chunks" in lines[0], lines[0]
        assert not any(f"fake:{d}" in lines[0] for d in range(WORLD) if d != r.rank), lines[0]


def test_the_machines_device_count_comes_from_the_variable_and_a_bad_one_is_refused(monkeypatch) -> None:
    import hal
    from hal.backends.fake.backend import DEVICES_ENV

    monkeypatch.delenv(DEVICES_ENV, raising=False)
    with pytest.raises(hal.InvalidArgumentError, match=DEVICES_ENV):  # the fix is named where it is missing
        hal.get_backend("fake", device=2)
    monkeypatch.setenv(DEVICES_ENV, "4")
    with hal.get_backend("fake", device=3) as be:
        assert be.device_count() == 4
    with hal.get_backend("fake", device=0, device_count=1) as be:  # an explicit count stays explicit
        assert be.device_count() == 1
    for bad in ("0", "-1", "two", "²"):
        monkeypatch.setenv(DEVICES_ENV, bad)
        with pytest.raises(hal.InvalidArgumentError, match=f"{DEVICES_ENV}={bad!r}"):
            hal.get_backend("fake")


if __name__ == "__main__":
    print("RESULT " + json.dumps(rank_main(int(sys.argv[1]), sys.argv[2], Path(sys.argv[3]))), flush=True)
