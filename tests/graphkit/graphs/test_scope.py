"""graph_memory()'s process router on fake: captures through any backend object of its device are served, as
the switch serves them; a capture it leaves alone is said, once. The processes a block starts are served with its
options through the variable: a value the user set wins, and a Python without the start-up hook is said, once."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import graphkit
import hal
from graphkit import switch
from graphkit.switch import ENV, Options
from hal.backends.fake import FakeBackend
from tests.conftest import G

SIZES = (16, 8, 4)


class Engine:
    """An engine with its own backend object and its own capture loop: it never hears of graphkit."""

    def __init__(self) -> None:
        self.be = hal.get_backend("fake", granularity=G)
        self.weight = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
        self.graphs: list[tuple[Any, torch.Tensor, torch.Tensor]] = []

    def capture(self) -> None:
        pool = None
        for n in SIZES:  # nano-vllm's loop: the first graph's pool is passed to the later ones
            graph, x = self.be.create_graph(), torch.zeros(n, 64)
            with self.be.capture(graph, pool=pool):
                y = torch.relu(x @ self.weight)
            pool = pool or self.be.create_pool()
            self.graphs.append((graph, x, y))
        self.be.release_pool(pool)

    def worst_error(self) -> float:
        worst = 0.0
        for graph, x, y in self.graphs:
            x.copy_(torch.randn_like(x))
            self.be.replay(graph)
            worst = max(worst, (y - torch.relu(x @ self.weight)).abs().max().item())
        return worst

    def close(self) -> None:
        for graph, _, _ in self.graphs:
            self.be.release_graph(graph)
        self.graphs.clear()
        self.be.close()


@pytest.fixture
def engine() -> Iterator[Engine]:
    made = Engine()
    yield made
    made.close()


def test_the_scope_serves_the_captures_of_another_backend_object_of_its_device(engine: Engine,
                                                                                caplog) -> None:
    scope_be = hal.get_backend("fake", granularity=G)
    assert scope_be is not engine.be
    with caplog.at_level(logging.WARNING), graphkit.graph_memory(scope_be) as pools:
        engine.capture()
    report = pools.report()
    assert [k.graphs for k in report.keys] == [1] * len(SIZES)
    # the largest, not the sum, plus the granules under the outputs the loop keeps (each its key's alone)
    assert 0 < report.chunk_bytes <= max(k.mapped_bytes for k in report.keys) + report.survivor_bytes
    spaces = list(pools.allocator.spaces.values())
    for _, _, y in engine.graphs:  # the outputs live in graphkit's spaces, not in the engine's pool
        assert any(space.contains(y.data_ptr()) for space in spaces)
    assert engine.worst_error() < 1e-5
    assert not caplog.records, caplog.text
    engine.close()
    pools.close()
    scope_be.close()


def _keys_served(run: Callable[[], None]) -> int:
    """How many keys the switch made for what ``run`` captured."""
    scope = switch.start(switch.Options(report=0))
    try:
        run()
    finally:
        switch.stop()
    served = scope.pools.pop(("fake", 0))
    count = len(served.keys)
    served.close()
    return count


def test_the_scope_and_the_switch_route_the_same_captures(engine: Engine) -> None:
    assert switch.active() is None
    scope_be = hal.get_backend("fake", granularity=G)
    with graphkit.graph_memory(scope_be) as pools:
        engine.capture()
    in_scope = len(pools.report().keys)
    for graph, _, _ in engine.graphs:
        engine.be.release_graph(graph)
    engine.graphs.clear()
    pools.close()
    scope_be.close()
    assert _keys_served(engine.capture) == in_scope == len(SIZES)


class Other(FakeBackend):
    """fake's memory under another backend's name: a plugin's device beside the scope's."""

    def __init__(self, device: int = 0, **options: Any) -> None:
        super().__init__(device, granularity=G, **options)
        self.init_host_graphs("other", alloc=self.device_malloc, free=self.device_free, segment_size=G)


def test_a_capture_of_another_backend_is_left_alone_and_said_once(be: hal.Backend, caplog) -> None:
    other = hal.Backend("other", Other())
    weight = torch.randn(64, 64)
    graphs = []
    with caplog.at_level(logging.WARNING, "graphkit"), graphkit.graph_memory(be) as pools:
        for n in (8, 4):
            graph = other.create_graph()
            with other.capture(graph):
                torch.relu(torch.zeros(n, 64) @ weight)
            graphs.append(graph)
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1, warned
    assert repr(be) in warned[0] and "graph_memory(hal.get_backend('other', device=0))" in warned[0]
    assert pools.keys == []
    for graph in graphs:
        other.release_graph(graph)
    other.close()
    pools.close()


def test_the_childrens_variable_stays_while_any_block_is_open_in_any_thread(monkeypatch) -> None:
    """Two engines, one per device, each in a ``graph_memory()`` block of its own thread: the block that ends first
    leaves the variable to the one still open (a count of open blocks owns it); the last one removes it."""
    import os
    import threading

    from graphkit.graphs.scope import FROM_ENV

    env = "GRAPHKIT_GRAPH_MEMORY"
    monkeypatch.delenv(env, raising=False)
    monkeypatch.delenv(FROM_ENV, raising=False)
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    seen: dict[str, str | None] = {}

    def engine(device: int, enter_after: threading.Event | None, signal: threading.Event,
               leave_after: threading.Event | None) -> None:
        be = hal.get_backend("fake", device=device, device_count=2, granularity=G)
        if enter_after is not None:
            enter_after.wait(10)
        with graphkit.graph_memory(be, outputs="replay" if device else "kept") as pools:
            signal.set()
            if leave_after is not None:
                leave_after.wait(10)
                seen["open"] = os.environ.get(env)
        pools.close()
        be.close()
        if device == 0:
            first_out.set()

    threads = [threading.Thread(target=engine, args=(0, None, first_in, second_in)),
               threading.Thread(target=engine, args=(1, first_in, second_in, first_out))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert seen["open"] is not None and switch.parse(seen["open"]).outputs == "kept"  # the first block's value
    assert env not in os.environ and FROM_ENV not in os.environ  # the last block put everything back


def _fork_child(be: hal.Backend, pools: graphkit.GraphPools, kept: torch.Tensor, conn: Any) -> None:
    """What a fork child inside the block sees: the parent's backend refuses it, and its own captures are not
    routed into the parent's pools (whose fake chunks it shares with the parent)."""
    import os

    seen: dict[str, Any] = {}
    try:
        graph = be.create_graph()
    except hal.InvalidStateError as exc:
        seen["parent's backend"] = str(exc)
    own = hal.get_backend("fake", granularity=G)
    keys = len(pools.keys)
    graph = own.create_graph()
    with own.capture(graph):
        y = torch.full((64, 64), 7.0) * 2  # in a private pool of the child's own device
    seen["routed into the parent's pools"] = len(pools.keys) != keys
    seen["own capture"] = float(y[0, 0])
    own.release_graph(graph)
    own.close()
    be.close()  # forgets: everything it holds is the parent's
    seen["parent's output as the child leaves"] = float(kept[0, 0])
    conn.send(seen)
    conn.close()
    os._exit(0)


def test_a_fork_child_inside_the_block_writes_nothing_of_the_parents(be: hal.Backend) -> None:
    """On fake a fork child shares the parent's chunks (memfd mappings survive a fork): the block and the parent's
    backend serve the parent alone, as a device context does, so nothing the child captures lands in them."""
    import multiprocessing

    weight = torch.randn(64, 64)
    with graphkit.graph_memory(be) as pools:
        graph, x = be.create_graph(), torch.ones(64, 64)
        with be.capture(graph):
            kept = torch.relu(x @ weight) + 1
        be.replay(graph)
        want = kept.clone()
        ctx = multiprocessing.get_context("fork")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_fork_child, args=(be, pools, kept, child))
        proc.start()
        seen = parent.recv() if parent.poll(60) else {}
        proc.join(60)
    assert proc.exitcode == 0 and seen, seen
    assert "was made in process" in seen["parent's backend"] and "fork child" in seen["parent's backend"]
    assert seen["routed into the parent's pools"] is False and seen["own capture"] == 14.0
    assert torch.equal(kept, want) and seen["parent's output as the child leaves"] == float(want[0, 0])
    be.replay(graph)
    torch.testing.assert_close(kept, torch.relu(x @ weight) + 1)
    be.release_graph(graph)
    del kept
    pools.close()


def test_a_value_set_already_wins_over_the_blocks(monkeypatch) -> None:
    """A block leaves a variable the user set alone (``0`` included), and puts back what it set."""
    from graphkit.graphs.scope import FROM_ENV

    be = hal.get_backend("fake")
    monkeypatch.setenv(ENV, "0")
    with graphkit.graph_memory(be):
        assert os.environ[ENV] == "0" and FROM_ENV not in os.environ
    monkeypatch.delenv(ENV)
    with graphkit.graph_memory(be, outputs="replay") as pools:
        assert switch.parse(os.environ[ENV]) == Options(outputs="replay")
        assert os.environ[FROM_ENV] == str(os.getpid())
        assert switch.start_from_environment() is None  # this process is the block's
    assert ENV not in os.environ and FROM_ENV not in os.environ
    with graphkit.graph_memory(be, children=False):
        assert ENV not in os.environ
    with pytest.raises(hal.InvalidArgumentError, match="children="):
        with graphkit.graph_memory(be, children="yes"):  # type: ignore[arg-type]
            pass
    pools.close()


def test_a_block_says_once_when_this_python_cannot_serve_the_processes_it_starts(monkeypatch, tmp_path: Path,
                                                                                  caplog) -> None:
    """Without the start-up hook in this interpreter's site-packages (``pip`` of another Python installed the
    package), processes started inside a block never read the variable: the block says so, naming this Python
    and the fix, once per process; with the hook there it says nothing."""
    from graphkit.graphs import scope

    be = hal.get_backend("fake")
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setattr(scope, "_hook_warned", False)
    monkeypatch.setattr(scope, "hook_folders", lambda: [str(tmp_path)])
    with caplog.at_level(logging.WARNING, logger="graphkit.graphs.scope"):
        for _ in range(2):
            with graphkit.graph_memory(be) as pools:
                pass
            pools.close()
    said = [r.getMessage() for r in caplog.records if "will not be served" in r.getMessage()]
    assert len(said) == 1 and sys.executable in said[0] and "-m pip install" in said[0], said
    caplog.clear()
    monkeypatch.setattr(scope, "_hook_warned", False)
    (tmp_path / scope.HOOK_FILE).write_text("")
    with caplog.at_level(logging.WARNING, logger="graphkit.graphs.scope"):
        with graphkit.graph_memory(be) as pools:
            pass
        pools.close()
    assert not [r for r in caplog.records if "will not be served" in r.getMessage()]
    assert scope.startup_hook_installed()
