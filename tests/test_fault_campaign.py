"""Fault campaign over the newer public operations: every driver call site fails, once or twice.

For each scenario, hook and call number: the operation either raises a hal
error or recovers cleanly; afterwards everything still gives right results,
and after close nothing is live.
"""

from __future__ import annotations

import contextlib
import gc
import itertools

import pytest
import torch

import graphkit
import hal
from hal.api import VMM_HOOKS

G = 1 << 16
W = torch.randn(64, 64) / 8


def step(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ W) + x


def scope_scenario(be: hal.Backend) -> None:
    pools = graphkit.GraphPools(be)
    graphs = {}
    try:
        with graphkit.graph_memory(pools=pools):
            for n in (8, 2, 4):
                x = torch.zeros(n, 64)
                graph = be.create_graph()
                try:
                    with be.capture(graph):
                        out = step(x)
                except hal.HalError:
                    be.release_graph(graph)
                    raise
                graphs[n] = (graph, x, out)
    except hal.HalError:
        pass
    be.faults.clear()
    for n, (graph, x, out) in graphs.items():  # what was captured replays right
        x.copy_(torch.randn(n, 64))
        be.replay(graph)
        torch.testing.assert_close(out, step(x))
        be.release_graph(graph)
    del graphs
    gc.collect()
    pools.close()


def saver_scenario(be: hal.Backend) -> None:
    saver = graphkit.MemorySaver(be)
    try:
        with saver.region("weights", backup=True):
            w = torch.arange(4 * G // 4, dtype=torch.float32)
            w2 = torch.ones(2 * G // 4)
    except (hal.HalError, RuntimeError):  # torch turns a failed segment into its own out-of-memory error
        be.faults.clear()
        saver.close()
        return
    expected = w.clone()
    for _ in range(2):
        with contextlib.suppress(hal.HalError):
            saver.pause()
        with contextlib.suppress(hal.HalError):
            saver.resume()
    be.faults.clear()
    saver.resume()
    assert torch.equal(w, expected) and float(w2.sum()) == w2.numel()
    del w, w2
    saver.close()


def elastic_scenario(be: hal.Backend) -> None:
    with graphkit.ElasticPool(be, reserve_bytes=32 * G) as pool:
        buf = pool.buffer(16 * G)
        done = 0
        for target in (3 * G, 8 * G, 2 * G, 6 * G):
            try:
                buf.resize(target)
                done = target
            except hal.HalError:
                assert buf.mapped_bytes == done  # all or nothing
        be.faults.clear()
        buf.resize(5 * G)
        view = buf.view(torch.int64, (5 * G // 8,))
        view.copy_(torch.arange(view.numel()))
        assert int(view[-1]) == view.numel() - 1
        del view


def runner_scenario(be: hal.Backend) -> None:
    """Capture three sizes, call each, release one, call again, close: right answers throughout."""
    runner = graphkit.GraphRunner(step, sizes=[2, 4, 8], backend=be, progress=False, on_demand=True)
    try:
        runner.capture(x=torch.zeros(8, 64))
        for n in (8, 3, 1, 5):
            try:
                x = torch.randn(n, 64)
                torch.testing.assert_close(runner(x=x), step(x))
            except hal.HalError:
                pass
        with contextlib.suppress(hal.HalError):
            runner.release_size(8)
        be.faults.clear()
        x = torch.randn(7, 64)
        torch.testing.assert_close(runner(x=x), step(x))
    finally:
        be.faults.clear()
        runner.close()


def pools_scenario(be: hal.Backend) -> None:
    """GraphPools handles passed to captures by the caller, released key by key."""
    pools = graphkit.GraphPools(be)
    kept = {}
    for n in (8, 2, 4):
        graph = be.create_graph()
        x = torch.zeros(n, 64)
        try:
            with be.capture(graph, pool=pools.pool(n)):
                out = step(x)
        except hal.HalError:
            be.release_graph(graph)
            continue
        kept[n] = (graph, x, out)
    be.faults.clear()
    for n, (graph, x, out) in list(kept.items()):
        x.copy_(torch.randn(n, 64))
        be.replay(graph)
        torch.testing.assert_close(out, step(x))
        be.release_graph(graph)
        del out
        kept.pop(n)
        pools.release(n)
    pools.close()


SCENARIOS = {"graph_memory": scope_scenario, "saver": saver_scenario, "elastic": elastic_scenario,
             "runner": runner_scenario, "pools": pools_scenario}


def run(scenario: str, be: hal.Backend) -> None:
    """A hal error out of the scenario is an accepted outcome (a wrong result or another error is not)."""
    with contextlib.suppress(hal.HalError):
        SCENARIOS[scenario](be)
    be.faults.clear()


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize("hook", VMM_HOOKS)
@pytest.mark.parametrize("nth", [1, 2, 4])
def test_one_fault(scenario: str, hook: str, nth: int) -> None:
    be = hal.get_backend("fake", granularity=G)
    be.faults.fail(hook, nth=nth)
    run(scenario, be)
    gc.collect()
    live = be.live
    assert live.ranges == live.chunks == live.mappings == 0, live
    be.close()
    assert be.live.zero


PAIRS = list(itertools.combinations(["create_phy_mem_handle", "map", "unmap", "release_phy_mem_handle"], 2))


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize("first,second", PAIRS)
def test_two_faults(scenario: str, first: str, second: str) -> None:
    be = hal.get_backend("fake", granularity=G)
    be.faults.fail(first, nth=2)
    be.faults.fail(second, nth=1)
    run(scenario, be)
    gc.collect()
    live = be.live
    assert live.ranges == live.chunks == live.mappings == 0, live
    be.close()
    assert be.live.zero
