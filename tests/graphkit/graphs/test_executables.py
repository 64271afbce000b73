"""The executables budget on ``fake``: every size replayable and exact, at the executables of a few graphs.

``fake``'s recordings stand for a device's executable graphs: a recording is *compiled* (instantiated) at its
first launch, and an update makes a compiled recording run another's ops on that one's tensors (refused for
another sequence of ops: another topology). The tests read those flags as the truth of what exists.
"""

from __future__ import annotations

import logging
import random
import re

import pytest
import torch

import graphkit
import hal
from graphkit.graphs.executables import Executables

W = torch.randn(64, 64)


def step(x: torch.Tensor) -> torch.Tensor:
    return torch.relu(x @ W) @ W.t()


def two_topologies(x: torch.Tensor) -> torch.Tensor:
    """Sizes above 8 run one more op: two topologies."""
    y = torch.relu(x @ W)
    return torch.tanh(y) if x.shape[0] > 8 else y


@pytest.fixture
def be() -> hal.Backend:
    backend = hal.get_backend("fake", granularity=64 << 10)
    yield backend
    backend.close()


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal to rounding (a padded batch's matrix products may round differently from the batch's own)."""
    return a.shape == b.shape and torch.allclose(a, b, rtol=1e-5, atol=1e-4)


def compiled(graphs: list) -> list:
    """The recordings that exist as executables now (instantiated)."""
    return [g for g in graphs if g.compiled]


def runner_graphs(runner: graphkit.GraphRunner) -> list:
    return [g for s in runner.captured_sizes for g in runner.bucket(s).graphs]


@pytest.mark.parametrize("fn, topologies", [(step, 1), (two_topologies, 2)])
def test_a_runner_with_one_executable_per_topology_replays_every_size_exactly_in_any_order(
        be: hal.Backend, fn, topologies: int) -> None:
    sizes = [1, 2, 4, 8, 12, 16, 24, 32]
    runner = graphkit.GraphRunner(fn, sizes=sizes, backend=be, executables=1, progress=False)
    runner.capture(x=torch.zeros(32, 64))
    assert compiled(runner_graphs(runner)) == []  # captured, none instantiated
    rng = random.Random(0)
    for batch in [rng.randint(1, 32) for _ in range(60)] + sizes[::-1]:
        x = torch.randn(batch, 64)
        assert same(runner(x=x), fn(x)), batch
    stats = runner.pools.executables.stats
    assert stats.topologies == topologies and stats.executables == topologies
    assert len(compiled(runner_graphs(runner))) == topologies  # what fake really holds
    assert stats.graphs == len(sizes) and stats.updates > len(sizes)
    assert stats.refused == (0 if topologies == 1 else stats.refused) and (topologies == 1 or stats.refused > 0)
    runner.close()


def test_by_default_each_size_gets_its_own_executable_at_its_first_call_and_keeps_it(be: hal.Backend) -> None:
    runner = graphkit.GraphRunner(step, sizes=[2, 4, 8, 16], backend=be, progress=False)
    runner.capture(x=torch.zeros(16, 64))
    ex = runner.pools.executables
    assert ex.per_topology is None  # lazy
    for batch in (3, 7, 3, 2, 7, 3):
        x = torch.randn(batch, 64)
        assert same(runner(x=x), step(x))
    stats = ex.stats
    assert (stats.executables, stats.instantiations, stats.updates, stats.refused) == (3, 3, 0, 0)
    assert "lazy: one per graph at its first replay" in str(stats)
    assert not runner.bucket(16).graphs[0].compiled  # never called: none
    assert all(g.running is None for s in (2, 4, 8) for g in runner.bucket(s).graphs)  # never updated
    runner.close()


def test_a_size_never_replayed_has_no_executable(be: hal.Backend) -> None:
    runner = graphkit.GraphRunner(step, sizes=[8, 16, 32], backend=be, progress=False)
    runner.capture(x=torch.zeros(32, 64))
    x = torch.randn(5, 64)
    assert same(runner(x=x), step(x))
    assert compiled(runner_graphs(runner)) == runner.bucket(8).graphs
    assert runner.pools.executables.stats.executables == 1
    runner.close()


def test_at_most_k_per_topology_the_least_recently_used_one_goes(be: hal.Backend) -> None:
    runner = graphkit.GraphRunner(step, sizes=[1, 2, 4], backend=be, executables=2, progress=False)
    runner.capture(x=torch.zeros(4, 64))
    ex = runner.pools.executables
    for batch in (1, 2, 1, 2, 1, 2):  # two sizes, two executables: no update once each has its own
        runner(x=torch.randn(batch, 64))
    settled = ex.stats.updates
    assert ex.stats.executables == 2 and ex.stats.instantiations == 2
    runner(x=torch.randn(1, 64))  # 1 used last: 2's executable is the least recently used
    x = torch.randn(4, 64)
    assert same(runner(x=x), step(x))
    assert ex.stats.updates == settled + 1 and ex.stats.executables == 2
    assert runner.bucket(1).graphs[0].compiled and runner.bucket(1).graphs[0].running is None  # kept its own
    runner.close()


def test_an_evicted_size_gets_an_executable_again_and_replays_exactly(be: hal.Backend) -> None:
    runner = graphkit.GraphRunner(step, sizes=[4, 8], backend=be, executables=1, progress=False)
    runner.capture(x=torch.zeros(8, 64))
    for batch in (3, 7, 3, 7, 2):
        x = torch.randn(batch, 64)
        assert same(runner(x=x), step(x))
    assert runner.pools.executables.stats.executables == 1
    runner.release_size(4)  # the size whose graph held the executable goes, and its executable with it
    x = torch.randn(6, 64)
    assert same(runner(x=x), step(x))
    assert runner.pools.executables.stats.executables == 1 and runner.bucket(8).graphs[0].compiled
    runner.close()


def test_the_scope_serves_an_unmodified_loop_with_one_executable(be: hal.Backend) -> None:
    graphs, inputs, outputs = {}, {}, {}
    stream = be.create_stream()
    with graphkit.graph_memory(be, executables=1) as pools:
        for n in (32, 16, 8, 4):  # as an engine's loop: largest first, hal's own calls
            inputs[n] = torch.zeros(n, 64)
            graphs[n] = be.create_graph()
            with be.capture(graphs[n], stream=stream):
                outputs[n] = step(inputs[n])
    assert compiled(list(graphs.values())) == []
    for n in (4, 32, 8, 16, 4, 4, 32):
        x = torch.randn(n, 64)
        inputs[n].copy_(x)
        be.replay(graphs[n])
        assert same(outputs[n], step(x)), n
    assert len(compiled(list(graphs.values()))) == 1 == pools.executables.stats.executables
    assert "executables: 1 for 4 graph(s)" in str(pools.report())
    for graph in graphs.values():
        be.release_graph(graph)
    assert pools.executables.stats.graphs == 0
    with pytest.raises(hal.InvalidStateError, match="released"):
        be.replay(graphs[8])
    del outputs
    pools.close()


def test_the_switch_serves_the_captures_of_a_process(be: hal.Backend) -> None:
    from graphkit import switch

    scope = switch.start(switch.parse("executables=1"))
    try:
        graph, x = be.create_graph(), torch.zeros(8, 64)
        with be.capture(graph):
            y = step(x)
        x.copy_(torch.randn(8, 64))
        be.replay(graph)
        assert same(y, step(x))
        pools = scope.pools[(be.name, be.device)]
        assert pools.executables is not None and pools.executables.per_topology == 1
        assert pools.executables.stats.executables == 1
        be.release_graph(graph)
    finally:
        switch.stop()
    for pools in scope.pools.values():
        pools.close()


def test_a_graph_that_draws_random_numbers_replays_right(be: hal.Backend) -> None:
    def dropout(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.dropout(x @ W, p=0.5, training=True)

    runner = graphkit.GraphRunner(dropout, sizes=[4, 8], backend=be, executables=1, progress=False)
    runner.capture(x=torch.zeros(8, 64))
    x = torch.randn(6, 64)
    full = (x @ W) * 2
    masks = []
    for _ in range(4):
        y = runner(x=x)
        kept = y != 0
        assert torch.allclose(y[kept], full[kept], atol=1e-5)  # each value dropped or scaled, never stale
        masks.append(kept)
    assert any(not torch.equal(masks[0], m) for m in masks[1:])  # fresh random numbers at every replay
    runner(x=torch.randn(3, 64))
    runner.close()


def test_a_closed_backend_or_a_released_graph_is_a_hal_error_never_a_launch(be: hal.Backend) -> None:
    runner = graphkit.GraphRunner(step, sizes=[4, 8], backend=be, executables=1, progress=False)
    runner.capture(x=torch.zeros(8, 64))
    runner(x=torch.randn(3, 64))
    ex = runner.pools.executables
    graph = runner.bucket(8).graphs[0]
    be.release_graph(graph)
    with pytest.raises(hal.InvalidStateError, match="released"):
        ex.replay(graph)
    be.close()
    with pytest.raises(hal.InvalidStateError, match="backend is closed"):
        runner(x=torch.randn(3, 64))
    runner.close()


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2", "eager"])
def test_a_bad_budget_is_refused_naming_the_argument(be: hal.Backend, bad: object) -> None:
    with pytest.raises(hal.InvalidArgumentError, match="executables="):
        graphkit.GraphRunner(step, sizes=[4], backend=be, executables=bad)
    with pytest.raises(hal.InvalidArgumentError, match="executables="):
        graphkit.GraphPools(be, executables=bad)
    with pytest.raises(hal.InvalidArgumentError, match="executables="):
        with graphkit.graph_memory(be, executables=bad):
            pass
    with pytest.raises(hal.InvalidArgumentError, match="executables="):
        Executables(be, bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("text", ["executables=0", "executables=-2", "executables=x", "executables=1.5"])
def test_the_switch_refuses_a_bad_budget_in_one_line(text: str, monkeypatch: pytest.MonkeyPatch,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    from graphkit import switch

    with pytest.raises(hal.InvalidArgumentError, match=re.escape("executables=lazy|N|off")):
        switch.parse(text)
    monkeypatch.setenv("GRAPHKIT_GRAPH_MEMORY", text)
    monkeypatch.setattr(switch, "_reported", False)
    with caplog.at_level(logging.WARNING, logger="graphkit.switch"):
        switch.plugin()
    assert switch.active() is None
    lines = [r for r in caplog.records if r.name == "graphkit.switch"]
    assert len(lines) == 1 and "\n" not in lines[0].getMessage() and not lines[0].exc_info
    assert switch.parse("executables=off").executables is None and switch.parse("executables=3").executables == 3
    assert switch.parse("executables=lazy").executables == "lazy" == switch.parse("1").executables


def test_no_budget_leaves_every_graph_its_own_executable(be: hal.Backend) -> None:
    runner = graphkit.GraphRunner(step, sizes=[4, 8], backend=be, executables=None, progress=False)
    runner.capture(x=torch.zeros(8, 64))
    assert runner.pools.executables is None
    assert len(compiled(runner_graphs(runner))) == 2  # made at their captures' end, as a framework does
    x = torch.randn(3, 64)
    assert same(runner(x=x), step(x))
    runner.close()
