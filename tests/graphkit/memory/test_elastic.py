"""ElasticBuffer and ElasticReservation on fake: growth in place, shrink, views, many ranges, graphs, sleep."""

from __future__ import annotations

import gc
import itertools
import logging
import threading

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import graphkit
import hal
from tests.conftest import G
from tests.values import BAD_VALUE_SETTINGS, NOT_A_SIZE, refused_cleanly


def test_data_survives_growth_in_place(be: hal.Backend) -> None:
    buf = graphkit.ElasticBuffer(be, max_bytes=64 * G)
    ptr = buf.ptr
    assert buf.max_bytes == 64 * G and buf.mapped_bytes == 0
    buf.resize(3 * G - 5)  # rounded up to whole granules
    assert buf.mapped_bytes == 3 * G and be.live.chunks == 1  # one growth step, one chunk
    first = buf.view(torch.float32, (3 * G // 4,))
    first.copy_(torch.arange(3 * G // 4, dtype=torch.float32))
    buf.resize(10 * G)
    assert buf.ptr == ptr and buf.mapped_bytes == 10 * G  # the address never moves
    assert torch.equal(first, torch.arange(3 * G // 4, dtype=torch.float32))  # nothing copied, nothing lost
    whole = buf.view(torch.float32, (10 * G // 4,))
    assert whole.data_ptr() == first.data_ptr() == ptr
    whole[3 * G // 4:].fill_(7)
    assert float(whole[-1]) == 7
    del first, whole
    buf.close()
    assert be.live.zero, be.live


def test_shrink_gives_chunks_back_and_respects_live_views(be: hal.Backend) -> None:
    with graphkit.ElasticReservation(be, reserve_bytes=64 * G) as pool:
        buf = pool.buffer(32 * G)
        buf.resize(8 * G)
        view = buf.view(torch.uint8, (6 * G,))
        with pytest.raises(hal.InvalidStateError, match="live view"):
            buf.resize(4 * G)
        assert buf.mapped_bytes == 8 * G
        buf.resize(6 * G)  # above the view: fine
        assert buf.mapped_bytes == 6 * G and pool.free_bytes == 2 * G  # back to the free list
        del view
        buf.resize(0)
        assert be.live.mappings == 0 and pool.free_bytes == 8 * G
        assert pool.trim() == 8 * G and be.live.chunks == 0
        buf.close()
    assert be.live.zero


def test_bad_sizes_and_views_are_rejected(be: hal.Backend) -> None:
    with pytest.raises(hal.InvalidArgumentError, match="max_bytes"):
        graphkit.ElasticBuffer(be, max_bytes=0)
    with pytest.raises(hal.InvalidArgumentError, match="max_bytes"):
        graphkit.ElasticBuffer(be, max_bytes=-1)
    buf = graphkit.ElasticBuffer(be, max_bytes=4 * G)
    for bad in (-1, 4 * G + 1, 1.5, True, "8"):
        with pytest.raises(hal.InvalidArgumentError, match="nbytes"):
            buf.resize(bad)
    buf.resize(G)
    with pytest.raises(hal.InvalidArgumentError, match="resize first"):
        buf.view(torch.float32, (G // 4 + 1,))
    with pytest.raises(hal.InvalidArgumentError, match="offset"):
        buf.view(torch.float32, (4,), offset=2)
    with pytest.raises(hal.InvalidArgumentError, match="dtype"):
        buf.view("float32", (4,))
    with pytest.raises(hal.InvalidArgumentError, match="shape"):
        buf.view(torch.float32, (-4,))
    assert buf.view(torch.float32, (4 * G // 4,), whole_range=True).numel() == G  # the reserved range
    buf.close()
    with pytest.raises(hal.InvalidStateError, match="closed"):
        buf.resize(G)
    buf.close()
    assert be.live.zero


def test_many_ranges_grow_from_pre_created_chunks(be: hal.Backend) -> None:
    pool = graphkit.ElasticReservation(be, reserve_bytes=256 * G, precreate_bytes=16 * G)
    assert pool.created == 16 and pool.free_bytes == 16 * G
    buffers = [pool.buffer(32 * G) for _ in range(8)]
    with pytest.raises(hal.DeviceOutOfMemoryError, match="range left"):
        pool.buffer(32 * G)
    calls = be.accounting.calls["create_phy_mem_handle"]
    for i, buf in enumerate(buffers):
        buf.resize(2 * G)
        buf.view(torch.int32, (2 * G // 4,)).fill_(i)
    assert be.accounting.calls["create_phy_mem_handle"] == calls  # growth only mapped pre-created chunks
    assert pool.free_bytes == 0
    buffers[0].resize(3 * G)  # the free list is empty: one driver allocation
    assert pool.created == 17
    for i, buf in enumerate(buffers):
        assert int(buf.view(torch.int32, (2 * G // 4,)).sum()) == i * (2 * G // 4)
    ptrs = sorted(b.ptr for b in buffers)
    assert all(b - a >= 32 * G for a, b in itertools.pairwise(ptrs))  # disjoint ranges of one reservation
    pool.close()
    assert all(b.closed for b in buffers)
    assert be.live.zero


def test_a_graph_reading_an_elastic_kv_cache_stays_right_after_growth(be: hal.Backend) -> None:
    """Decode attention gathers KV blocks through a block table; the cache grows between replays."""
    block, dim = 16, 32
    block_bytes = block * dim * 4
    kv = graphkit.ElasticBuffer(be, max_bytes=64 * block_bytes)
    kv.resize(4 * block_bytes)
    cache = kv.view(torch.float32, (64, block, dim), whole_range=True)  # kernels index only mapped blocks
    cache[:4] = torch.randn(4, block, dim)
    table = torch.zeros(2, dtype=torch.long)
    query = torch.randn(dim)

    def step() -> torch.Tensor:
        keys = cache.index_select(0, table).reshape(-1, dim)  # noqa: F821 - ruff reads the `del cache` below
        return torch.softmax(keys @ query, dim=0) @ keys

    graph = be.create_graph()
    with be.capture(graph):
        out = step()
    table.copy_(torch.tensor([1, 3]))
    be.replay(graph)
    torch.testing.assert_close(out, step())
    kv.resize(40 * block_bytes)  # grows: new blocks mapped behind the old ones, nothing moves
    cache[30:40] = torch.randn(10, block, dim)
    table.copy_(torch.tensor([35, 2]))
    be.replay(graph)
    torch.testing.assert_close(out, step())
    be.release_graph(graph)
    del cache, out
    kv.close()
    assert be.live.mappings == 0 and be.live.chunks == 0


def test_an_elastic_buffer_sleeps_with_a_memory_saver(be: hal.Backend) -> None:
    saver = graphkit.MemorySaver(be)
    kept = graphkit.ElasticBuffer(be, max_bytes=16 * G, saver=saver, tag="weights", backup=True)
    scratch = graphkit.ElasticBuffer(be, max_bytes=16 * G, saver=saver, tag="kv_cache")
    kept.resize(5 * G)
    scratch.resize(3 * G)
    data = torch.randn(5 * G // 4)
    kept.view(torch.float32, (5 * G // 4,)).copy_(data)
    with pytest.raises(hal.InvalidStateError, match="paused"):
        saver.pause()
        kept.resize(6 * G)
    assert be.live.chunk_bytes == 0 and saver.is_paused("weights")
    saver.resume()
    assert kept.mapped_bytes == 5 * G and scratch.mapped_bytes == 3 * G
    assert torch.equal(kept.view(torch.float32, (5 * G // 4,)), data)  # bit-exact at the same address
    report = {r.tag: r for r in saver.report()}
    assert report["weights"].footprint_bytes == 5 * G and report["weights"].backup and not report["kv_cache"].backup
    kept.close()
    scratch.close()
    saver.close()
    assert be.live.zero, be.live


# -- failures: every one ends in a hal error or a clean recovery, nothing lost, nothing leaked ---------------


def test_a_release_fault_in_a_pause_keeps_the_buffer_honest_and_the_chunk_for_later(be: hal.Backend) -> None:
    """The chunk that would not release is kept (released later); the buffer reads paused, refuses views,
    and a second pause, a resume with the backup, a resize and a close all work."""
    saver = graphkit.MemorySaver(be)
    kv = graphkit.ElasticBuffer(be, max_bytes=8 * G, saver=saver, tag="kv", backup=True, chunk_bytes=G)
    kv.resize(3 * G)
    v = kv.view(torch.int64, (3 * G // 8,))
    v.copy_(torch.arange(v.numel()))
    del v
    be.faults.fail("release_phy_mem_handle", nth=2)
    be.faults.fail("release_phy_mem_handle", nth=2)  # the immediate retry fails too
    saver.pause("kv")
    assert saver.is_paused("kv") and kv.paused and kv.mapped_bytes == 0 and be.live.mappings == 0
    with pytest.raises(hal.InvalidStateError, match="paused"):
        kv.view(torch.int64, (4,))
    assert saver.pause("kv") == 0  # idempotent: nothing copied from unmapped memory
    saver.resume("kv")
    v = kv.view(torch.int64, (3 * G // 8,))
    assert torch.equal(v, torch.arange(v.numel()))  # the backup came back
    del v
    kv.resize(G)
    kv.close()
    saver.close()
    assert be.live.zero, be.live


def test_a_fault_while_copying_the_backup_back_keeps_the_buffer_paused_and_the_data(be: hal.Backend) -> None:
    saver = graphkit.MemorySaver(be)
    kv = graphkit.ElasticBuffer(be, max_bytes=4 * G, saver=saver, tag="kv", backup=True)
    kv.resize(2 * G)
    v = kv.view(torch.int32, (2 * G // 4,))
    v.copy_(torch.arange(v.numel(), dtype=torch.int32))
    del v
    saver.pause("kv")
    paused = be.live
    be.faults.fail("tensor_at", nth=1)
    with pytest.raises(hal.DriverError, match="injected"):
        saver.resume("kv")
    assert saver.is_paused("kv") and kv.paused and be.live == paused  # what the resume made is gone again
    saver.resume("kv")
    v = kv.view(torch.int32, (2 * G // 4,))
    assert torch.equal(v, torch.arange(v.numel(), dtype=torch.int32))
    del v
    kv.close()
    saver.close()


def test_a_buffer_refused_by_its_saver_keeps_no_range(be: hal.Backend) -> None:
    saver = graphkit.MemorySaver(be)
    with saver.region("kv_cache"):
        t = torch.empty(16)
    before = be.live
    for bad_tag in ("kv_cache", "", 3):
        with pytest.raises(hal.InvalidArgumentError):
            graphkit.ElasticBuffer(be, max_bytes=1 << 30, saver=saver, tag=bad_tag)  # type: ignore[arg-type]
    pool = graphkit.ElasticReservation(be, reserve_bytes=4 * G)
    for _ in range(2):  # the carved range goes back: the second try is refused for its tag, not for room
        with pytest.raises(hal.InvalidArgumentError, match="region"):
            pool.buffer(4 * G, saver=saver, tag="kv_cache")
    pool.buffer(4 * G).close()
    pool.close()
    gc.collect()
    assert be.live == before
    del t
    saver.close()


def test_pool_close_racing_resizes_in_other_threads_never_deadlocks(be: hal.Backend) -> None:
    """Resizes take the buffer's lock, then the pool's; close() must not take them the other way round."""
    for _ in range(20):  # seven resizing threads and the closer
        pool = graphkit.ElasticReservation(be, reserve_bytes=112 * G)
        bufs = [pool.buffer(16 * G) for _ in range(7)]
        start = threading.Barrier(len(bufs) + 1)

        def churn(b: graphkit.ElasticBuffer, start: threading.Barrier = start) -> None:
            start.wait()
            for i in itertools.count():
                try:
                    b.resize((i % 16) * G + 1)
                except hal.InvalidStateError:  # closed under it: the expected end
                    return

        threads = [threading.Thread(target=churn, args=(b,), daemon=True) for b in bufs]
        for t in threads:
            t.start()
        start.wait()
        closer = threading.Thread(target=pool.close, daemon=True)
        closer.start()
        closer.join(10)
        assert not closer.is_alive(), "ElasticReservation.close() deadlocked against resize()"
        for t in threads:
            t.join(10)
            assert not t.is_alive()
        assert pool.closed and all(b.closed for b in bufs)
    assert be.live.zero, be.live


def test_a_shrink_that_shrank_does_not_raise_and_the_chunk_is_released_later(be: hal.Backend) -> None:
    kv = graphkit.ElasticBuffer(be, max_bytes=8 * G, chunk_bytes=G)
    kv.resize(6 * G)
    be.faults.fail("release_phy_mem_handle", nth=1)
    be.faults.fail("release_phy_mem_handle", nth=1)  # the immediate retry fails too
    kv.resize(2 * G)
    assert kv.mapped_bytes == 2 * G and kv.reservation.pending_release == 1
    kv.close()
    assert be.live.zero, be.live


def _reservation_with_a_dropped_buffer(be: hal.Backend) -> graphkit.ElasticReservation:
    """A reservation of 16 granules, and a buffer of 8 with 3 mapped that was dropped without ``close()``."""
    res = graphkit.ElasticReservation(be, reserve_bytes=16 * G)
    buf = res.buffer(8 * G)
    buf.resize(3 * G)
    del buf
    gc.collect()
    return res


def test_a_dropped_buffer_gives_its_memory_back_with_a_warning(be: hal.Backend,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="graphkit.memory"):
        pool = _reservation_with_a_dropped_buffer(be)
    assert "garbage-collected without close()" in caplog.text
    again = pool.buffer(16 * G)  # the dropped range is back in the reservation
    again.resize(16 * G)
    assert pool.created == 16  # the dropped buffer's 3 chunks were reused
    again.close()
    pool.close()
    kv = graphkit.ElasticBuffer(be, max_bytes=4 * G)  # a buffer of its own: reservation and chunks go too
    kv.resize(4 * G)
    del kv
    gc.collect()
    assert be.live.zero, be.live


def test_two_faults_in_a_rollback_keep_the_chunk_for_a_later_release(be: hal.Backend) -> None:
    be.faults.fail("create_phy_mem_handle", nth=2)
    be.faults.fail("release_phy_mem_handle", nth=1)
    with pytest.raises(hal.DriverError, match="injected"):
        graphkit.ElasticReservation(be, reserve_bytes=8 * G, precreate_bytes=3 * G)
    assert be.live.zero, be.live  # the failed constructor kept nothing
    saver = graphkit.MemorySaver(be)
    kv = graphkit.ElasticBuffer(be, max_bytes=4 * G, saver=saver, tag="kv", chunk_bytes=G)
    kv.resize(3 * G)
    saver.pause()
    for hook in ("map", "release_phy_mem_handle", "release_phy_mem_handle"):
        be.faults.fail(hook, nth=2 if hook == "map" else 1)
    with pytest.raises(hal.DriverError, match="injected"):
        saver.resume()
    be.faults.clear()
    assert kv.reservation.pending_release == 1  # kept, not lost
    saver.resume()
    kv.close()
    saver.close()
    assert be.live.zero, be.live


def test_pool_close_goes_on_past_faults_and_a_second_close_finishes(be: hal.Backend) -> None:
    pool = graphkit.ElasticReservation(be, reserve_bytes=16 * G, precreate_bytes=8 * G)
    a = pool.buffer(4 * G)
    a.resize(2 * G)
    b = pool.buffer(4 * G)
    b.resize(2 * G)
    be.faults.fail("unmap", nth=1)
    with pytest.raises(hal.DriverError, match="injected"):
        pool.close()
    assert a.closed != b.closed and not pool.closed  # one closed although the other failed
    be.faults.fail("release_phy_mem_handle", nth=1)  # retried at once: the close still completes
    pool.close()
    assert pool.closed and a.closed and be.live.zero, be.live


def test_a_bad_reservation_is_named_as_the_caller_spelled_it(be: hal.Backend) -> None:
    with pytest.raises(hal.InvalidArgumentError, match=r"reservation=<object .* must be an ElasticReservation"):
        graphkit.ElasticBuffer(be, max_bytes=G, reservation=object())  # type: ignore[arg-type]
    other = hal.get_backend("fake", granularity=G)
    with graphkit.ElasticReservation(other, reserve_bytes=4 * G) as res, \
            pytest.raises(hal.InvalidArgumentError, match="reservation= belongs to another backend"):
        graphkit.ElasticBuffer(be, max_bytes=G, reservation=res)
    other.close()
    assert be.live.zero


# -- what a failed rollback leaves, finished later -------------------------------------------------------------


def test_a_mapping_a_failed_grow_could_not_undo_is_unmapped_by_the_next_resize(be: hal.Backend) -> None:
    buf = graphkit.ElasticBuffer(be, max_bytes=8 * G, chunk_bytes=G)
    be.faults.fail("map", nth=3)  # the third granule will not map ...
    be.faults.fail("unmap", nth=1)
    be.faults.fail("unmap", nth=1)  # ... and undoing the second fails twice: it stays mapped
    with pytest.raises(hal.DriverError, match="injected"):
        buf.resize(3 * G)
    assert buf.mapped_bytes == 0 and be.live.mappings == 1  # recorded, not lost
    be.faults.fail("unmap", nth=1)
    with pytest.raises(hal.InvalidStateError, match="still cannot be undone"):
        buf.resize(G)
    assert buf.mapped_bytes == 0
    buf.resize(2 * G)  # the stray mapping goes first, then the buffer grows
    assert buf.mapped_bytes == 2 * G and be.live.mappings == 2
    buf.close()
    assert be.live.zero, be.live


def test_a_granule_a_failed_shrink_could_not_map_back_is_mapped_by_the_next_resize(be: hal.Backend) -> None:
    buf = graphkit.ElasticBuffer(be, max_bytes=8 * G, chunk_bytes=G)
    buf.resize(4 * G)
    v = buf.view(torch.int32, (4 * G // 4,))
    v.copy_(torch.arange(v.numel(), dtype=torch.int32))
    del v
    be.faults.fail("unmap", nth=2)  # the shrink fails at its second granule ...
    be.faults.fail("map", nth=1)
    be.faults.fail("map", nth=1)  # ... and the last granule will not map back
    with pytest.raises(hal.DriverError, match="injected"):
        buf.resize(G)
    assert buf.paused and buf.mapped_bytes == 3 * G
    with pytest.raises(hal.InvalidStateError, match="paused"):
        buf.view(torch.int32, (4,))
    buf.resize(4 * G)  # maps the granule back, with its chunk: nothing lost
    assert not buf.paused
    v = buf.view(torch.int32, (4 * G // 4,))
    assert torch.equal(v, torch.arange(v.numel(), dtype=torch.int32))
    del v
    buf.close()
    assert be.live.zero, be.live


def test_a_dropped_buffer_that_will_not_unmap_is_given_back_at_a_later_call(be: hal.Backend,
                                                                            caplog: pytest.LogCaptureFixture) -> None:
    res = _reservation_with_a_dropped_buffer(be)
    be.faults.fail("unmap", nth=1)
    with caplog.at_level(logging.ERROR, logger="graphkit.memory"):
        res.precreate(0)  # a safe point: the dropped range is tried, and one unmap fails
    assert "would not unmap" in caplog.text and be.live.mappings == 1  # kept for the next safe point
    res.buffer(16 * G).close()  # that call gives the rest back first: the whole reservation is free again
    assert res.free_bytes == 3 * G and be.live.mappings == 0
    res.close()
    assert be.live.zero, be.live


def test_a_reservation_closed_again_after_a_chunk_would_not_release_frees_its_range_once(be: hal.Backend) -> None:
    res = graphkit.ElasticReservation(be, reserve_bytes=8 * G, precreate_bytes=2 * G)
    be.faults.fail("release_phy_mem_handle", nth=1)
    be.faults.fail("release_phy_mem_handle", nth=1)  # the immediate retry fails too: the chunk is kept
    with pytest.raises(hal.InvalidStateError, match="could not be released yet"):
        res.close()
    assert not res.closed and res.pending_release == 1
    res.close()
    assert res.closed and be.live.zero, be.live


@BAD_VALUE_SETTINGS
@given(value=st.one_of(NOT_A_SIZE, st.just(0)))
def test_bad_sizes_and_views_are_hal_errors(be: hal.Backend, value: object) -> None:
    with pytest.raises(hal.HalError):
        graphkit.ElasticBuffer(be, max_bytes=value)  # type: ignore[arg-type]
    with graphkit.ElasticBuffer(be, max_bytes=4 * G) as buf:
        with pytest.raises(hal.HalError):
            buf.view(value, (4,))  # type: ignore[arg-type]
        if value != 0:  # resizing to 0 and an empty view are fine
            with pytest.raises(hal.HalError):
                buf.resize(value)  # type: ignore[arg-type]
            with pytest.raises(hal.HalError):
                buf.view(torch.float32, (value,))  # type: ignore[arg-type]


ELASTIC_BAD_CALLS = {
    "precreate(1.5)": lambda be, reservation: reservation.precreate(1.5),
    "precreate('x')": lambda be, reservation: reservation.precreate("x"),
    "ElasticBuffer(reservation=object())": lambda be, _: graphkit.ElasticBuffer(be, max_bytes=G,
                                                                                reservation=object()),
    "ElasticBuffer(saver=object())": lambda be, _: graphkit.ElasticBuffer(be, max_bytes=G, saver=object()),
    "ElasticBuffer(backup='yes')": lambda be, _: graphkit.ElasticBuffer(be, max_bytes=G, backup="yes"),
}


@pytest.mark.parametrize("name", sorted(ELASTIC_BAD_CALLS))
def test_bad_arguments_are_refused_before_anything_is_made(name: str) -> None:
    with refused_cleanly(lambda be: graphkit.ElasticReservation(be, reserve_bytes=8 * G)) as (be, reservation):
        ELASTIC_BAD_CALLS[name](be, reservation)


def test_close_after_the_backends_close_finishes(be: hal.Backend) -> None:
    """The backend's close released the ranges and chunks: buffers and reservations only forget them,
    also with a view still alive (it reads released memory either way)."""
    res = graphkit.ElasticReservation(be, reserve_bytes=8 * G, precreate_bytes=2 * G)
    kept, own = res.buffer(4 * G), graphkit.ElasticBuffer(be, max_bytes=2 * G)
    for buf in (kept, own):
        buf.resize(G)
    view = own.view(torch.uint8, (G,))
    be.close()
    own.close()
    res.close()
    assert own.closed and own.reservation.closed and kept.closed and res.closed
    del view
