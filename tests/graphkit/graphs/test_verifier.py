"""The verifier confirms a suspect word by replaying over a canary before it refuses anything, on fake.

A kernel's argument words are only suspects: a by-value argument may hold a number equal to an address of
another key's live memory. These ops take an address as an ``int``, as a device kernel does: ``load`` reads
through it, ``store`` writes through it, ``carry`` only carries it (a planted garbage word).
"""

from __future__ import annotations

import ctypes
import logging

import pytest
import torch

import graphkit
import hal


def _at(address: int, like: torch.Tensor) -> torch.Tensor:
    buf = (ctypes.c_char * (like.numel() * like.element_size())).from_address(address)
    return torch.frombuffer(buf, dtype=torch.uint8).view(like.dtype).view_as(like)


@torch.library.custom_op("graphkit_verifier_tests::load", mutates_args=())
def load(x: torch.Tensor, address: int) -> torch.Tensor:
    """``x`` plus as many floats read at ``address``: a kernel that reads through a pointer argument."""
    return x + _at(address, x)


@torch.library.custom_op("graphkit_verifier_tests::store", mutates_args=())
def store(x: torch.Tensor, address: int) -> torch.Tensor:
    """Write ``x`` at ``address`` and return ``2 * x``: a kernel that writes through a pointer argument."""
    _at(address, x).copy_(x)
    return x * 2


@torch.library.custom_op("graphkit_verifier_tests::carry", mutates_args=())
def carry(x: torch.Tensor, word: int) -> torch.Tensor:
    """``2 * x``; ``word`` is carried, never dereferenced (an unset slot of a by-value struct)."""
    return x * 2


def _foreign_output(be: hal.Backend) -> tuple[graphkit.GraphPools, object, torch.Tensor]:
    """Pools whose key 1 keeps its output on the shared chunks (replay-scoped), alive."""
    pools = graphkit.GraphPools(be, verify=True, outputs="replay")
    graph = be.create_graph()
    with be.capture(graph, pool=pools.pool(1)):
        out = torch.ones(16, 64) * 3
    return pools, graph, out


def _capture(be: hal.Backend, pools: graphkit.GraphPools, fn, x: torch.Tensor):
    graph = be.create_graph()
    try:
        with be.capture(graph, pool=pools.pool(2)):
            out = fn(x)
    except BaseException:
        be.release_graph(graph)
        raise
    return graph, out


def _close(be: hal.Backend, pools: graphkit.GraphPools, *graphs: object) -> None:
    for graph in graphs:
        be.release_graph(graph)
    pools.close()


def test_a_kernel_that_reads_another_keys_live_output_through_a_word_is_refused(be: hal.Backend) -> None:
    pools, g1, o1 = _foreign_output(be)
    x, address = torch.randn(16, 64), o1.data_ptr()
    with pytest.raises(graphkit.IsolationError, match=r"key 2 .*1 pointer\(s\) \(confirmed by a replay") as info:
        _capture(be, pools, lambda x: torch.ops.graphkit_verifier_tests.load(x, address), x)
    assert "space of key 1" in str(info.value)
    stats = pools.verify_stats
    assert (stats.suspects, stats.confirmed, stats.dismissed, stats.unconfirmed) == (1, 1, 0, 0)
    assert 0 < stats.confirm_seconds <= stats.seconds
    assert pools.allocator.survivor_bytes == 0 and be.live.chunks == len(pools.allocator.chunks)  # scratch gone
    del o1
    _close(be, pools, g1)


def test_a_planted_garbage_word_equal_to_another_keys_live_address_is_dismissed(be: hal.Backend) -> None:
    pools, g1, o1 = _foreign_output(be)
    x = torch.randn(16, 64)
    word = o1.data_ptr() + 256  # inside key 1's live output, never dereferenced
    g2, out = _capture(be, pools, lambda x: torch.ops.graphkit_verifier_tests.carry(x, word), x)
    assert (word, 1) in be.graph_addresses(g2).spans  # the tape reports the word, as a kernel scan does
    stats = pools.verify_stats
    assert (stats.suspects, stats.confirmed, stats.dismissed, stats.unconfirmed) == (1, 0, 1, 0)
    assert "1 suspect word(s): 0 confirmed, 1 dismissed" in str(pools.report())
    x.copy_(torch.randn(16, 64))
    be.replay(g2)
    torch.testing.assert_close(out, x * 2)  # the graph replays right after its confirmation
    assert be.live.chunks == len(pools.allocator.chunks)  # the scratch chunks went back
    del o1, out
    _close(be, pools, g2, g1)


def test_a_kernel_that_writes_through_a_word_into_another_keys_live_output_is_refused(be: hal.Backend) -> None:
    pools, g1, o1 = _foreign_output(be)
    address = o1.data_ptr()
    with pytest.raises(graphkit.IsolationError, match="confirmed by a replay"):
        _capture(be, pools, lambda x: torch.ops.graphkit_verifier_tests.store(x, address),
                 torch.randn(16, 64))
    assert (pools.verify_stats.confirmed, pools.verify_stats.dismissed) == (1, 0)
    del o1
    _close(be, pools, g1)


def test_of_several_suspects_only_the_dereferenced_one_is_named(be: hal.Backend) -> None:
    pools = graphkit.GraphPools(be, verify=True, outputs="replay")
    graphs, outs = [], []
    for key in (1, 3):
        graph = be.create_graph()
        with be.capture(graph, pool=pools.pool(key)):
            outs.append(torch.ones(16, 64) * key)
        graphs.append(graph)
    read, carried = (out.data_ptr() for out in outs)

    def step(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.graphkit_verifier_tests.carry(torch.ops.graphkit_verifier_tests.load(x, read), carried)

    with pytest.raises(graphkit.IsolationError) as info:
        _capture(be, pools, step, torch.randn(16, 64))
    assert "space of key 1" in str(info.value) and "key 3" not in str(info.value)
    stats = pools.verify_stats
    assert (stats.suspects, stats.confirmed, stats.dismissed) == (2, 1, 1)
    del outs
    _close(be, pools, *graphs)


def test_a_graph_whose_replays_differ_is_not_refused_and_the_warning_names_its_key(
        be: hal.Backend, caplog: pytest.LogCaptureFixture) -> None:
    pools, g1, o1 = _foreign_output(be)
    address = o1.data_ptr()

    def noisy(x: torch.Tensor) -> torch.Tensor:  # reads key 1's output, and draws new numbers at each replay
        return torch.ops.graphkit_verifier_tests.load(x, address) + torch.rand(16, 64)

    with caplog.at_level(logging.WARNING, logger="graphkit.graphs"):
        g2, out = _capture(be, pools, noisy, torch.randn(16, 64))
    stats = pools.verify_stats
    assert (stats.suspects, stats.confirmed, stats.dismissed, stats.unconfirmed) == (1, 0, 0, 1)
    lines = [r.getMessage() for r in caplog.records if "unconfirmed" in r.getMessage()]
    assert len(lines) == 1 and "key 2" in lines[0] and "not deterministic" in lines[0]
    del o1, out
    _close(be, pools, g2, g1)


@pytest.mark.parametrize("hook", ["create_phy_mem_handle", "map", "synchronize"])
def test_a_fault_while_confirming_refuses_the_graph_and_leaves_nothing(be: hal.Backend, hook: str) -> None:
    """A driver fault while the suspects are being confirmed leaves them undecided: the capture raises the fault
    (it is refused; capturing again decides) instead of accepting a graph that really reads another key's memory
    (it replayed wrong), and no scratch chunk is left behind."""
    pools, g1, o1 = _foreign_output(be)
    address = o1.data_ptr()
    chunks = be.live.chunks
    be.faults.fail(hook, nth=1 if hook != "map" else 2)  # the scratch's creation, its map, the wait before it
    with pytest.raises(hal.DriverError, match="key 2: its graph could not be replayed over stand-ins"):
        _capture(be, pools, lambda x: torch.ops.graphkit_verifier_tests.load(x, address), torch.randn(16, 64))
    assert be.faults.fired == [hook]
    assert pools.verify_stats.unconfirmed == 1 and pools.verify_stats.confirmed == 0
    assert be.live.chunks == chunks and pools.allocator.survivor_bytes == 0
    torch.testing.assert_close(o1, torch.full((16, 64), 3.0))  # key 1's bytes as they were
    del o1
    _close(be, pools, g1)
    assert be.live.zero, be.live


def test_a_word_into_a_survivor_with_bytes_of_its_own_is_no_suspect(be: hal.Backend) -> None:
    """Kept outputs (the default) are private by construction: no other key's replay overwrites them, so a word
    that points at one is not even a suspect."""
    pools = graphkit.GraphPools(be, verify=True)
    g1 = be.create_graph()
    with be.capture(g1, pool=pools.pool(1)):
        o1 = torch.ones(16, 64) * 3
    address = o1.data_ptr()
    g2, out = _capture(be, pools, lambda x: torch.ops.graphkit_verifier_tests.load(x, address), torch.zeros(16, 64))
    assert pools.verify_stats.suspects == 0
    be.replay(g2)
    torch.testing.assert_close(out, torch.full((16, 64), 3.0))
    del o1, out
    _close(be, pools, g2, g1)


def test_the_verifier_lives_in_isolation_alone() -> None:
    from graphkit.graphs import isolation, keys

    for name in ("KeyCheck", "Verifier", "FIX_ROUTED", "FIX_KEYED"):
        assert name in vars(isolation)
        assert not hasattr(keys, name)  # one home: isolation.py, imported from there
