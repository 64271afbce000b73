"""GraphPools and graph_memory on fake: keys, groups, routing, lifetimes, misuse,
and the routing of a framework class."""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import threading
import time

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import graphkit
import hal
from hal.routing import GraphClassRouting
from hal.types import Route
from tests.conftest import G
from tests.values import BAD_VALUE_SETTINGS, BadEq, BadHash, refused_cleanly

SIZES = [16, 8, 4, 2, 1]


def make_step(width: int = 256):
    gen = torch.Generator().manual_seed(0)
    w1 = torch.randn(width, width, generator=gen) / width ** 0.5
    w2 = torch.randn(width, width, generator=gen) / width ** 0.5

    def step(x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(x @ w1)
        return torch.relu(h @ w2) + h

    return step


def capture(be: hal.Backend, fn, x: torch.Tensor, pool=None):
    graph = be.create_graph()
    try:
        with be.capture(graph, pool=pool):
            out = fn(x)
    except BaseException:
        be.release_graph(graph)
        raise
    return graph, out


def replays_match(be: hal.Backend, fn, graphs: dict) -> None:
    for n, (graph, x, out) in graphs.items():
        x.copy_(torch.randn(n, x.shape[1]))
        be.replay(graph)
        torch.testing.assert_close(out, fn(x), rtol=1e-5, atol=1e-5)


def test_each_capture_in_the_scope_gets_its_own_space_over_shared_chunks(be: hal.Backend) -> None:
    step = make_step()
    engine_pool = be.create_pool()  # the engine's own shared pool: must not be used inside the scope
    graphs = {}
    with graphkit.graph_memory(be) as pools:
        for n in SIZES:
            x = torch.zeros(n, 256)
            graph, out = capture(be, step, x, pool=engine_pool)
            graphs[n] = (graph, x, out)
    report = pools.report()
    assert len(report.keys) == len(SIZES)
    spaces = [pools.allocator.spaces[e.space_id] for e in pools._keys.entries.values()]
    assert len({s.base for s in spaces}) == len(spaces)
    assert be.pool_active_blocks(engine_pool) == []  # nothing was drawn from the engine's pool
    # N captures cost at most the largest one plus the outputs the engine keeps (each its key's alone, as in the
    # engine's own pool): the granule under a kept output is its key's, the others are shared
    alloc = pools.allocator
    kept = {out.data_ptr() // be.granularity for _, _, out in graphs.values()}
    assert alloc.survivor_bytes == len(kept) * be.granularity
    assert report.chunk_bytes == alloc.shared_bytes + alloc.survivor_bytes
    assert report.chunk_bytes <= max(k.mapped_bytes for k in report.keys) + alloc.survivor_bytes
    # every space maps what it uses: at least one map call per space, counted with its time
    assert report.map_calls == pools.allocator.stats().map_calls >= len(SIZES) and report.map_seconds > 0
    assert f"{report.map_calls} map calls in" in str(report)
    be.release_pool(engine_pool)
    replays_match(be, step, graphs)
    for graph, _, _ in graphs.values():
        be.release_graph(graph)
    del graphs, graph, out
    pools.close()


def test_the_scope_is_what_engines_write(be: hal.Backend) -> None:
    """nano-vllm's loop: the first graph's pool is passed to the later captures; outputs kept."""
    step = make_step()
    graphs: dict = {}
    graph_pool = None
    with graphkit.graph_memory(be) as pools:
        for n in SIZES:
            x = torch.zeros(n, 256)
            graph, out = capture(be, step, x, pool=graph_pool)
            graph_pool = graph_pool or be.create_pool()
            graphs[n] = (graph, x, out)
    assert len(pools.report().keys) == len(SIZES)
    replays_match(be, step, graphs)
    for graph, _, _ in graphs.values():
        be.release_graph(graph)
    be.release_pool(graph_pool)
    del graphs, graph, out
    pools.close()
    assert be.live.zero, be.live


def test_same_key_same_handle_and_space(be: hal.Backend) -> None:
    step = make_step()
    with graphkit.GraphPools(be) as pools:
        h = pools.pool(8)
        assert pools.pool(8) is h and isinstance(h, tuple) and len(h) == 2
        x = torch.zeros(8, 256)
        g1, o1 = capture(be, step, x, pool=h)
        g2, o2 = capture(be, lambda t: step(t) * 2, x, pool=h)
        space = pools.allocator.spaces[pools._keys.entries[8].space_id]
        assert len(pools.report().keys) == 1 and space.contains(o1.data_ptr()) and space.contains(o2.data_ptr())
        x.copy_(torch.randn(8, 256))
        be.replay(g1)
        be.replay(g2)
        torch.testing.assert_close(o2, 2 * o1)
        for g in (g1, g2):
            be.release_graph(g)
        del o1, o2
    assert be.live.zero, be.live


def test_a_group_keeps_the_pieces_of_one_batch_in_one_space(be: hal.Backend) -> None:
    """Piece 0's output feeds piece 1: in one space they never share physical bytes."""
    step = make_step()
    pieces: dict = {}
    with graphkit.graph_memory(be) as pools:
        for n in SIZES:
            x = torch.zeros(n, 256)
            with pools.group(("batch", n)):
                g0, mid = capture(be, step, x)
                g1, out = capture(be, step, mid)
            pieces[n] = (x, g0, g1, out)
    assert sorted(k.key for k in pools.report().keys) == sorted(("batch", n) for n in SIZES)
    for n, (x, g0, g1, out) in pieces.items():
        x.copy_(torch.randn(n, 256))
        be.replay(g0)
        be.replay(g1)
        torch.testing.assert_close(out, step(step(x)), rtol=1e-5, atol=1e-5)
    for _, g0, g1, _ in pieces.values():
        be.release_graph(g0)
        be.release_graph(g1)
    del pieces, out, mid
    pools.close()
    assert be.live.zero, be.live


@pytest.mark.parametrize("outputs", ["kept", "replay"])
def test_without_a_group_the_pieces_replay_right_unless_declared_replay_scoped(be: hal.Backend, outputs: str) -> None:
    """The same pieces in separate spaces over shared chunks: piece 1's output outlives its capture, so it gets
    bytes of its own and piece 2 reads it right (construction, no verifier). Declared replay-scoped
    (``outputs="replay"``), it stays on the shared chunks and piece 2's own memory overwrites it: why groups
    exist for engines that declare so."""
    step = make_step()
    w = torch.randn(256, 256) / 16

    def residual(t: torch.Tensor) -> torch.Tensor:  # reads its input after its first result is written
        return torch.tanh(t @ w) + t

    wrong = 0
    with graphkit.graph_memory(be, outputs=outputs) as pools:
        x = torch.zeros(16, 256)
        g0, mid = capture(be, step, x)
        g1, out = capture(be, residual, mid)
    assert (pools.allocator.survivor_bytes > 0) == (outputs == "kept")
    for _ in range(3):
        x.copy_(torch.randn(16, 256))
        be.replay(g0)
        be.replay(g1)
        wrong += not torch.allclose(out, residual(step(x)), rtol=1e-4, atol=1e-4)
    assert bool(wrong) == (outputs == "replay")
    be.release_graph(g0)
    be.release_graph(g1)
    del out, mid
    pools.close()


def test_handles_asked_for_up_front_keep_room_for_their_captures(be: hal.Backend) -> None:
    """Engines make their handles first (``{bs: pools.pool(bs) for bs in sizes}``), then capture in any order;
    a second piece goes into an earlier key after other keys captured."""
    step = make_step()
    with graphkit.GraphPools(be) as pools:
        handles = {n: pools.pool(n) for n in (1, 64, 8)}
        graphs = {}
        for n in (64, 1, 8):  # 64 rows take several granules; its space was opened before the others
            x = torch.zeros(n, 256)
            graphs[n] = (x, *capture(be, step, x, pool=handles[n]))
        mid = graphs[64][2]
        g1, out = capture(be, step, mid, pool=handles[64])  # piece 2 of key 64, reading piece 1's output
        assert not any(pools.allocator.spaces[pools.lease(n).space_id].sealed for n in handles)
        for n, (x, graph, o) in graphs.items():
            x.copy_(torch.randn(n, 256))
            be.replay(graph)
            torch.testing.assert_close(o, step(x), rtol=1e-5, atol=1e-5)
        be.replay(g1)
        torch.testing.assert_close(out, step(mid), rtol=1e-5, atol=1e-5)
        for graph in [g1, *(g for _, g, _ in graphs.values())]:
            be.release_graph(graph)
        del graphs, mid, out, o
    assert be.live.zero, be.live


@pytest.mark.parametrize("routed", [False, True], ids=["handles", "graph_memory"])
def test_two_threads_capture_into_two_keys_at_once(be: hal.Backend, routed: bool) -> None:
    """Thread B opens a key and captures into it while thread A's capture is under way (dual-batch overlap): A's
    space keeps its room, both replay right. On a host device a capture runs its work as it records it, so the
    two captures take turns (their memory is shared): B's starts once A's has ended."""
    step = make_step()
    pools = graphkit.GraphPools(be)
    a_started, b_opening = threading.Event(), threading.Event()
    done: dict = {}
    order: list[str] = []

    def capture_in_thread(name: str, n: int, between=None) -> None:
        x = torch.zeros(n, 256)
        graph = be.create_graph()
        try:
            with be.capture(graph, pool=None if routed else pools.pool(name)):
                order.append(f"{name} runs")
                h = step(x)
                if between is not None:
                    between()
                out = step(h) + h  # more granules, after the other thread opened its key
                order.append(f"{name} ends")
            done[name] = (x, graph, out)
        except BaseException as exc:  # noqa: BLE001 - checked below
            done[name] = exc
            be.release_graph(graph)

    def thread_a() -> None:
        def between() -> None:
            a_started.set()
            b_opening.wait(10)
            time.sleep(0.05)  # B's key opens (handles), or B's capture waits for its turn (routed)
        capture_in_thread("a", 64, between)
        a_started.set()

    def thread_b() -> None:
        a_started.wait(10)
        if not routed:
            pools.pool("b")  # a key opened while A captures seals nothing
        b_opening.set()
        capture_in_thread("b", 32)

    with graphkit.graph_memory(pools=pools) if routed else contextlib.nullcontext():
        threads = [threading.Thread(target=thread_a), threading.Thread(target=thread_b)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert all(isinstance(v, tuple) for v in done.values()), done
    assert order == ["a runs", "a ends", "b runs", "b ends"]
    for x, graph, out in done.values():
        x.copy_(torch.randn(*x.shape))
        be.replay(graph)
        torch.testing.assert_close(out, step(step(x)) + step(x), rtol=1e-5, atol=1e-5)
        be.release_graph(graph)
    done.clear()
    del out
    pools.close()
    assert be.live.zero, be.live


def test_a_space_lives_as_long_as_its_graph(be: hal.Backend) -> None:
    step = make_step()
    with graphkit.graph_memory(be) as pools:
        g16, o16 = capture(be, step, torch.zeros(16, 256))
        g1, o1 = capture(be, step, torch.zeros(1, 256))
    assert pools.allocator.num_virtual_spaces == 2
    del o16  # the output's block frees the space's last allocation
    be.release_graph(g16)  # released: its space goes at once
    assert pools.allocator.num_virtual_spaces == 1 and len(pools.keys) == 1
    assert pools.allocator.physical_bytes == G  # the large graph's chunks went with it
    assert pools.allocator.survivor_bytes == G  # the small one's kept output: a granule its key alone maps
    del g1, o1  # dropped without release: collected, released at the next safe point
    gc.collect()
    pools.collect()
    assert pools.allocator.num_virtual_spaces == 0 and pools.keys == []
    pools.close()
    assert be.live.chunks == 0 and be.live.ranges == 0 and be.live.mappings == 0


def test_a_stale_handle_raises_a_hal_error(be: hal.Backend) -> None:
    pools = graphkit.GraphPools(be)
    h = pools.pool("b1")
    pools.release("b1")
    with pytest.raises(hal.InvalidStateError, match=r"'b1'.*released"):
        capture(be, make_step(), torch.zeros(1, 256), pool=h)
    with pytest.raises(hal.InvalidStateError):
        tuple(h)  # what a framework does with a pool id
    with pytest.raises(hal.InvalidStateError):
        h[0]
    assert h.released and "released" in repr(h)
    assert pools.pool("b1") is not h  # a new handle for the key
    pools.close()
    with pytest.raises(hal.InvalidStateError, match="closed"):
        pools.pool("b2")
    with pytest.raises(hal.InvalidStateError, match="closed"):
        with graphkit.graph_memory(pools=pools):
            capture(be, make_step(), torch.zeros(1, 256))
    assert be.live.graphs == 0


def test_a_handle_keeps_its_pools_alive(be: hal.Backend) -> None:
    """The trap of a pool id whose pool object died: a handle holds its GraphPools."""
    step = make_step()
    h = graphkit.GraphPools(be).pool(4)  # the GraphPools object itself is dropped at once
    gc.collect()
    x = torch.zeros(4, 256)
    graph, out = capture(be, step, x, pool=h)
    owner = h._owner
    assert not owner.closed and owner.allocator.physical_bytes > 0  # drawn from graphkit's chunks
    x.copy_(torch.randn(4, 256))
    be.replay(graph)
    torch.testing.assert_close(out, step(x), rtol=1e-5, atol=1e-5)
    be.release_graph(graph)
    del out
    owner.close()


def test_misuse_is_loud(be: hal.Backend, caplog: pytest.LogCaptureFixture) -> None:
    """A capture that allocated through the device's own allocator instead of graphkit's, and a cache
    born inside a capture, are reported; exact leftovers raise in strict mode."""
    pools = graphkit.GraphPools(be, hygiene=True)
    pools.pool("k")
    wrong = be.create_pool()
    pools._keys.entries["k"].pool = wrong  # as if the framework ignored graphkit's pool
    cache: dict = {}

    def step(x: torch.Tensor) -> torch.Tensor:
        cache.setdefault("table", torch.ones(512, 64))  # born inside the capture and kept
        return x * 2 + cache["table"][: x.shape[0], :1]

    with caplog.at_level(logging.INFO, logger="graphkit.graphs"):
        with graphkit.graph_memory(pools=pools):
            with pools.group("k"):
                graph, out = capture(be, step, torch.zeros(4, 1))
    assert "did not come from graphkit's space" in caplog.text and "'k'" in caplog.text
    be.release_graph(graph)
    cache.clear()
    be.release_pool(wrong)
    pools._keys.entries["k"].pool = be.create_pool(*pools.allocator.pool_callbacks(pools._keys.entries["k"].space_id))
    pools.release("k")
    # exact check with the outputs known: a kept cache raises in strict mode
    with graphkit.graph_memory(pools=pools):
        with pools.group("k2"):
            graph, out = capture(be, step, torch.zeros(4, 1))
    with pytest.raises(graphkit.CaptureHygieneError, match="k2"):
        pools.leftovers("k2", out, strict=True)
    assert pools.leftovers("k2", (out, cache["table"])) == []
    be.release_graph(graph)
    cache.clear()
    del out
    pools.close()


def test_the_scope_restores_the_backend_also_on_errors(be: hal.Backend) -> None:
    step = make_step()
    with pytest.raises(RuntimeError, match="engine failed"):
        with graphkit.graph_memory(be) as pools:
            capture(be, step, torch.zeros(2, 256))
            raise RuntimeError("engine failed")
    assert be.plugin._routers == []
    graph, _out = capture(be, step, torch.zeros(2, 256))  # outside: a private pool, not graphkit's
    assert len(pools.keys) == 1
    be.release_graph(graph)
    pools.close()


def test_shared_fallback_where_custom_pools_are_absent(caplog: pytest.LogCaptureFixture) -> None:
    from tests.graphkit.graphs.test_runner import NoCustomPool

    be = hal.Backend("nocustompool", NoCustomPool(granularity=G))
    with caplog.at_level(logging.WARNING, logger="graphkit.graphs"):
        pools = graphkit.GraphPools(be)
    assert pools.kind == "shared" and "custom_pool" in caplog.text
    assert "GraphPools falls back to one shared pool" in caplog.text  # the warning the runner gives, too
    a, b = pools.pool(1), pools.pool(2)
    assert a is not b and tuple(a) == tuple(b) and a.__hal_pool__ is b.__hal_pool__
    pools.close()
    be.close()
    assert be.live.zero


def test_bad_arguments_name_the_argument(be: hal.Backend) -> None:
    with pytest.raises(hal.InvalidArgumentError, match="kind='bogus'"):
        graphkit.GraphPools(be, kind="bogus")
    with graphkit.GraphPools(be) as pools:
        with pytest.raises(hal.InvalidArgumentError, match="key="):
            pools.pool(["unhashable"])
        with pytest.raises(hal.InvalidStateError, match="released twice"):
            pools.release("never")
    with pytest.raises(hal.InvalidArgumentError, match="router="):
        be.route_captures("not callable")


@pytest.mark.parametrize("value", [None, "yes", "no", 2, 0, 1.0])
@pytest.mark.parametrize("option", ["verify", "hygiene"])
def test_the_newer_options_take_a_bool_and_name_themselves_otherwise(be: hal.Backend, option: str,
                                                                     value: object) -> None:
    """verify= and hygiene= of GraphPools and graph_memory are checked as outputs= is: a truthy string no longer
    turns the check on, ``verify=2`` no longer reaches the child processes as a value their switch refuses."""
    os.environ.pop("GRAPHKIT_GRAPH_MEMORY", None)
    with pytest.raises(hal.InvalidArgumentError, match=f"GraphPools: {option}={value!r} must be True or False"):
        graphkit.GraphPools(be, **{option: value})
    with pytest.raises(hal.InvalidArgumentError, match=f"graph_memory: {option}={value!r} must be True or False"):
        with graphkit.graph_memory(be, **{option: value}):
            pass
    assert "GRAPHKIT_GRAPH_MEMORY" not in os.environ and be.live.zero


def test_capture_ended_takes_blocks_and_names_shared_otherwise(be: hal.Backend) -> None:
    with graphkit.GraphPools(be) as pools:
        pools.lease("k")
        for shared in (5, [(1, -2)], ["block"], None):
            with pytest.raises(hal.InvalidArgumentError, match=r"capture_ended: shared=.* must be \(address, nbytes\)"):
                pools.capture_ended("k", shared=shared)  # type: ignore[arg-type]
        pools.capture_ended("k", shared=[])


def test_ten_thousand_spaces_fit_in_a_few_arenas(be: hal.Backend) -> None:
    """Sealed spaces take the address space they use, not a device each."""
    alloc = graphkit.SharedVMMAllocator(be, reserve_bytes=64 * G)
    for i in range(10_000):
        alloc.switch_to_new_virtual_space()
        alloc.allocate(G if i % 10 else 3 * G)
    assert alloc.num_virtual_spaces == 10_000
    assert alloc.physical_bytes == 3 * G
    assert alloc.num_arenas <= 10_000 * 3 * G // alloc.arena_bytes + 2
    assert be.live.mappings == 9_000 + 3 * 1_000
    alloc.close()
    assert be.live.zero


# -- the routing of a framework's graph class (torch.cuda.CUDAGraph, torch.npu.NPUGraph) ---------------


class FrameworkGraph:
    """Stands for torch.cuda.CUDAGraph: capture_begin(pool, ...), capture_end(), reset()."""

    def __init__(self) -> None:
        self.pool_used = None
        self.fail_end = False
        self.resets = 0

    def capture_begin(self, pool=None, capture_error_mode="global"):
        self.pool_used = pool

    def capture_end(self):
        if self.fail_end:
            raise RuntimeError("capture invalidated")

    def reset(self):
        self.resets += 1


def test_framework_graph_class_routing_patches_and_restores_exactly() -> None:
    before = dict(vars(FrameworkGraph))
    events: list = []

    class Pool:
        id = (7, 7)

    def router(graph, requested):
        events.append(("begin", requested))
        return Route(Pool(), lambda ok: events.append(("end", ok)), lambda c: events.append(("released", c)))

    routing = GraphClassRouting(FrameworkGraph, lambda: 0, lambda pool: pool.id)
    with routing.activate(0, router):
        assert dict(vars(FrameworkGraph)) != before
        g = FrameworkGraph()
        g.capture_begin((1, 2), capture_error_mode="relaxed")
        assert g.pool_used == (7, 7)  # the router's pool, not the engine's
        g.capture_end()
        bad = FrameworkGraph()
        bad.fail_end = True
        bad.capture_begin(pool=None)
        with pytest.raises(RuntimeError):
            bad.capture_end()
        other_device = FrameworkGraph()
        with routing.activate(1, lambda *_: pytest.fail("wrong device")):
            other_device.capture_begin((3, 3))
        assert other_device.pool_used == (7, 7)
        other_device.capture_end()
        held = [FrameworkGraph()]
        held[0].capture_begin()
        held[0].capture_end()
    held.pop().reset()  # the graph dies while its reset is looked up: no error, released once
    assert dict(vars(FrameworkGraph)) == before  # the class is exactly as it was
    assert events[:4] == [("begin", (1, 2)), ("end", True), ("begin", None), ("end", False)]
    released = events.count(("released", True)) + events.count(("released", False))
    assert released == 1  # the graph that died on reset's lookup
    g.reset()
    g.reset()
    assert g.resets == 2 and events.count(("released", False)) + events.count(("released", True)) == 2
    del other_device
    gc.collect()
    assert len([e for e in events if e[0] == "released"]) == 3  # the dropped graph too, when collected
    plain = FrameworkGraph()
    plain.capture_begin((5, 5))
    assert plain.pool_used == (5, 5)  # outside the block nothing is routed


def test_torch_cuda_graph_class_is_restored_exactly_after_routing() -> None:
    cls = torch.cuda.CUDAGraph
    before = dict(vars(cls))
    routing = GraphClassRouting(cls, lambda: 0, lambda pool: pool.id)
    with pytest.raises(ValueError):
        with routing.activate(0, lambda *_: None):
            assert vars(cls)["capture_begin"] is not before["capture_begin"]
            raise ValueError("engine failed")
    assert dict(vars(cls)) == before


def test_torch_npu_captures_are_routed_through_the_ascend_glue(monkeypatch: pytest.MonkeyPatch) -> None:
    """vllm-ascend's ACL graph wrapper calls torch.npu.graph(g, pool=its_pool): the scope replaces the pool."""
    import sys

    from tests.sim import compiler_reason, simulated_backend
    from tests.sim.torch_stub import extension_stub

    if compiler_reason() is not None:
        pytest.skip(str(compiler_reason()))
    from hal.backends._native.torch_glue import TorchGlue

    stub = extension_stub("torch_npu", capture_api=True)
    monkeypatch.setitem(sys.modules, "torch_npu", stub)
    monkeypatch.setattr(TorchGlue, "torch_device", lambda self: torch.device("meta"))  # plain torch has no "npu"
    with simulated_backend("ascend", capacity=64 * G, granularity=G, use_torch=True) as be:
        assert "capture_routing" in be.capabilities
        cls = stub.npu.NPUGraph
        before = dict(vars(cls))
        engine_pool = stub.npu.graph_pool_handle()
        with graphkit.graph_memory(be) as pools:
            graphs = []
            for _ in range(3):
                graph = stub.npu.NPUGraph()
                with stub.npu.graph(graph, pool=engine_pool):  # the engine's own call
                    pass
                graphs.append(graph)
            hal_graph = be.create_graph()
            with be.capture(hal_graph, pool=engine_pool):
                pass
        assert dict(vars(cls)) == before
        ids = [tuple(e.handle) for e in pools._keys.entries.values()]
        assert len(ids) == 4 and len(set(ids)) == 4
        assert [g.pool() for g in graphs] == ids[:3]  # each capture began in its own graphkit pool
        assert engine_pool not in [g.pool() for g in graphs]
        for graph in graphs:
            graph.reset()
        be.release_graph(hal_graph)
        pools.collect()
        assert pools.keys == []
        pools.close()


def test_the_reports_live_in_graphkit_report_and_keep_their_old_import_path() -> None:
    import graphkit.graphs.pools
    import graphkit.graphs.report

    for name in ("KeyReport", "PoolsReport", "RunnerReport", "SizeReport"):
        cls = getattr(graphkit.graphs.report, name)
        assert cls.__module__ == "graphkit.graphs.report" and getattr(graphkit, name) is cls
    assert graphkit.graphs.pools.KeyReport is graphkit.graphs.report.KeyReport
    assert graphkit.graphs.pools.PoolsReport is graphkit.graphs.report.PoolsReport


def test_private_kind_gives_every_key_a_pool_of_its_own(be: hal.Backend) -> None:
    step = make_step()
    pools = graphkit.GraphPools(be, kind="private")
    assert pools.kind == "private" and pools.allocator is None
    a, b = pools.pool(4), pools.pool(8)
    assert a.__hal_pool__ is not b.__hal_pool__ and tuple(a) != tuple(b) and be.live.pools == 2
    x = torch.zeros(4, 256)
    graph, out = capture(be, step, x, pool=a)
    x.copy_(torch.randn(4, 256))
    be.replay(graph)
    torch.testing.assert_close(out, step(x), rtol=1e-5, atol=1e-5)
    assert [k.mapped_bytes for k in pools.report().keys] == [0, 0]  # no spaces: the device's own allocator
    be.release_graph(graph)
    del out
    pools.release(4)
    assert pools.keys == [8] and be.live.pools == 1  # the key's pool went with it
    pools.close()
    assert be.live.zero, be.live
    saver = graphkit.MemorySaver(be)
    with pytest.raises(hal.UnsupportedError, match=r"kind='private'.*cannot sleep"):
        graphkit.GraphPools(be, kind="private", saver=saver)
    saver.close()
    assert be.live.zero, be.live


def test_a_vmm_strategy_collects_garbage_only_for_a_space_a_block_still_holds(
        be: hal.Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    import graphkit.graphs.strategies

    collections: list[int] = []
    collect = gc.collect
    monkeypatch.setattr(graphkit.graphs.strategies.gc, "collect", lambda *a: collections.append(1) or collect(*a))
    strategy = graphkit.graphs.strategies.VmmPools(be, park_live=False)
    idle, held = strategy.lease(), strategy.lease()
    with be.use_pool(held.pool):
        kept = torch.ones(G // 4)  # a block of the held space, alive after its pool is given back
    held_space = held.space_id
    strategy.give_back(idle)
    strategy.settle()
    assert collections == [] and strategy.allocator.num_virtual_spaces == 1  # released at once, nothing collected
    strategy.give_back(held)
    strategy.settle()
    assert collections == [1] and held_space in strategy.allocator.spaces  # waits for its last block
    del kept
    strategy.allocator.reap()
    assert strategy.allocator.num_virtual_spaces == 0
    strategy.close()
    assert be.live.zero, be.live


def test_graph_memorys_own_keys_never_equal_an_engines_key(be: hal.Backend) -> None:
    pools = graphkit.GraphPools(be)
    mine = pools.pool(("capture", 1))  # an engine keyed by (phase, batch) tuples
    x = torch.ones(4, 8)
    with graphkit.graph_memory(pools=pools):
        g = be.create_graph()
        with be.capture(g):  # routed to a key of graph_memory's own
            y = x * 2
    assert not mine.released and pools.pool(("capture", 1)) is mine
    g2 = be.create_graph()
    with be.capture(g2, pool=mine):
        z = x + 1
    assert float(z.sum()) == 64 and float(y.sum()) == 64
    be.release_graph(g)
    be.release_graph(g2)
    del y, z
    gc.collect()
    assert pools.keys == [("capture", 1)]
    pools.close()
    assert be.live.zero, be.live


def test_a_group_nested_in_a_group_of_the_same_key_keeps_its_space_open(be: hal.Backend) -> None:
    graphs = []
    with graphkit.graph_memory(be) as pools:
        with pools.group(8):
            with pools.group(8):  # a helper that groups what it captures, called inside
                g = be.create_graph()
                graphs.append(g)
                with be.capture(g):
                    a = torch.ones(16, 16) * 2
            g = be.create_graph()
            graphs.append(g)
            with be.capture(g):  # the next piece of the same batch: 256 KiB, more than one granule
                b = torch.ones(256, 256) + 1
    assert float(a.sum()) == 512 and float(b.sum()) == 2 * 256 * 256
    for g in graphs:
        be.release_graph(g)
    del a, b
    pools.close()


@BAD_VALUE_SETTINGS
@given(kind=st.one_of(st.text(max_size=5), st.integers(), st.none()), key=st.one_of(
    st.lists(st.integers(), max_size=2), st.dictionaries(st.text(max_size=2), st.integers(), max_size=1)))
def test_bad_kinds_and_keys_are_hal_errors(be: hal.Backend, kind: object, key: object) -> None:
    if kind not in ("vmm", "shared", "private"):
        with pytest.raises(hal.HalError):
            graphkit.GraphPools(be, kind=kind)  # type: ignore[arg-type]
    with graphkit.GraphPools(be) as pools:
        with pytest.raises(hal.HalError):
            pools.pool(key)  # type: ignore[arg-type]
        with pytest.raises(hal.HalError):
            pools.release(("never", 1))
    with pytest.raises(hal.HalError):
        pools.pool(1)


POOLS_BAD_CALLS = {
    "pool(a key that will not hash)": lambda be, pools: pools.pool(BadHash()),
    "pool(a key that will not compare)": lambda be, pools: pools.pool(BadEq()),
    "release([1])": lambda be, pools: pools.release([1]),
    "leftovers([1])": lambda be, pools: pools.leftovers([1], None),
    "warm_up(1)": lambda be, pools: pools.warm_up(1),
    "warm_up(runs='x')": lambda be, pools: pools.warm_up(lambda: None, runs="x"),
    "GraphPools(bogus=1)": lambda be, pools: graphkit.GraphPools(be, bogus=1),
    "GraphPools(saver=object())": lambda be, pools: graphkit.GraphPools(be, saver=object()),
    "GraphPools('fake')": lambda be, pools: graphkit.GraphPools("fake"),
    "graph_memory(pools=object())": lambda be, pools: graphkit.graph_memory(be, pools=object()).__enter__(),
    "graph_memory('fake')": lambda be, pools: graphkit.graph_memory("fake").__enter__(),
}


def _pools_with_a_key_that_will_not_compare(be: hal.Backend) -> graphkit.GraphPools:
    pools = graphkit.GraphPools(be)
    pools.pool(BadEq())  # the next key of that hash gets compared with it
    return pools


@pytest.mark.parametrize("name", sorted(POOLS_BAD_CALLS))
def test_bad_arguments_are_refused_before_anything_is_made(name: str) -> None:
    with refused_cleanly(_pools_with_a_key_that_will_not_compare) as (be, pools):
        POOLS_BAD_CALLS[name](be, pools)


def test_routed_graphs_released_while_their_outputs_live_cost_no_collection_each(
        be: hal.Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every capture and graph release is a safe point: a full collection at each made 2,000 captures take minutes."""
    import graphkit.graphs.strategies

    collections: list[int] = []
    collect = gc.collect
    x = torch.ones(8, 8)
    with graphkit.graph_memory(be) as pools:
        graphs = []
        for _ in range(20):
            graph = be.create_graph()
            with be.capture(graph):
                out = x * 2
            graphs.append((graph, out))
    monkeypatch.setattr(graphkit.graphs.strategies.gc, "collect", lambda *a: collections.append(1) or collect(*a))
    for graph, _ in graphs:
        be.release_graph(graph)  # its output still holds a block of its space
    assert collections == [] and len(pools.allocator.spaces) == 20
    outputs = [o for _, o in graphs]
    del graphs, out, graph, _
    outputs.clear()
    pools.collect()
    assert pools.allocator.num_virtual_spaces == 0  # released once their last block went
    monkeypatch.undo()
    pools.close()


@pytest.mark.parametrize("drop", ["release", "close"])
def test_a_graph_of_a_released_key_refuses_to_replay(be: hal.Backend, drop: str) -> None:
    pools = graphkit.GraphPools(be)
    x = torch.randn(8, 64)
    graph, y = capture(be, make_step(64), x, pool=pools.pool(1))
    pools.release(1) if drop == "release" else pools.close()  # the graph forgotten by its user
    with pytest.raises(hal.InvalidStateError, match="the pool the graph was captured into was released") as info:
        be.replay(graph)
    assert "capture the graph again" in str(info.value)
    be.release_graph(graph)
    del y
    pools.close()


# -- failure paths -------------------------------------------------------------------------------------------------
# GraphPools when things fail: a failed capture, a pool that will not release, faults in close.


def test_a_release_pool_fault_keeps_the_key_and_a_second_release_finishes(be: hal.Backend) -> None:
    pools = graphkit.GraphPools(be)
    g = be.create_graph()
    x = torch.zeros(4, 8)
    with be.capture(g, pool=pools.pool(4)):
        out = x * 2
    be.release_graph(g)
    del out
    gc.collect()
    be.faults.fail("release_pool", nth=1)
    with pytest.raises(hal.DriverError, match="injected"):
        pools.release(4)
    assert 4 in pools
    pools.release(4)
    assert 4 not in pools and be.live.pools == 0
    pools.close()
    assert be.live.zero, be.live


@pytest.mark.parametrize("hook", ["synchronize", "release_pool", "unmap"])
def test_close_goes_on_past_a_fault_and_a_second_close_finishes(be: hal.Backend, hook: str) -> None:
    pools = graphkit.GraphPools(be)
    for n in (8, 4):
        g = be.create_graph()
        with be.capture(g, pool=pools.pool(n)):
            out = torch.ones(n, 64) * 2
        be.release_graph(g)
        del out
    gc.collect()
    be.faults.fail(hook, nth=1)
    with pytest.raises(hal.HalError):
        pools.close()
    with pytest.raises(hal.InvalidStateError, match="closed"):
        pools.pool(2)  # nothing new while closing
    pools.close()
    assert pools.closed and be.live.zero, be.live


def test_a_failed_capture_in_the_scope_gives_its_space_back(be: hal.Backend) -> None:
    with graphkit.graph_memory(be) as pools:
        with pytest.raises(hal.CaptureError):
            capture(be, lambda x: x * float((x * 2).sum().item()), torch.ones(2, 2))
    gc.collect()  # the failed capture's temporaries, held by the exception until now
    pools.collect()
    assert pools.keys == [] and pools.allocator.num_virtual_spaces == 0
    pools.close()


@pytest.mark.parametrize("nth", [1, 2], ids=["before the capture", "after it"])
def test_a_fault_in_the_hygiene_query_of_a_routed_capture_leaves_no_key(be: hal.Backend, nth: int) -> None:
    """hygiene=True asks for the pool's blocks before a routed capture and after it: either failing fails
    the capture, whose automatic key goes like that of any failed capture."""
    pools = graphkit.GraphPools(be, hygiene=True)
    be.faults.fail("pool_active_blocks", nth=nth)
    with graphkit.graph_memory(pools=pools), pytest.raises(hal.DriverError, match="injected"):
        capture(be, lambda x: x * 2, torch.ones(8, 64))
    gc.collect()
    pools.collect()
    assert pools.keys == [] and pools.allocator.num_virtual_spaces == 0 and be.live.pools == 0
    pools.close()
    assert be.live.zero, be.live


def test_close_after_the_backends_close_finishes_with_one_warning(be: hal.Backend,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """The backend's close released every pool, space and chunk: the pools' close has nothing left to give back."""
    pools = graphkit.GraphPools(be)
    kept = capture(be, lambda x: x * 2, torch.ones(8, 64), pool=pools.pool(1))
    be.close()
    with caplog.at_level(logging.WARNING, logger="graphkit"):
        pools.close()
    assert pools.closed and pools.allocator.closed and pools.keys == []
    warned = [r.message for r in caplog.records if r.name.startswith("graphkit")]
    assert warned == [("GraphPools closed after its backend fake: nothing left to release (the backend's close "
                       "released it); close graphkit objects before their backend")]
    pools.close()  # idempotent
    del kept


def test_graph_pools_refuse_the_old_capacity_keyword(be: hal.Backend) -> None:
    with pytest.raises(hal.InvalidArgumentError, match="capacity"):
        graphkit.GraphPools(be, capacity=2 * G)
    assert be.live.zero, be.live
