"""GraphPools when things fail: a failed capture, a pool that will not release, faults in close."""

from __future__ import annotations

import gc
import logging

import pytest
import torch

import graphkit
import hal
from tests.test_graph_pools import capture


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
