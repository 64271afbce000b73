"""hal.host: the public recorder a plugin wires to its memory to get graphs (fake uses it too)."""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch

import hal
from hal.backends.fake import FakeBackend
from hal.host import CAPABILITIES, BlockPool, HostGraph, HostGraphs
from tests.conftest import G


class Renamed(FakeBackend):
    """fake's memory under another backend name: what a plugin's errors should name."""

    def __init__(self, device: int = 0, **options: Any) -> None:
        super().__init__(device, granularity=G, **options)
        self.init_host_graphs("renamed", alloc=self.device_malloc, free=self.device_free, segment_size=G)


@pytest.fixture
def be() -> Any:
    with hal.Backend("renamed", Renamed(capacity=1 << 20)) as backend:
        yield backend


def test_a_plugin_wired_to_its_memory_has_every_capability(be: hal.Backend) -> None:
    assert be.capabilities == hal.CAPABILITIES  # every graph capability from the recorder, memory sharing from fake
    assert hal.CAPABILITIES - {"memory_sharing"} == CAPABILITIES
    x = torch.ones(256)
    graph = be.create_graph()
    assert isinstance(graph, HostGraph) and graph.backend == "renamed"
    pool = be.create_pool()
    assert isinstance(pool, BlockPool)
    with be.capture(graph, pool, be.create_stream(), inspect=True):
        y = x * 3
    x.fill_(2.0)
    be.replay(graph)
    assert torch.equal(y, torch.full((256,), 6.0))
    spans = be.graph_addresses(graph).spans
    assert any(a <= y.data_ptr() < a + n for a, n in spans)
    be.release_graph(graph)
    del y
    gc.collect()
    be.release_pool(pool)


def test_errors_name_the_plugin_not_fake(be: hal.Backend) -> None:
    x = torch.ones(4)
    for fn in (lambda: (x * 2).sum().item(), lambda: (x * 2).tolist()):
        graph = be.create_graph()
        with pytest.raises(hal.CaptureError) as info:
            with be.capture(graph, None, be.create_stream()):
                fn()
        assert info.value.backend == "renamed", info.value
        be.release_graph(graph)
    with pytest.raises(hal.InvalidStateError) as state:
        be.plugin.replay(HostGraph(backend="renamed"))
    assert state.value.backend == "renamed"


def test_out_of_memory_in_a_capture_is_the_devices_error(be: hal.Backend) -> None:
    x = torch.ones(1 << 19)  # 2 MiB of float32: more than the device's 1 MiB
    graph = be.create_graph()
    with pytest.raises(hal.DeviceOutOfMemoryError, match="renamed private pool: no memory for a segment") as info:
        with be.capture(graph, None, be.create_stream()):
            x * 2
    assert isinstance(info.value, MemoryError) and info.value.backend == "renamed"
    be.release_graph(graph)
    assert be.plugin._anon == {}


def test_a_failed_capture_gives_its_private_pool_back_at_once(be: hal.Backend) -> None:
    x = torch.ones(1024)
    graph = be.create_graph()
    with pytest.raises(hal.CaptureError):
        with be.capture(graph, None, be.create_stream()):
            y = x * 2
            y.sum().item()
    assert graph.own_pool is None
    del y
    gc.collect()
    assert be.plugin._anon == {}, "the failed attempt's private pool still holds device memory"
    with be.capture(graph, None, be.create_stream()):  # the same graph may be captured again
        y = x + 1
    be.replay(graph)
    assert torch.equal(y, torch.full((1024,), 2.0)) and len(be.plugin._anon) == 1
    be.release_graph(graph)
    del y
    gc.collect()
    assert be.plugin._anon == {}


def test_a_bad_segment_size_is_refused() -> None:
    with pytest.raises(hal.InvalidArgumentError, match="segment_size=0 must be a positive int") as info:
        HostGraphs().init_host_graphs("mine", alloc=lambda n: 0, free=lambda p, n: None, segment_size=0)
    assert info.value.backend == "mine" and info.value.call == "init_host_graphs"


def test_blocks_are_rounded_to_the_allocation_alignment_and_segments_to_the_segment_size() -> None:
    got: list[tuple[int, int]] = []
    freed: list[tuple[int, int]] = []
    base = 1 << 30

    def alloc(n: int) -> int:
        got.append((base + len(got) * (1 << 24), n))
        return got[-1][0]

    pool = BlockPool(alloc, lambda p, n: freed.append((p, n)), segment_size=G, name="p", backend="mine")
    a = pool.malloc(1)
    b = pool.malloc(hal.ALLOCATION_ALIGNMENT + 1)
    assert (a, b - a) == (got[0][0], hal.ALLOCATION_ALIGNMENT)
    assert pool.active_blocks() == [(a, hal.ALLOCATION_ALIGNMENT), (b, 2 * hal.ALLOCATION_ALIGNMENT)]
    big = pool.malloc(G + 1)
    assert got[1][1] == 2 * G and big == got[1][0]  # a block bigger than a segment: one of its own
    pool.free(a)
    assert pool.malloc(10) == a  # reused within the pool
    pool.free(big)
    pool.release()  # the idle segment goes back now, the busy one when its last block does
    assert freed == [got[1]]
    pool.free(a)
    pool.free(b)
    assert freed == [got[1], got[0]]


def test_the_former_fake_names_still_import() -> None:
    from hal.backends.fake.graph import FakeGraph, Placer, capture, place, tensor_at
    from hal.backends.fake.pool import BLOCK_ROUND
    from hal.backends.fake.pool import BlockPool as FakePool

    assert FakeGraph is HostGraph and FakePool is BlockPool and BLOCK_ROUND == hal.ALLOCATION_ALIGNMENT
    assert all(callable(f) for f in (Placer, capture, place, tensor_at))
