"""GraphPools under faults and at its API's edges: keys of its own, nested groups, release and close retried."""

from __future__ import annotations

import gc

import pytest
import torch

import graphkit
import hal


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
