"""Arguments the facade refuses before a driver sees them (sizes that would wrap, bad addresses, bad faults)."""

from __future__ import annotations

import pytest

import hal

G = 1 << 16


@pytest.fixture
def be():
    backend = hal.get_backend("fake", granularity=G)
    yield backend
    backend.close()


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
    import gc

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
    import torch

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
