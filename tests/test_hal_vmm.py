"""The vmm contract through the facade: the documented scenario, aliasing, out of memory, the arguments it
refuses before a driver sees them (sizes that would wrap, bad addresses, bad fault rules) and live counts."""

from __future__ import annotations

import ctypes
import gc

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import hal
from tests.conftest import G
from tests.values import BAD_VALUE_SETTINGS, NOT_A_SIZE


def test_the_documented_scenario_runs_as_written() -> None:
    import ctypes, hal  # noqa: E401,I001 - as the README writes it
    names = {b.name: b for b in hal.list_backends()}
    assert {"cuda", "ascend", "mlu", "fake"} <= set(names) and names["fake"].available
    be = hal.get_backend("fake", granularity=1 << 16, capacity=1 << 22)
    g = be.granularity
    h = be.create_phy_mem_handle(g)
    va1, va2 = be.create_vir_ptr(4 * g), be.create_vir_ptr(4 * g)
    be.map(va1, g, h)
    be.map(va2 + g, g, h)
    ctypes.memmove(va1, b"hal" * 10, 30)
    assert ctypes.string_at(va2 + g, 30) == b"hal" * 10

    with pytest.raises(hal.InvalidArgumentError):
        be.map(va1 + 1, g, h)
    with pytest.raises(hal.DeviceOutOfMemoryError):
        for _ in range(64):  # 1 chunk is live and the capacity holds 64: the 64th of these fails
            be.create_phy_mem_handle(g)
    assert be.live.chunks == (1 << 22) // g
    be.unmap(va1, g)
    be.unmap(va2 + g, g)
    be.release_phy_mem_handle(h)
    with pytest.raises(hal.InvalidStateError):
        be.release_phy_mem_handle(h)

    be.close()
    live = be.live
    assert (live.chunks, live.ranges, live.mappings) == (0, 0, 0)
    assert live.zero


def test_aliasing_is_real_both_ways() -> None:
    with hal.get_backend("fake", granularity=1 << 16, capacity=1 << 22) as be:
        g = be.granularity
        h1, h2 = be.create_phy_mem_handle(g), be.create_phy_mem_handle(g)
        va1, va2 = be.create_vir_ptr(2 * g), be.create_vir_ptr(2 * g)
        be.map(va1, g, h1)
        be.map(va1 + g, g, h2)
        be.map(va2, g, h2)  # swapped order in the second range
        be.map(va2 + g, g, h1)
        ctypes.memmove(va2 + g + 100, b"first", 5)
        ctypes.memmove(va1 + g + 100, b"second", 6)
        assert ctypes.string_at(va1 + 100, 5) == b"first"
        assert ctypes.string_at(va2 + 100, 6) == b"second"


def test_one_chunk_past_capacity_is_out_of_memory() -> None:
    with hal.get_backend("fake", granularity=1 << 16, capacity=1 << 22) as be:
        with pytest.raises(hal.DeviceOutOfMemoryError) as info:
            be.create_phy_mem_handle((1 << 22) + be.granularity)
        assert info.value.call == "create_phy_mem_handle"
        assert be.live.zero
        assert be.mem_info().free == 1 << 22


@BAD_VALUE_SETTINGS
@given(value=st.one_of(NOT_A_SIZE, st.just(0)))
def test_sizes_that_are_no_byte_count_are_hal_errors(be: hal.Backend, value: object) -> None:
    for call in (be.create_vir_ptr, be.create_phy_mem_handle):
        with pytest.raises(hal.HalError):
            call(value)  # type: ignore[arg-type]
    if value != 0:  # an empty tensor is fine
        with pytest.raises(hal.HalError):
            be.tensor_at(0x1000, value)  # type: ignore[arg-type]
    assert be.live.ranges == 0 and be.live.chunks == 0


@pytest.mark.parametrize("size", [2 ** 64, 2 ** 64 + G, 2 ** 70])
def test_sizes_that_would_wrap_in_size_t_are_refused(be: hal.Backend, size: int) -> None:
    for call in (be.create_vir_ptr, be.create_phy_mem_handle):
        with pytest.raises(hal.InvalidArgumentError, match="2\\*\\*64"):
            call(size)
    assert be.live.zero


@pytest.mark.parametrize("ptr", [-G, 2 ** 64, 1.5, "0x1000", None])
def test_bad_addresses_are_refused(be: hal.Backend, ptr: object) -> None:
    with pytest.raises(hal.InvalidArgumentError, match="ptr="):
        be.release_vir_ptr(ptr, G)  # type: ignore[arg-type]
    with pytest.raises(hal.InvalidArgumentError, match="ptr="):
        be.unmap(ptr, G)  # type: ignore[arg-type]


@pytest.mark.parametrize("nth", [0, -1, 1.5, True, "2"])
def test_fault_rules_take_whole_counts(be: hal.Backend, nth: object) -> None:
    with pytest.raises(hal.InvalidArgumentError, match="nth="):
        be.faults.fail("map", nth=nth)  # type: ignore[arg-type]
    with pytest.raises(hal.InvalidArgumentError, match="hook="):
        be.faults.fail("no_such_hook")
    assert be.faults.pending == 0


def test_live_counts_every_graph_dropped_without_release(be: hal.Backend) -> None:
    """Tracked by identity: ids of collected graphs are reused, the count must not shrink with them."""
    for _ in range(1000):
        be.create_graph()  # dropped at once, never released
    gc.collect()
    assert be.live.graphs == 1000
    kept = [be.create_graph() for _ in range(3)]
    for graph in kept:
        be.release_graph(graph)
    assert be.live.graphs == 1000
    pool = be.create_pool()
    be.release_pool(pool)
    be.release_pool(pool)  # twice: counted once
    assert be.live.pools == 0


def test_close_releases_pools_and_graphs_left_live() -> None:
    be = hal.get_backend("fake", granularity=G)
    graph = be.create_graph()
    x = torch.ones(4)
    with be.capture(graph):
        y = x * 2
    kept_pool = be.create_pool()
    be.create_graph()  # dropped unreleased
    assert be.live.graphs == 2 and be.live.pools == 1
    be.close()
    assert be.live.zero, be.live
    assert graph.released and kept_pool._released
    del y
