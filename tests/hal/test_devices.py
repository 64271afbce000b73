"""The device rule: a device left unnamed is the current one, and a capture on another device than its pools'
is refused loudly, never served from the framework's own memory (two fake devices)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import graphkit
import hal
from hal.backends import fake
from tests.conftest import G


@pytest.fixture
def two() -> Iterator[tuple[hal.Backend, hal.Backend]]:
    fake.set_device(0)
    devices = tuple(hal.get_backend("fake", device=i, granularity=G, device_count=2) for i in range(2))
    yield devices  # type: ignore[misc]
    fake.set_device(0)
    for be in devices:
        be.close()


def test_an_unnamed_device_is_the_current_one() -> None:
    try:
        fake.set_device(1)
        with hal.get_backend("fake", granularity=G, device_count=2) as be:
            assert be.device == 1 and be.current_device() == 1
        with hal.get_backend("fake", device=0, granularity=G, device_count=2) as be:
            assert be.device == 0  # a named device stays named
    finally:
        fake.set_device(0)
    with pytest.raises(hal.InvalidArgumentError, match="device"):
        fake.set_device(-1)


def test_a_handle_of_one_devices_pools_is_refused_by_another_device(two) -> None:
    be0, be1 = two
    w = torch.randn(64, 64)
    with graphkit.GraphPools(be0) as pools:
        graph = be1.create_graph()
        with pytest.raises(hal.CaptureError, match=r"belongs to fake:0"):
            with be1.capture(graph, pool=pools.pool(8)):
                torch.relu(torch.zeros(8, 64) @ w)
        be1.release_graph(graph)
        assert be1.live.zero
        graph = be0.create_graph()  # on its own device the handle serves
        with be0.capture(graph, pool=pools.pool(8)):
            out = torch.relu(torch.zeros(8, 64) @ w)
        assert pools.report().keys[0].used_bytes > 0
        be0.release_graph(graph)
        del out


def test_a_capture_inside_the_scope_on_another_device_is_refused(two) -> None:
    be0, be1 = two
    w = torch.randn(64, 64)
    with graphkit.graph_memory(be0) as pools:
        graph = be1.create_graph()
        with pytest.raises(hal.CaptureError, match=r"serves the captures on fake:0.*device 1") as info:
            with be1.capture(graph):
                torch.relu(torch.zeros(8, 64) @ w)
        assert isinstance(info.value, RuntimeError)
        be1.release_graph(graph)
        with graphkit.graph_memory(be1) as pools1:  # a block on device 1 serves it
            graph = be1.create_graph()
            with be1.capture(graph):
                out = torch.relu(torch.zeros(8, 64) @ w)
        assert len(pools1.keys) == 1 and not pools.keys
        be1.release_graph(graph)
        del out
    # outside every block nothing is refused
    graph = be1.create_graph()
    with be1.capture(graph):
        torch.relu(torch.zeros(8, 64) @ w)
    be1.release_graph(graph)
    pools.close()
    pools1.close()
