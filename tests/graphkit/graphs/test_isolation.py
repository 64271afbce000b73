"""Isolation proven at capture end: a graph that uses another key's memory is refused, on fake."""

from __future__ import annotations

import gc
import logging

import pytest
import torch

import graphkit
import hal
from graphkit.graphs.isolation import foreign_uses
from hal.types import GraphAddresses


def pieces(width: int = 256):
    gen = torch.Generator().manual_seed(0)
    w1 = torch.randn(width, width, generator=gen) / width ** 0.5
    w2 = torch.randn(width, width, generator=gen) / width ** 0.5

    def first(x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ w1)

    def second(h: torch.Tensor) -> torch.Tensor:  # the residual stream: reads the previous piece's output
        return torch.relu(h @ w2) + h

    return first, second


def capture(be: hal.Backend, fn, x: torch.Tensor, pool=None):
    graph = be.create_graph()
    try:
        with be.capture(graph, pool=pool):
            out = fn(x)
    except BaseException:
        be.release_graph(graph)
        raise
    return graph, out


def test_a_piece_that_reads_another_captures_output_is_refused_in_the_scope(be: hal.Backend) -> None:
    first, second = pieces()
    x = torch.zeros(16, 256)
    with graphkit.graph_memory(be, verify=True, outputs="replay") as pools:
        g1, h = capture(be, first, x)
        graph = be.create_graph()
        with pytest.raises(graphkit.IsolationError) as info:
            with be.capture(graph):
                second(h)
    message = str(info.value)
    assert isinstance(info.value, hal.CaptureError)
    assert "('capture', 2)" in message and "('capture', 1)" in message  # both keys
    assert "16.0 KiB (16384 bytes)" in message  # h: 16 x 256 float32
    assert "pools.group(key)" in message  # the fix
    assert not graph.captured and not graph.ops and not graph.tensors  # emptied, as after a failed capture
    be.release_graph(graph)
    # the pools stay usable: the same pieces in one group capture and replay like eager
    with graphkit.graph_memory(be, pools=pools), pools.group("batch 16"):
        g2, h2 = capture(be, first, x)
        g3, out = capture(be, second, h2)
    x.copy_(torch.randn(16, 256))
    be.replay(g2)
    be.replay(g3)
    torch.testing.assert_close(out, second(first(x)))
    report = pools.report()
    assert report.verified_graphs == 4 and report.inspected_nodes > 0
    assert "verified isolated" in str(report)
    for g in (g1, g2, g3):
        be.release_graph(g)
    del h, h2, out
    pools.close()
    assert be.live.zero


def test_a_capture_into_a_pool_handle_is_verified_too(be: hal.Backend) -> None:
    first, second = pieces()
    pools = graphkit.GraphPools(be, verify=True, outputs="replay")
    x = torch.zeros(8, 256)
    g1, h = capture(be, first, x, pool=pools.pool(1))
    with pytest.raises(graphkit.IsolationError, match=r"key 2 .*space of key 1"):
        capture(be, second, h, pool=pools.pool(2))
    g2, out = capture(be, second, h, pool=pools.pool(1))  # one key for the pieces of a batch: accepted
    x.copy_(torch.randn(8, 256))
    be.replay(g1)
    be.replay(g2)
    torch.testing.assert_close(out, second(first(x)))
    assert pools.report().verified_graphs == 3
    be.release_graph(g1)
    be.release_graph(g2)
    del h, out
    pools.close()
    assert be.live.zero


def test_a_capture_into_a_group_handle_outside_the_scope_is_verified_too(be: hal.Backend) -> None:
    """``pools.group(key)`` yields the key's handle: used outside graph_memory, captures into it are checked
    as those into ``pools.pool(key)`` (a key reading another key's live output replays wrong)."""
    first, second = pieces()
    pools = graphkit.GraphPools(be, verify=True, outputs="replay")
    x = torch.zeros(8, 256)
    with pools.group(1) as h1:
        g1, h = capture(be, first, x, pool=h1)
    with pools.group(2) as h2, pytest.raises(graphkit.IsolationError, match=r"key 2 .*space of key 1"):
        capture(be, second, h, pool=h2)
    assert pools.verify_stats.graphs == 2
    be.release_graph(g1)
    del h
    pools.close()
    assert be.live.zero


def test_verify_false_turns_the_check_off(be: hal.Backend) -> None:
    first, second = pieces()
    with graphkit.graph_memory(be, verify=False) as pools:
        g1, h = capture(be, first, torch.zeros(4, 256))
        g2, _ = capture(be, second, h)  # would be refused with verification on
    assert pools.report().verified_graphs == 0
    for g in (g1, g2):
        be.release_graph(g)
    pools.close()


def test_inputs_and_weights_outside_the_pools_are_fine(be: hal.Backend) -> None:
    first, _ = pieces()
    static = torch.zeros(32, 256)  # an engine's static input buffer, made outside any capture
    with graphkit.graph_memory(be, verify=True, outputs="replay") as pools:
        graphs = [capture(be, first, static[:n])[0] for n in (32, 16, 8)]
    assert pools.report().verified_graphs == 3
    for g in graphs:
        be.release_graph(g)
    pools.close()


def test_a_backend_that_cannot_answer_skips_the_check_with_one_line(be: hal.Backend,
                                                                   monkeypatch: pytest.MonkeyPatch,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(type(be), "capabilities", property(lambda self: frozenset(
        {"graphs", "custom_pool", "capture_routing", "use_pool"})))
    first, second = pieces()
    with caplog.at_level(logging.INFO, logger="graphkit.graphs"), graphkit.graph_memory(
            be, verify=True, outputs="replay") as pools:
        g1, h = capture(be, first, torch.zeros(4, 256))
        g2, _ = capture(be, second, h)
    lines = [r for r in caplog.records if "graph_addresses" in r.getMessage()]
    assert len(lines) == 1 and "not checked" in lines[0].getMessage()
    for g in (g1, g2):
        be.release_graph(g)
    pools.close()


def test_the_tape_reports_every_tensor_it_uses(be: hal.Backend) -> None:
    w = torch.randn(64, 64)
    x = torch.randn(4, 64)
    pool = be.create_pool()
    graph = be.create_graph()
    with be.capture(graph, pool=pool):
        y = torch.relu(x @ w)
    found = be.graph_addresses(graph)
    spans = set(found.spans)
    for t in (w, x, y):
        storage = t.untyped_storage()
        assert (storage.data_ptr(), storage.nbytes()) in spans
    unrelated = torch.randn(64)
    assert (unrelated.untyped_storage().data_ptr(), 256) not in spans
    assert found.nodes == 2 and found.complete
    be.release_graph(graph)
    with pytest.raises(hal.InvalidStateError):
        be.graph_addresses(graph)
    del y
    gc.collect()
    be.release_pool(pool)


def test_inspect_needs_the_capability(be: hal.Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(type(be), "capabilities", property(lambda self: frozenset({"graphs"})))
    with pytest.raises(hal.UnsupportedError, match="graph_addresses"):
        be.capture(be.create_graph(), inspect=True)
    with pytest.raises(hal.UnsupportedError, match="graph_addresses"):
        be.graph_addresses(object())


def test_foreign_uses_counts_spans_and_pointers() -> None:
    from graphkit.memory.allocator import VirtualSpace

    spaces = {1: VirtualSpace(1, 0x10000, 0x1000, arena=None), 2: VirtualSpace(2, 0x20000, 0x1000, arena=None)}
    found = GraphAddresses(((0x10000, 0x100), (0x20010, 1), (0x20020, 1), (0x30000, 64), (0x0fff0, 0x20)))
    uses = foreign_uses(found, spaces, own=1)
    assert [(u.space_id, u.addresses, u.pointers) for u in uses] == [(2, 2, 2)]
    assert str(uses[0]) == "2 pointer(s)"
    uses = foreign_uses(found, spaces, own=2)
    assert [(u.space_id, u.addresses, u.nbytes, u.first) for u in uses] == [(1, 2, 0x100 + 0x10, 0x10000)]


@pytest.mark.parametrize("verify", [False, True])
def test_a_cache_born_in_one_sizes_capture_gets_bytes_of_its_own_and_other_sizes_read_it_right(
        be: hal.Backend, verify: bool) -> None:
    """Hazard 1 by construction: a cache made inside the first capture outlives it; it gets physical memory no
    other size maps, so the other sizes' replays cannot overwrite it and the verifier has nothing to refuse."""
    w = torch.randn(64, 64)
    cache: dict[str, torch.Tensor] = {}

    def step(x: torch.Tensor) -> torch.Tensor:
        if "scale" not in cache:  # born inside the first capture, in that size's space
            cache["scale"] = torch.ones(64) * 2
        return (x @ w) * cache["scale"]

    runner = graphkit.GraphRunner(step, sizes=[4, 8], backend=be, warmup=0, progress=False, verify=verify)
    runner.capture(x=torch.zeros(8, 64))
    assert runner.captured_sizes == [4, 8]
    assert runner.pools.allocator.survivor_bytes == be.granularity  # the cache's granule, and only it
    for n in (3, 8, 4, 2):
        x = torch.randn(n, 64)
        assert torch.allclose(runner(x=x), (x @ w) * 2, rtol=1e-5, atol=1e-5)
    cache.clear()
    runner.close()


@pytest.mark.parametrize("keep", [None, "strong"])
def test_a_runner_verifies_every_capture(be: hal.Backend, keep: str | None) -> None:
    w = torch.randn(64, 64)
    runner = graphkit.GraphRunner(lambda x: torch.relu(x @ w), sizes=[1, 2, 4], backend=be, progress=False, verify=True,
                                  keep_outputs=keep)
    runner.capture(x=torch.zeros(4, 64))
    stats = runner.verify_stats
    if keep is None:  # vmm holds its outputs weakly: no size holds memory another could read, nothing to read
        assert runner.keep_outputs == "weak" and stats.graphs == 3 and stats.unread == 3 and stats.nodes == 0
    else:  # the first capture needs no reading (no other size holds memory yet); the others are read
        assert stats.graphs == 3 and stats.unread == 1 and stats.nodes >= 4
    x = torch.randn(3, 64)
    torch.testing.assert_close(runner(x=x), torch.relu(x @ w))
    runner.close()


def test_replaying_a_graph_whose_memory_sleeps_raises(be: hal.Backend) -> None:
    first, _ = pieces()
    saver = graphkit.MemorySaver(be)
    pools = graphkit.GraphPools(be, saver=saver, verify=True, outputs="replay")
    x = torch.zeros(4, 256)
    g_handle, _ = capture(be, first, x, pool=pools.pool(1))  # a handle passed by the caller
    with graphkit.graph_memory(be, pools=pools):
        g_routed, _ = capture(be, first, x)  # a pool the router chose
    saver.pause("graphs")
    for graph in (g_handle, g_routed):
        with pytest.raises(hal.InvalidStateError, match="paused"):
            be.replay(graph)
    saver.resume("graphs")
    for graph in (g_handle, g_routed):
        be.replay(graph)
        be.release_graph(graph)
    pools.close()
    saver.close()


def _as_if_from(module: str, name: str, body):
    """``body`` called from a function named ``name`` of module ``module`` (how torch's own callers look)."""
    namespace: dict = {"__name__": module, "body": body}
    exec(f"def {name}(*args):\n    return body(*args)\n", namespace)
    return namespace[name]


def test_graph_tree_captures_are_left_to_torch(be: hal.Backend, caplog: pytest.LogCaptureFixture) -> None:
    first, _ = pieces()
    own_pool = be.create_pool()
    trees_capture = _as_if_from("torch._inductor.cudagraph_trees", "_record", lambda x: capture(be, first, x,
                                                                                                 pool=own_pool))
    with caplog.at_level(logging.INFO, logger="graphkit.graphs"), graphkit.graph_memory(
            be, verify=True, outputs="replay") as pools:
        g1, out1 = trees_capture(torch.zeros(4, 256))
        g2, out2 = trees_capture(torch.zeros(2, 256))
    assert pools.keys == [] and be.pool_active_blocks(own_pool) != []  # torch's own pool, not graphkit's
    assert sum("graph trees" in r.getMessage() for r in caplog.records) == 1
    for g in (g1, g2):
        be.release_graph(g)
    del out1, out2
    gc.collect()
    be.release_pool(own_pool)
    pools.close()


def test_the_graphs_of_one_make_graphed_callables_call_share_a_space(be: hal.Backend) -> None:
    first, second = pieces()
    call_pools = []

    def forward_then_backward(x):
        call_pool = be.create_pool()  # the pool id one make_graphed_callables call makes for its graphs
        call_pools.append(call_pool)
        g_fwd, h = capture(be, first, x, pool=call_pool)
        g_bwd, out = capture(be, second, h, pool=call_pool)  # reads forward's memory, as backward does
        return [g_fwd, g_bwd], h, out

    graphed = _as_if_from("torch.cuda.graphs", "make_graphed_callables", forward_then_backward)
    x = torch.zeros(4, 256)
    with graphkit.graph_memory(be, verify=True, outputs="replay") as pools:
        graphs, h, out = graphed(x)
        other, h2, out2 = graphed(torch.zeros(2, 256))  # another call: another space
    assert len(pools.keys) == 2 and all(k[0] == "make_graphed_callables" for k in pools.keys)
    x.copy_(torch.randn(4, 256))
    for g in graphs:
        be.replay(g)
    torch.testing.assert_close(out, second(first(x)))
    for g in graphs + other:
        be.release_graph(g)
    del h, out, h2, out2
    pools.close()
    for pool in call_pools:
        be.release_pool(pool)


def test_a_number_that_falls_in_another_space_but_in_no_live_block_is_no_use() -> None:
    """Kernel arguments hold integers too (a division constant): inside another key's space but outside every
    block still allocated there, a bare word is not a use of that key's memory."""
    from graphkit.memory.allocator import VirtualSpace

    spaces = {1: VirtualSpace(1, 0x10000, 0x10000, arena=None), 2: VirtualSpace(2, 0x20000, 0x10000, arena=None)}
    found = GraphAddresses(((0x28889, 1), (0x20100, 1), (0x20101, 1)))  # an odd word is no tensor's address
    live = {2: [(0x20000, 0x200)]}  # key 2 left one 512-byte block alive: its output
    uses = foreign_uses(found, spaces, own=1, live_blocks=live.get)
    assert [(u.space_id, u.addresses, u.first) for u in uses] == [(2, 1, 0x20100)]
    assert foreign_uses(GraphAddresses(((0x28889, 1),)), spaces, own=1, live_blocks=live.get) == []
    # a space whose blocks are unknown counts whole
    assert len(foreign_uses(GraphAddresses(((0x18888, 1),)), spaces, own=2, live_blocks=live.get)) == 1


def test_a_fallback_that_catches_runtime_error_survives_a_refusal(be: hal.Backend) -> None:
    """A library that captures and falls back to eager when a capture raises RuntimeError (as torch's capture
    errors are) keeps working when graphkit refuses a graph: its refusals are RuntimeErrors too."""
    first, second = pieces()
    x = torch.randn(16, 256)

    def graphed_or_eager(fn, arg):
        try:
            return capture(be, fn, arg)
        except RuntimeError:
            return None, fn(arg)

    with graphkit.graph_memory(be, verify=True, outputs="replay") as pools:
        g1, h = graphed_or_eager(first, x)
        g2, out = graphed_or_eager(second, h)  # refused: reads the first capture's output
    assert g1 is not None and g2 is None
    x.copy_(torch.randn(16, 256))  # the library's step: the first piece replayed, the second eagerly
    be.replay(g1)
    torch.testing.assert_close(second(h), second(first(x)))
    assert issubclass(graphkit.IsolationError, RuntimeError) and issubclass(hal.CaptureError, RuntimeError)
    assert issubclass(graphkit.CaptureHygieneError, RuntimeError)
    be.release_graph(g1)
    del h, out
    pools.close()


def test_the_refusal_names_a_block_of_a_librarys_per_stream_state_and_its_fix(be: hal.Backend) -> None:
    from graphkit.graphs.isolation import Context, check
    from graphkit.memory.ranges import VirtualSpace

    spaces = {1: VirtualSpace(1, 0x10000, 0x100000, arena=None), 2: VirtualSpace(2, 0x200000, 0x100000, arena=None)}
    workspace = (0x20000, 0x8000)  # a live block of space 1 of the size the backend's preparation measured
    ctx = Context(be, spaces, own=2, key=("capture", 2), key_of={1: ("capture", 1), 2: ("capture", 2)}.get,
                  fix="put them under one key", live_blocks={1: [workspace]}.get,
                  state_sizes={0x8000: "cuBLAS's workspace"})
    with pytest.raises(graphkit.IsolationError) as info:
        check(ctx, GraphAddresses(((0x20100, 1),)))
    message = str(info.value)
    assert "32.0 KiB (32768 bytes)" in message and "the capture of key ('capture', 1)" in message
    assert "the size of cuBLAS's workspace" in message and "prepare_capture_stream" in message
    # a block of no known size: the two usual causes and their fixes
    ctx = Context(be, spaces, own=2, key=("capture", 2), key_of={1: ("capture", 1)}.get,
                  fix="put them under one key", live_blocks={1: [(0x20000, 0x1000)]}.get)
    with pytest.raises(graphkit.IsolationError) as info:
        check(ctx, GraphAddresses(((0x20100, 1),)))
    message = str(info.value)
    assert "4.0 KiB (4096 bytes)" in message and "put them under one key" in message
    assert "made lazily" in message and "prepare_capture_stream" not in message


def test_a_capture_is_read_only_when_another_key_holds_live_memory(be: hal.Backend) -> None:
    first, _ = pieces()
    x = torch.randn(16, 256)
    with graphkit.graph_memory(be, verify=True, outputs="replay") as pools:
        g1 = capture(be, first, x)[0]  # its output dies at once: nothing of key 1 stays alive
        g2, h = capture(be, first, x)  # nothing alive elsewhere: proven without reading
        g3, out = capture(be, torch.sigmoid, x)  # key 2's output lives: this one is read
    stats = pools.verify_stats
    assert stats.graphs == 3 and stats.unread == 2 and stats.nodes > 0
    for g in (g1, g2, g3):
        be.release_graph(g)
    del h, out


def test_memory_kept_on_chunks_of_its_own_makes_no_capture_worth_reading(be: hal.Backend) -> None:
    """With outputs kept (the default), what a capture leaves alive becomes its key's alone when the capture
    ends: no later replay can overwrite it, so the verifier reads nothing, even for a graph that reads it."""
    first, second = pieces()
    x = torch.randn(16, 256)
    with graphkit.graph_memory(be, verify=True) as pools:
        g1, h = capture(be, first, x)  # key 1 keeps h, on a chunk of its own
        g2, out = capture(be, second, h)  # key 2 reads it: nothing of key 1 is on the shared chunks
    stats = pools.verify_stats
    assert pools.report().survivor_bytes > 0
    assert stats.graphs == 2 and stats.unread == 2 and stats.nodes == 0
    want = second(first(x))
    be.replay(g1)
    be.replay(g2)
    be.synchronize()
    torch.testing.assert_close(out, want)
    for g in (g1, g2):
        be.release_graph(g)
    del h, out


def test_a_graph_that_takes_only_the_shape_of_another_keys_output_is_accepted(be: hal.Backend) -> None:
    pools = graphkit.GraphPools(be, verify=True, outputs="replay")
    x = torch.randn(8, 64)
    g1, o1 = capture(be, lambda x: x * 2, x, pool=pools.pool(1))
    g2, o2 = capture(be, lambda x, o=o1: torch.zeros_like(o) + o.new_ones(o.shape) + x + o.size(0), x,
                     pool=pools.pool(2))
    x.copy_(torch.randn(8, 64))
    be.replay(g2)
    assert torch.equal(o2, 1 + x + 8)
    with pytest.raises(graphkit.IsolationError):  # reading the bytes is still refused
        capture(be, lambda x, o=o1: torch.zeros_like(o).copy_(o) + x, x, pool=pools.pool(3))
    for graph in (g2, g1):
        be.release_graph(graph)
    del o1, o2
    pools.close()
