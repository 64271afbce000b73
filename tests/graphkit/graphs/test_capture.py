"""Captures through the hal graph contract into vmm pools: sharing, aliasing, hygiene, host syncs."""

from __future__ import annotations

import logging
import random
from typing import Any

import pytest
import torch

import graphkit
import hal
from graphkit.graphs.capture import CaptureHygieneError, capture, warm_up
from graphkit.graphs.strategies import Lease
from hal.backends.fake import FakeBackend

SIZES = [1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256]


def make_mlp(device: torch.device, width: int = 64, depth: int = 4):
    gen = torch.Generator().manual_seed(0)
    weights = [(torch.randn(width, width, generator=gen) / width ** 0.5).to(device) for _ in range(depth)]

    def mlp(x: torch.Tensor) -> torch.Tensor:
        h, total = x, torch.zeros_like(x)
        for w in weights:  # residuals keep several intermediates alive at once
            h = torch.tanh(h @ w) + h
            total = total + h
        return total

    return mlp


def capture_sizes(be: hal.Backend, alloc: graphkit.SharedVMMAllocator, fn, order, pool_policy="fresh"):
    """Capture ``fn`` for every size of ``order``, each in a fresh space; return {n: (x, captured)}."""
    dev = be.torch_device()
    stream = be.create_stream()
    graphs, reused = {}, None
    for n in order:
        x = torch.zeros(n, 64, device=dev)
        warm_up(be, fn, {"x": x}, stream)
        sid = alloc.switch_to_new_virtual_space()
        if pool_policy == "fresh":
            pool = be.create_pool(*alloc.pool_callbacks(sid))
        else:  # the mistake: one pool reused across virtual spaces (its cached blocks cross spaces)
            reused = reused or be.create_pool(lambda nb: alloc.allocate(nb), lambda p, nb: alloc.deallocate(p))
            pool = reused
        graphs[n] = (x, capture(be, fn, {"x": x}, Lease(pool, sid), stream), pool)
    return graphs


def wrong_replays(be: hal.Backend, fn, graphs, rounds: int = 60) -> int:
    rng = random.Random(0)
    wrong = 0
    for _ in range(rounds):
        n = rng.choice(sorted(graphs))
        x, captured, _ = graphs[n]
        x.copy_(torch.randn(n, 64, device=x.device))
        be.replay(captured.graph)
        be.synchronize()
        wrong += not torch.allclose(captured.outputs, fn(x), rtol=1e-4, atol=1e-4)
    return wrong


def release_all(be: hal.Backend, alloc: graphkit.SharedVMMAllocator, graphs) -> None:
    pools = {id(p): p for _, _, p in graphs.values()}
    for _, captured, _ in graphs.values():
        be.release_graph(captured.graph)
    for pool in pools.values():
        be.release_pool(pool)
    alloc.close()


def test_many_sizes_cost_the_largest_alone_and_replay_correctly(graph_backend: hal.Backend) -> None:
    be = graph_backend
    fn = make_mlp(be.torch_device())
    alloc = graphkit.SharedVMMAllocator(be)
    order = SIZES[:]
    random.Random(1).shuffle(order)
    graphs = capture_sizes(be, alloc, fn, order)
    assert wrong_replays(be, fn, graphs) == 0
    single = graphkit.SharedVMMAllocator(be)
    single_graphs = capture_sizes(be, single, fn, [max(SIZES)])
    assert abs(alloc.physical_bytes - single.physical_bytes) <= be.granularity
    assert alloc.num_virtual_spaces == len(SIZES)
    release_all(be, single, single_graphs)
    release_all(be, alloc, graphs)
    assert be.live.chunks == 0 and be.live.ranges == 0 and be.live.graphs == 0


def test_one_pool_reused_across_spaces_is_caught() -> None:
    """The deliberately wrong policy aliases live buffers: the replay check above must see it.

    fake only: whether the mistake bites depends on when the framework's pool asks for a new
    segment, which on CUDA needs far larger tensors than this test's.
    """
    be = hal.get_backend("fake", granularity=1 << 16)
    fn = make_mlp(be.torch_device())
    alloc = graphkit.SharedVMMAllocator(be)
    graphs = capture_sizes(be, alloc, fn, sorted(SIZES), pool_policy="reused")
    assert wrong_replays(be, fn, graphs) > 0
    release_all(be, alloc, graphs)
    be.close()


def test_a_cache_born_inside_a_capture_is_reported(graph_backend: hal.Backend, caplog) -> None:
    be = graph_backend
    dev = be.torch_device()
    cache: dict[str, torch.Tensor] = {}

    def step(x: torch.Tensor) -> torch.Tensor:
        if "table" not in cache:  # lazily created on the first call, like a workspace
            cache["table"] = torch.ones(1000, 37, device=dev)
        return x * 2 + cache["table"][: x.shape[0], :1]

    alloc = graphkit.SharedVMMAllocator(be)
    sid = alloc.switch_to_new_virtual_space()
    pool = be.create_pool(*alloc.pool_callbacks(sid))
    x = torch.zeros(8, 1, device=dev)
    stream = be.create_stream()
    with caplog.at_level(logging.WARNING, logger="graphkit.graphs"):
        captured = capture(be, step, {"x": x}, Lease(pool, sid), stream, what="step")
    table = [size for _, size in captured.leftovers if 1000 * 37 * 4 <= size < 1000 * 37 * 4 + 4096]
    assert len(table) == 1, captured.leftovers  # the cached tensor, rounded to the pool's block size
    assert f"{table[0]} bytes" in caplog.text
    be.release_graph(captured.graph)
    cache.clear()
    # strict mode raises instead of logging
    sid2 = alloc.switch_to_new_virtual_space()
    pool2 = be.create_pool(*alloc.pool_callbacks(sid2))
    with pytest.raises(CaptureHygieneError, match="bytes"):
        capture(be, step, {"x": x}, Lease(pool2, sid2), stream, strict_hygiene=True)
    cache.clear()
    for p in (pool, pool2):
        be.release_pool(p)
    alloc.close()


def test_item_inside_a_capture_raises_and_everything_stays_usable(graph_backend: hal.Backend) -> None:
    be = graph_backend
    dev = be.torch_device()
    alloc = graphkit.SharedVMMAllocator(be)
    stream = be.create_stream()
    sid = alloc.switch_to_new_virtual_space()
    pool = be.create_pool(*alloc.pool_callbacks(sid))
    x = torch.ones(4, 4, device=dev)

    def bad(x: torch.Tensor) -> torch.Tensor:
        y = x * 3
        return y / y.sum().item()

    with pytest.raises(hal.CaptureError, match=r"_local_scalar_dense|item|capturing|synchron"):
        capture(be, bad, {"x": x}, Lease(pool, sid), stream)
    assert be.live.graphs == 0
    # the same allocator captures fine afterwards; on fake the same pool too (torch retires a
    # pool whose capture failed, so on CUDA the next capture takes a fresh space and pool, as the runner does)
    failed_pool = pool
    if be.name != "fake":
        be.release_pool(failed_pool)
        sid = alloc.switch_to_new_virtual_space()
        pool = be.create_pool(*alloc.pool_callbacks(sid))
    good = capture(be, lambda x: x * 3 + 1, {"x": x}, Lease(pool, sid), stream)
    x.fill_(2)
    be.replay(good.graph)
    be.synchronize()
    assert torch.equal(good.outputs, torch.full((4, 4), 7.0, device=dev))
    be.release_graph(good.graph)
    be.release_pool(pool)
    alloc.close()


def test_in_place_view_ops_replay_the_same_every_time() -> None:
    """squeeze_, unsqueeze_, t_ change a tensor's shape, not its memory: replays must not stack them."""
    be = hal.get_backend("fake", granularity=1 << 16)
    x = torch.randn(4, 8)

    def step(x: torch.Tensor) -> torch.Tensor:
        y = (x @ x.t())[:1].clone()
        y.unsqueeze_(0)
        y.squeeze_(0)
        y.t_()
        return torch.softmax(x[0], dim=0) @ x.t() + y.t()[0]

    graph = be.create_graph()
    with be.capture(graph):
        out = step(x)
    for _ in range(3):
        x.copy_(torch.randn(4, 8))
        be.replay(graph)
        torch.testing.assert_close(out, step(x))
    be.release_graph(graph)
    del out
    be.close()


@pytest.mark.parametrize("read", [
    lambda t: t.tolist(), lambda t: t.numpy(), lambda t: repr(t), lambda t: str(t), lambda t: print(t),
    lambda t: f"{t}", lambda t: [float(v) for v in t],
])
def test_every_host_read_inside_a_fake_capture_raises(read) -> None:
    """A value read on the host would be baked into the tape: the replay would branch as at capture time."""
    be = hal.get_backend("fake", granularity=1 << 16)
    before = {name: vars(torch.Tensor).get(name) for name in ("tolist", "numpy", "__repr__", "__format__")}
    x = torch.ones(4)
    graph = be.create_graph()
    with pytest.raises(hal.CaptureError):
        with be.capture(graph):
            y = x * 2
            read(y)
    be.release_graph(graph)
    assert {name: vars(torch.Tensor).get(name) for name in before} == before  # torch as it was
    assert x.tolist() == [1.0] * 4 and "tensor" in repr(x)  # outside a capture, reads work
    be.close()


def test_tensors_made_by_a_failed_capture_die_with_it() -> None:
    """The traceback of a failed capture does not keep the tensors its frames made (their pool goes next)."""
    import weakref

    be = hal.get_backend("fake", granularity=1 << 16)
    alloc = graphkit.SharedVMMAllocator(be)
    sid = alloc.switch_to_new_virtual_space()
    pool = be.create_pool(*alloc.pool_callbacks(sid))
    made: list[weakref.ref] = []

    def bad(x: torch.Tensor) -> torch.Tensor:
        y = x * 3
        made.append(weakref.ref(y.untyped_storage()))
        return y / y.sum().item()

    with pytest.raises(hal.CaptureError) as info:
        capture(be, bad, {"x": torch.ones(4, 4)}, Lease(pool, sid), be.create_stream())
    assert made and made[0]() is None, "a tensor of the failed capture outlived it through the traceback"
    del info
    be.release_pool(pool)
    alloc.close()
    be.close()


def test_a_released_graph_refuses_to_replay(graph_backend: hal.Backend) -> None:
    be = graph_backend
    x = torch.ones(64, device=be.torch_device())
    graph = be.create_graph()
    with be.capture(graph):
        y = x * 2
    be.release_graph(graph)
    with pytest.raises(hal.InvalidStateError, match=r"released \(release_graph\); capture a new graph") as info:
        be.replay(graph)
    assert info.value.backend == be.name and info.value.call == "replay"
    del y


def test_a_graph_whose_pool_was_released_refuses_to_replay(graph_backend: hal.Backend) -> None:
    be = graph_backend
    x = torch.ones(64, device=be.torch_device())
    pool = be.create_pool()
    graph = be.create_graph()
    with be.capture(graph, pool=pool):
        y = x * 2  # alive: the pool's memory stays until the test is done
    be.replay(graph)  # y holds 2.0 now on every backend (a device capture runs nothing)
    be.release_pool(pool)
    x.fill_(3.0)
    with pytest.raises(hal.InvalidStateError, match="the pool the graph was captured into was released") as info:
        be.replay(graph)
    assert "capture the graph again" in str(info.value) and info.value.call == "replay"
    be.synchronize()
    assert torch.equal(y.cpu(), torch.full((64,), 2.0)), "the refused replay ran"
    be.release_graph(graph)
    del y


class ReplaysAnyway(FakeBackend):
    """A backend whose replay runs whatever it is given: the facade alone must refuse."""

    @hal.hookimpl
    def replay(self, graph: Any) -> None:
        graph._replay()


def test_the_facade_refuses_what_a_backend_would_replay() -> None:
    with hal.Backend("anyway", ReplaysAnyway(granularity=1 << 16)) as be:
        x = torch.ones(64)
        pool = be.create_pool()
        kept, released = be.create_graph(), be.create_graph()
        with be.capture(kept, pool=pool):
            y = x * 2
        with be.capture(released):
            z = x * 3
        be.release_graph(released)
        be.release_pool(pool)
        x.fill_(5.0)
        for graph, why in ((released, "the graph was released"), (kept, "the pool the graph was captured into")):
            with pytest.raises(hal.InvalidStateError, match=why):
                be.replay(graph)
        assert torch.equal(y, torch.full((64,), 2.0)) and torch.equal(z, torch.full((64,), 3.0))
        be.release_graph(kept)
        del y, z


def test_replay_takes_the_direct_path_only_while_nothing_else_would_see_the_call(be: hal.Backend) -> None:
    """Replay skips pluggy's dispatch (a hot path) only where no fault is armed and no other plugin hooks it."""
    x = torch.ones(8)
    graph = be.create_graph()
    with be.capture(graph):
        y = x * 2
    be.faults.fail("replay")  # an armed fault still fires
    with pytest.raises(hal.DriverError, match="injected"):
        be.replay(graph)
    seen: list[str] = []

    class Watcher:
        @hal.hookimpl(wrapper=True)
        def replay(self, graph):
            seen.append("replay")
            return (yield)

    be._pm.register(Watcher(), name="watcher")  # a plugin that hooks replay still sees it
    be.replay(graph)
    assert seen == ["replay"]
    be._pm.unregister(name="watcher")
    be.replay(graph)
    assert seen == ["replay"] and torch.equal(y, x * 2)
    be.release_graph(graph)
    del y
