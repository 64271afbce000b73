"""The executables budget on an NVIDIA GPU: torch's own graphs and hal's, served by a few executable graphs."""

from __future__ import annotations

import gc
import random

import pytest
import torch

import graphkit
import hal
from tests.graphkit.graphs.test_graph_pools_cuda import be, engine_loop, make_step

pytestmark = pytest.mark.cuda

SIZES = [64, 48, 32, 24, 16, 8, 4, 2, 1]
__all__ = ["be"]  # the cuda backend fixture, shared with the pools' tests


def test_a_runner_with_one_executable_per_topology_replays_every_size_exactly(be: hal.Backend) -> None:
    step = make_step()
    runner = graphkit.GraphRunner(step, sizes=SIZES, backend=be, executables=1, progress=False)
    runner.capture(x=torch.zeros(max(SIZES), 1024, device="cuda"))
    graphs = [g for s in runner.captured_sizes for g in runner.bucket(s).graphs]
    assert not any(g.instantiated for g in graphs)  # captured, none instantiated
    rng = random.Random(0)
    for batch in [rng.randint(1, max(SIZES)) for _ in range(40)] + SIZES:
        x = torch.randn(batch, 1024, device="cuda")
        torch.testing.assert_close(runner(x=x), step(x), rtol=1e-3, atol=1e-3)
    stats = runner.pools.executables.stats
    assert stats.executables == stats.topologies and stats.graphs == len(SIZES)
    assert sum(g.instantiated for g in graphs) == stats.executables
    assert stats.driver_bytes is not None and stats.updates > 0
    report = runner.report()
    assert "executables:" in str(report) and "accounting: device +" in str(report)
    runner.close()


def test_the_scope_serves_an_engines_own_graphs(be: hal.Backend) -> None:
    step = make_step()
    with graphkit.graph_memory(be, executables=1) as pools:
        graphs = engine_loop(step, SIZES, lambda n, pool: pool)
    order = list(graphs) * 2
    random.Random(1).shuffle(order)
    for n in order:  # torch's own graph.replay(), in any order
        graph, x, out = graphs[n]
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, step(x), rtol=1e-3, atol=1e-3)
    stats = pools.executables.stats
    assert stats.graphs == len(SIZES) and stats.executables == stats.topologies <= 3
    first = graphs[SIZES[0]][0]
    first.reset()  # the engine drops a size: its executable (if it held one) goes with it
    graph, x, out = graphs[SIZES[1]]
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, step(x), rtol=1e-3, atol=1e-3)
    for graph, _, _ in graphs.values():
        graph.reset()
    del graphs, graph, x, out
    gc.collect()
    pools.close()


def test_a_graph_that_draws_random_numbers_keeps_its_own_executable(be: hal.Backend) -> None:
    w = torch.randn(256, 256, device="cuda")
    graphs = {}
    with graphkit.graph_memory(be, executables=1) as pools:
        for n in (16, 8):
            x = torch.randn(n, 256, device="cuda")
            torch.nn.functional.dropout(x @ w, 0.5, training=True)  # warm-up
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = torch.nn.functional.dropout(x @ w, 0.5, training=True)
            graphs[n] = (graph, x, out)
    generator = torch.cuda.default_generators[torch.cuda.current_device()]
    for n, (graph, x, out) in graphs.items():
        seen = []
        for _ in range(3):
            offset = generator.get_offset()
            graph.replay()
            torch.cuda.synchronize()
            assert generator.get_offset() > offset  # torch's bookkeeping ran for this graph
            kept = out != 0
            torch.testing.assert_close(out[kept], ((x @ w) * 2)[kept], rtol=1e-3, atol=1e-3)
            seen.append(kept.clone())
        assert any(not torch.equal(seen[0], m) for m in seen[1:]), n  # fresh random numbers each replay
    assert pools.executables.stats.own == 2  # each its own: no update ran one through another's executable
    for graph, _, _ in graphs.values():
        graph.reset()
    del graphs
    gc.collect()
    pools.close()


def test_a_graph_made_before_the_scope_keeps_its_own_executable(be: hal.Backend) -> None:
    step = make_step()
    made_before = torch.cuda.CUDAGraph()
    x = torch.zeros(8, 1024, device="cuda")
    step(x)
    with graphkit.graph_memory(be) as pools:
        with torch.cuda.graph(made_before):
            out = step(x)
    x.copy_(torch.randn_like(x))
    made_before.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, step(x), rtol=1e-3, atol=1e-3)
    assert pools.executables.stats.graphs == 0  # the framework's own executable, made at its capture's end
    made_before.reset()
    del out
    gc.collect()
    pools.close()
