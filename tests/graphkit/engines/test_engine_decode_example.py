"""The engine-shaped decode loop of examples/engine-decode: graphs match eager under every adoption mode,
the scope gives each capture its own space at the cost of the largest, and everything is released."""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType

import pytest
import torch

import graphkit
import hal
from tests.paths import ROOT

ENGINE_PATH = ROOT / "examples" / "engine-decode" / "engine.py"
SIZES = [1, 2, 4, 8]
MAX_BATCH = 12  # above the largest captured size: larger batches run eagerly
MODES = ("own", "scope", "pools")
ORDERS = ("descending", "ascending")


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("engine_decode_example", ENGINE_PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


engine_decode = _load()


def backend(name: str = "fake") -> hal.Backend:
    return hal.get_backend(name, **({"granularity": 1 << 16} if name == "fake" else {}))


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """The tiny model's ops are far too small for intra-op threads, which only contend on a busy CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def be():
    backend_ = backend()
    yield backend_
    backend_.close()


def prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (2 + i % 3,), generator=gen).tolist() for i in range(n)]


def capture(be: hal.Backend, mode: str, order: str, sizes: list[int] = SIZES, **engine_options):
    """An engine with ``sizes`` captured under ``mode``; returns (engine, pools or None)."""
    pools = graphkit.GraphPools(be) if mode == "pools" else None
    engine = engine_decode.Engine(be, "tiny", max_batch=MAX_BATCH, max_model_len=32, pools=pools,
                                  **engine_options)
    if mode == "scope":
        with graphkit.graph_memory(be) as pools:
            engine.capture_graphs(sizes, order)
    else:
        engine.capture_graphs(sizes, order)
    assert sorted(engine.graphs) == sorted(sizes)
    return engine, pools


def assert_matches_eager(engine, n: int, steps: int = 4) -> None:
    batch = prompts(n, engine.cfg.vocab, seed=n)
    got = engine.generate(batch, steps)
    want = engine.generate(batch, steps, use_graphs=False)
    assert got.tokens == want.tokens
    assert len(got.tokens) == n and all(len(t) == steps for t in got.tokens)
    assert len(got.logits) == len(want.logits) == max(len(p) for p in batch) + steps - 1
    for a, b in zip(got.logits, want.logits, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    padded = engine.generate(batch, steps, use_graphs=False, padded=True)  # eager on the graph's own inputs
    assert padded.tokens == got.tokens
    for a, b in zip(got.logits, padded.logits, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def teardown(be: hal.Backend, engine, pools, last: bool = True) -> None:
    """Drop the engine's graphs, close the pools; after the ``last`` engine nothing may be live."""
    engine.reset_graphs()
    if pools is not None:
        pools.close()
    if not last:
        return
    live = be.live
    assert (live.chunks, live.ranges, live.mappings, live.pools, live.graphs) == (0, 0, 0, 0, 0), live


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("mode", MODES)
def test_graph_decoding_matches_eager(be: hal.Backend, mode: str, order: str) -> None:
    engine, pools = capture(be, mode, order)
    assert engine.graph_size_for(3) == 4 and engine.graph_size_for(MAX_BATCH) is None
    assert_matches_eager(engine, 3)  # padded into the graph of 4
    assert_matches_eager(engine, 8)  # the largest graph, no padding
    assert_matches_eager(engine, 10)  # above every graph: eager fallback
    teardown(be, engine, pools)


@pytest.mark.parametrize("order", ORDERS)
def test_weakly_referenced_outputs_match_eager_and_free_the_pool(be: hal.Backend, order: str) -> None:
    """vLLM style: outputs held by non-owning aliases leave nothing allocated in the shared pool."""
    engine, _ = capture(be, "own", order, keep_outputs="weak")
    assert be.pool_active_blocks(engine.graph_pool) == []
    assert_matches_eager(engine, 3)
    teardown(be, engine, None)


@pytest.mark.parametrize("order", ORDERS)
def test_the_scope_gives_each_capture_its_own_space_at_the_cost_of_the_largest(be: hal.Backend,
                                                                               order: str) -> None:
    own, _ = capture(be, "own", order)
    assert be.pool_active_blocks(own.graph_pool) != []  # control: outside the scope the engine's pool is used
    teardown(be, own, None, last=False)

    engine, pools = capture(be, "scope", order)
    report = pools.report()
    assert len(report.keys) == len(SIZES) and len({k.key for k in report.keys}) == len(SIZES)
    assert all(k.graphs == 1 for k in report.keys)
    assert engine.graph_pool is not None and be.pool_active_blocks(engine.graph_pool) == []
    largest_alone, alone_pools = capture(be, "scope", order, sizes=[max(SIZES)])
    alone = alone_pools.report().chunk_bytes
    # the largest size alone, plus the granules under the outputs the engine keeps (each its key's alone)
    assert alone > 0 and report.chunk_bytes == pools.allocator.shared_bytes + pools.allocator.survivor_bytes
    assert report.chunk_bytes <= alone + pools.allocator.survivor_bytes
    assert_matches_eager(engine, 5)
    teardown(be, largest_alone, alone_pools, last=False)
    teardown(be, engine, pools)


def test_graph_pools_cost_the_largest_capture(be: hal.Backend) -> None:
    engine, pools = capture(be, "pools", "ascending")
    assert sorted(pools.keys) == SIZES
    alone, alone_pools = capture(be, "pools", "ascending", sizes=[max(SIZES)])
    assert 0 < pools.report().chunk_bytes <= alone_pools.report().chunk_bytes + pools.allocator.survivor_bytes
    teardown(be, alone, alone_pools, last=False)
    teardown(be, engine, pools)


def test_the_torch_api_needs_cuda(be: hal.Backend) -> None:
    with pytest.raises(hal.UnsupportedError, match=r"torch.cuda.graph"):
        engine_decode.Engine(be, "tiny", use_torch_api=True)


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["scope", "pools"])
@pytest.mark.parametrize("backend_name", [pytest.param("cuda", id="cuda", marks=pytest.mark.cuda)])
def test_the_framework_capture_api_is_intercepted_on_cuda(backend_name: str, mode: str) -> None:
    """Captures made with torch.cuda.graph itself, as engines write them, land in graphkit's spaces."""
    with backend(backend_name) as be:
        engine, pools = capture(be, mode, "descending", use_torch_api=True)
        report = pools.report()
        assert len(report.keys) == len(SIZES) and report.chunk_bytes > 0
        assert all(k.mapped_bytes > 0 for k in report.keys)
        assert_matches_eager(engine, 3)
        assert_matches_eager(engine, 8)
        teardown(be, engine, pools)


def piecewise_pair(be: hal.Backend, use_torch_api: bool = False) -> None:
    """Piecewise capture in the scope: equal to eager without a group (the first piece's output has bytes of its
    own); declared replay-scoped with the verifier on, refused without a group; equal to eager with the one group
    line."""
    engine = engine_decode.Engine(be, "tiny", max_batch=MAX_BATCH, max_model_len=32, pieces=2,
                                  use_torch_api=use_torch_api)
    with graphkit.graph_memory(be) as pools:
        engine.capture_graphs(SIZES)
    assert pools.allocator.survivor_bytes > 0
    assert_matches_eager(engine, 3)
    assert_matches_eager(engine, 8)
    teardown(be, engine, pools, last=False)

    engine = engine_decode.Engine(be, "tiny", max_batch=MAX_BATCH, max_model_len=32, pieces=2,
                                  use_torch_api=use_torch_api)
    with graphkit.graph_memory(be, verify=True, outputs="replay") as pools:
        with pytest.raises(graphkit.IsolationError, match=r"pools\.group\(key\)") as info:
            engine.capture_graphs(SIZES)
    assert "('capture', 2)" in str(info.value) and "('capture', 1)" in str(info.value)
    del info  # its traceback holds the first piece's output
    teardown(be, engine, pools, last=False)

    engine = engine_decode.Engine(be, "tiny", max_batch=MAX_BATCH, max_model_len=32, pieces=2,
                                  use_torch_api=use_torch_api)
    with graphkit.graph_memory(be, verify=True, outputs="replay") as pools:
        engine.group = pools.group  # the one line: the pieces of one batch in one space
        engine.capture_graphs(SIZES)
    assert sorted(pools.keys) == SIZES and all(k.graphs == 2 for k in pools.report().keys)
    assert pools.report().verified_graphs == 2 * len(SIZES)
    assert_matches_eager(engine, 3)
    assert_matches_eager(engine, 8)
    teardown(be, engine, pools)


def test_piecewise_graphs_fail_loudly_without_a_group_and_match_eager_with_one(be: hal.Backend) -> None:
    piecewise_pair(be)


def test_piecewise_declared_replay_scoped_without_group_or_verifier_replays_wrong_results(be: hal.Backend) -> None:
    """What construction prevents: the same loop with its outputs declared replay-scoped (they stay on the shared
    chunks) and no verifier replays garbage, silently."""
    engine = engine_decode.Engine(be, "tiny", max_batch=MAX_BATCH, max_model_len=32, pieces=2)
    with graphkit.graph_memory(be, verify=False, outputs="replay") as pools:
        engine.capture_graphs([8])
    batch = prompts(8, engine.cfg.vocab)
    got, want = engine.generate(batch, 2), engine.generate(batch, 2, use_graphs=False)
    assert max((a - b).abs().max().item() for a, b in zip(got.logits, want.logits, strict=True)) > 1e-2
    teardown(be, engine, pools)


@pytest.mark.parametrize("use_torch_api", [False, True], ids=["hal-capture", "torch.cuda.graph"])
@pytest.mark.parametrize("backend_name", [pytest.param("cuda", id="cuda", marks=pytest.mark.cuda)])
def test_piecewise_pair_on_cuda(backend_name: str, use_torch_api: bool) -> None:
    with backend(backend_name) as be:
        piecewise_pair(be, use_torch_api=use_torch_api)


# -- a KV cache sized after capture -----------------------------------------------------------------------------

#: a small fake device, so that "the memory left" is a few hundred blocks of the tiny model
KV_DEVICE = {"granularity": 1 << 14, "capacity": 8 << 20}


def test_an_elastic_kv_cache_grows_after_capture_to_the_memory_left_and_graphs_replay_over_it() -> None:
    with hal.get_backend("fake", **KV_DEVICE) as be:
        engine = engine_decode.Engine(be, "tiny", max_batch=MAX_BATCH, max_model_len=32, kv="elastic")
        g, ranges = be.granularity, 2 * engine.cfg.layers
        assert engine.num_blocks == g // engine.kv_block_bytes  # one granule per range: the scratch block's
        assert engine.kv_max_blocks == (8 << 20) // (ranges * engine.kv_block_bytes)  # the whole device, at most
        with pytest.raises(hal.InvalidArgumentError, match="grow it first"):
            engine.block_tables_for(MAX_BATCH, 32)
        addresses = [t.data_ptr() for t in (*engine.k_cache, *engine.v_cache)]
        with graphkit.graph_memory(be) as pools:
            engine.capture_graphs(SIZES)
        assert pools.report().chunk_bytes > 0
        before, free = engine.num_blocks, be.mem_info().free
        margin = 1 << 20
        blocks = engine.grow_kv(margin)
        granules = 1 + (free - margin) // (ranges * g)  # exact: what capture left, in whole granules per range
        assert blocks == engine.num_blocks == granules * g // engine.kv_block_bytes > 4 * before
        assert engine.kv_bytes == ranges * blocks * engine.kv_block_bytes
        left = be.mem_info().free
        assert margin <= left < margin + ranges * g  # the margin kept, less than a granule per range more
        assert [t.data_ptr() for t in (*engine.k_cache, *engine.v_cache)] == addresses  # the graphs' addresses
        tables = engine.block_tables_for(8, 4 + 4)  # what generate() gives 8 sequences of up to 4 + 4 tokens
        assert int(tables.max()) >= before  # the replays read and write blocks mapped after capture
        assert_matches_eager(engine, 8)
        assert_matches_eager(engine, 3)
        engine.close()
        engine.close()  # idempotent
        pools.close()
        assert be.live.zero, be.live


def test_the_elastic_kv_cache_refuses_what_it_cannot_do(be: hal.Backend) -> None:
    static = engine_decode.Engine(be, "tiny", max_batch=2, max_model_len=16)
    with pytest.raises(hal.InvalidStateError, match="kv='elastic'"):
        static.grow_kv()
    with pytest.raises(hal.InvalidArgumentError, match="kv="):
        engine_decode.Engine(be, "tiny", kv="paged")
    with pytest.raises(hal.InvalidArgumentError, match="kv_max_blocks"):
        engine_decode.Engine(be, "tiny", kv="elastic", kv_max_blocks=1)
    engine = engine_decode.Engine(be, "tiny", max_batch=2, max_model_len=16, kv="elastic", kv_max_blocks=64)
    with pytest.raises(hal.InvalidArgumentError, match="blocks=65"):
        engine.resize_kv(65)
    assert engine.resize_kv(64) == 64 and engine.kv_blocks_for(1 << 40) == 64  # never past the reservation
    engine.close()
    assert be.live.zero, be.live


@pytest.mark.cuda
def test_an_elastic_kv_cache_grown_after_capture_on_cuda() -> None:
    with hal.get_backend("cuda") as be:
        engine = engine_decode.Engine(be, "tiny", max_batch=MAX_BATCH, max_model_len=32, kv="elastic",
                                      kv_max_blocks=8192)
        with graphkit.graph_memory(be) as pools:
            engine.capture_graphs(SIZES)
        before = engine.num_blocks
        assert engine.grow_kv(256 << 20) == 8192 > before  # the reservation caps it: an H100 has more left
        assert be.mem_info().free >= 256 << 20
        assert_matches_eager(engine, 8)
        engine.close()
        pools.close()
