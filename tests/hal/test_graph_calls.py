"""The graph half of the facade refuses what is not a graph, pool, stream or router at the call that got it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import hal
from tests.conftest import G


@pytest.fixture
def be() -> Iterator[hal.Backend]:
    with hal.get_backend("fake", granularity=G) as backend:
        yield backend


def _capture(be: hal.Backend, **kwargs: Any) -> None:
    graph = be.create_graph()
    with be.capture(graph, **kwargs):
        torch.ones(4) + 1


CALLS: dict[str, tuple[str, Callable[[hal.Backend], Any]]] = {
    "capture(pool=5)": ("pool=5 is not a pool of this backend", lambda be: _capture(be, pool=5)),
    "capture(stream='s')": ("stream='s' is not a stream", lambda be: _capture(be, stream="s")),
    "capture('g')": ("graph='g' is not a graph", lambda be: be.capture("g")),
    "use_pool(5)": ("pool=5 is not a pool", lambda be: be.use_pool(5)),
    "release_pool('p')": ("pool='p' is not a pool", lambda be: be.release_pool("p")),
    "capture(pool=())": (r"pool=\(\) is not a pool", lambda be: _capture(be, pool=())),
    "pool_active_blocks(None)": ("pool=None is not a pool", lambda be: be.pool_active_blocks(None)),
    "replay(None)": ("graph=None is not a graph", lambda be: be.replay(None)),
    "release_graph(5)": ("graph=5 is not a graph", lambda be: be.release_graph(5)),
    "graph_addresses('g')": ("graph='g' is not a graph", lambda be: be.graph_addresses("g")),
    "synchronize(7)": ("stream=7 is not a stream", lambda be: be.synchronize(7)),
    "use_stream('s')": ("stream='s' is not a stream", lambda be: be.use_stream("s")),
}


@pytest.mark.parametrize("call", list(CALLS))
def test_a_plain_value_for_a_graph_pool_or_stream_is_refused_naming_the_argument(be: hal.Backend, call: str) -> None:
    fragment, fn = CALLS[call]
    with pytest.raises(hal.InvalidArgumentError, match=fragment) as info:
        fn(be)
    assert info.value.backend == "fake" and "create_" in str(info.value)  # names where a real one comes from
    assert be.live.graphs <= 1 and be.live.pools == 0


def test_routers_that_are_no_routers_are_refused_with_hal_errors(be: hal.Backend) -> None:
    with pytest.raises(hal.InvalidArgumentError, match="router=5 must be callable"):
        with hal.route_every_capture(5):  # type: ignore[arg-type]
            pass
    with pytest.raises(hal.InvalidArgumentError, match=r"a capture router returned 5: it must return a hal\.types"):
        with be.route_captures(lambda graph, pool: 5):  # type: ignore[arg-type,return-value]
            _capture(be)
    _capture(be)  # nothing stayed behind: the next capture runs


def test_objects_of_the_backend_still_pass(be: hal.Backend) -> None:
    x = torch.ones(4)
    graph, pool, stream = be.create_graph(), be.create_pool(), be.create_stream()
    with be.capture(graph, pool, stream):
        y = x * 2
    x.fill_(3.0)
    be.replay(graph)
    assert torch.equal(y, torch.full((4,), 6.0))
    be.synchronize(stream)
    be.release_graph(graph)
    del y
    be.release_pool(pool)


def test_a_lazy_graph_is_compiled_at_its_first_replay_and_replays_as_an_eager_one(be: hal.Backend) -> None:
    x = torch.arange(8, dtype=torch.float32)
    outs, graphs = {}, {}
    for lazy in (False, True):
        graphs[lazy] = be.create_graph(lazy=lazy)
        with be.capture(graphs[lazy]):
            outs[lazy] = torch.relu(x * 2 - 5).cumsum(0)
    assert graphs[False].compiled and not graphs[True].compiled  # the tape's instantiation waits for a replay
    x.copy_(torch.linspace(-3, 3, 8))
    for graph in graphs.values():
        be.replay(graph)
    assert graphs[True].compiled
    torch.testing.assert_close(outs[True], outs[False], rtol=0, atol=0)
    torch.testing.assert_close(outs[True], torch.relu(x * 2 - 5).cumsum(0))


def test_lazy_needs_its_capability_and_a_bool(be: hal.Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(hal.InvalidArgumentError, match="lazy=1 must be True or False"):
        be.create_graph(lazy=1)  # type: ignore[arg-type]
    monkeypatch.setattr(be, "_capabilities", be.capabilities - {"lazy_graphs"})
    with pytest.raises(hal.UnsupportedError, match="lazy_graphs"):
        be.create_graph(lazy=True)
    assert be.create_graph() is not None


def test_an_updated_graph_replays_its_sources_work(be: hal.Backend) -> None:
    xs = [torch.arange(8, dtype=torch.float32) * k for k in (1, 2, 3)]
    graphs, outs = [], []
    for k, x in enumerate(xs):
        graphs.append(be.create_graph(lazy=k > 0))  # the first is the one executable graph; the others its sources
        with be.capture(graphs[-1], be.create_pool()):
            outs.append(torch.relu(x - 4) * 2)
    for x in xs:
        x.add_(1)
    for k in (2, 1, 2):
        be.update_graph(graphs[0], graphs[k])
        outs[k].zero_()
        be.replay(graphs[0])
        torch.testing.assert_close(outs[k], torch.relu(xs[k] - 4) * 2, rtol=0, atol=0)
    assert not graphs[1].compiled and not graphs[2].compiled  # the sources are never instantiated


def test_an_update_across_topologies_or_from_an_eager_graph_is_refused(be: hal.Backend) -> None:
    x = torch.ones(4)
    eager, other, lazy = be.create_graph(), be.create_graph(lazy=True), be.create_graph(lazy=True)
    with be.capture(eager):
        out = x * 2
    with be.capture(other):
        x * 2 + 1  # one op more
    with be.capture(lazy):
        x * 3
    with pytest.raises(hal.InvalidArgumentError, match=r"topology differs.*2 op.*against 1"):
        be.update_graph(eager, other)
    with pytest.raises(hal.InvalidArgumentError, match="lazy=True"):
        be.update_graph(lazy, eager)
    with pytest.raises(hal.InvalidArgumentError, match="source=None is not a source"):
        be.update_graph(eager, None)
    be.replay(eager)  # left as it was
    torch.testing.assert_close(out, x * 2)
    be.release_graph(lazy)
    with pytest.raises(hal.InvalidStateError, match="source was released"):
        be.update_graph(eager, lazy)


def test_an_updated_graph_follows_its_sources_pool(be: hal.Backend) -> None:
    x = torch.ones(4)
    graph, source = be.create_graph(), be.create_graph(lazy=True)
    pool = be.create_pool()
    with be.capture(graph):
        x + 1
    with be.capture(source, pool):
        x + 2
    be.update_graph(graph, source)
    be.release_graph(source)  # its memory stays with its pool: the updated graph still replays
    be.replay(graph)
    be.release_pool(pool)
    with pytest.raises(hal.InvalidStateError, match="pool the graph was captured into was released"):
        be.replay(graph)


def test_updates_need_their_capability(be: hal.Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(be, "_capabilities", be.capabilities - {"graph_update"})
    with pytest.raises(hal.UnsupportedError, match="graph_update"):
        be.update_graph(be.create_graph(), be.create_graph(lazy=True))


def test_a_lazy_graph_updated_with_itself_is_compiled_and_gets_its_own_work_back(be: hal.Backend) -> None:
    x = torch.ones(4)
    a, b = be.create_graph(lazy=True), be.create_graph(lazy=True)
    with be.capture(a):
        out_a = x * 2
    with be.capture(b):
        out_b = x * 5
    be.update_graph(a, a)
    assert a.compiled
    be.update_graph(a, b)
    be.update_graph(a, a)
    x.fill_(3)
    be.replay(a)
    torch.testing.assert_close(out_a, x * 2)
    torch.testing.assert_close(out_b, torch.full((4,), 5.0))  # b's work did not run
