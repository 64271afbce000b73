"""The physical chunks of elastic ranges (``graphkit.memory.elastic_chunks``), through ElasticBuffer and
ElasticReservation on fake: a growth step maps one chunk, a pause and a resume cost a driver call or two per chunk,
not per granule, a shrink gives back whole chunks and keeps the one holding bytes below the new size, and the
buffers of a reservation share one free list."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import graphkit
import hal
from tests.conftest import G
from tests.values import BAD_VALUE_SETTINGS

VMM_CALLS = ("create_phy_mem_handle", "map", "unmap", "release_phy_mem_handle")


def _calls_of(be: hal.Backend, step) -> dict[str, int]:
    """The driver calls ``step()`` made, per hook."""
    before = {h: be.accounting.calls[h] for h in VMM_CALLS}
    step()
    return {h: be.accounting.calls[h] - before[h] for h in VMM_CALLS}


@pytest.mark.parametrize(("steps", "chunk_bytes", "chunks"), [(1, None, 1), (4, None, 4), (1, 16 * G, 4),
                                                              (1, G, 64)])
def test_pause_and_resume_cost_a_driver_call_or_two_per_chunk_not_per_granule(be: hal.Backend, steps: int,
                                                                             chunk_bytes: int | None,
                                                                             chunks: int) -> None:
    """64 granules grown in ``steps`` steps: a chunk per step (of at most ``chunk_bytes``); the pause unmaps and
    releases each chunk once, the resume creates and maps each once, at the sizes they had."""
    saver = graphkit.MemorySaver(be)
    kv = graphkit.ElasticBuffer(be, max_bytes=64 * G, saver=saver, tag="kv", chunk_bytes=chunk_bytes)
    grown = _calls_of(be, lambda: [kv.resize(64 * G * (i + 1) // steps) for i in range(steps)])
    assert grown == {"create_phy_mem_handle": chunks, "map": chunks, "unmap": 0, "release_phy_mem_handle": 0}
    sizes = sorted(be.accounting.chunks.values())
    kv.view(torch.uint8, (64 * G,)).fill_(1)
    assert _calls_of(be, saver.pause) == {"create_phy_mem_handle": 0, "map": 0, "unmap": chunks,
                                          "release_phy_mem_handle": chunks}
    assert be.live.chunk_bytes == 0
    assert _calls_of(be, saver.resume) == {"create_phy_mem_handle": chunks, "map": chunks, "unmap": 0,
                                           "release_phy_mem_handle": 0}
    assert sorted(be.accounting.chunks.values()) == sizes  # the same chunk sizes again
    assert kv.mapped_bytes == 64 * G and not kv.paused
    kv.close()
    saver.close()
    assert be.live.zero, be.live


def test_a_64_chunk_buffer_sleeps_with_one_wait_and_one_access_call_and_its_first_pause_costs_a_steady_one(
        be: hal.Backend) -> None:
    """What torch_memory_saver pays per allocation (an unmap and a release; a creation, a map and an access
    setting), an elastic buffer pays per chunk, except the access, set once for the chunks side by side, and the
    waits: one per pause (the saver's; the buffer's unmaps come after it) and one per resume. Its first pause
    costs exactly the calls of a steady one: nothing is made on its path."""
    saver = graphkit.MemorySaver(be)
    kv = graphkit.ElasticBuffer(be, max_bytes=64 * G, saver=saver, tag="kv", chunk_bytes=G)
    for i in range(64):
        kv.resize((i + 1) * G)  # a chunk per step, as a KV cache grows
    assert kv.chunk_count == 64
    data = kv.view(torch.uint8, (64 * G,))
    cycles = []
    for _ in range(3):
        data.fill_(7)
        access = be.plugin.access_calls
        with be.count_calls() as paused:
            saver.pause("kv")
        with be.count_calls() as resumed:
            saver.resume("kv")
        cycles.append((dict(paused), dict(resumed), be.plugin.access_calls - access))
    assert cycles[0] == cycles[1] == cycles[2]  # the first pause and resume cost what the steady ones do
    paused, resumed, access = cycles[0]
    assert paused == {"synchronize": 1, "unmap": 64, "release_phy_mem_handle": 64}, paused
    assert resumed == {"create_phy_mem_handle": 64, "map": 64, "deferred_access": 1, "synchronize": 1}, resumed
    assert access == 1  # one mprotect for the 64 chunks side by side (one cuMemSetAccess on cuda), not 64
    data.fill_(3)
    assert int(data.sum()) == 3 * 64 * G
    del data
    kv.close()
    saver.close()
    assert be.live.zero, be.live


def test_a_shrink_gives_back_whole_chunks_and_keeps_the_one_holding_bytes_below_the_new_size(be: hal.Backend) -> None:
    """Chunks of 3 and 5 granules: a shrink into the second keeps it whole (no byte copied, none lost), one below
    its start gives it back; asking again for the size inside the kept chunk costs no driver call."""
    kv = graphkit.ElasticBuffer(be, max_bytes=16 * G)
    kv.resize(3 * G)
    kv.resize(8 * G)
    assert be.live.chunks == 2
    data = torch.randint(0, 1 << 30, (8 * G // 8,))
    kv.view(torch.int64, (data.numel(),)).copy_(data)
    tail = kv.view(torch.uint8, (8 * G,))[7 * G:]  # a view to the end of the second chunk
    assert _calls_of(be, lambda: kv.resize(5 * G)) == dict.fromkeys(VMM_CALLS, 0)  # inside the second chunk
    assert kv.mapped_bytes == 8 * G
    assert _calls_of(be, lambda: kv.resize(5 * G)) == dict.fromkeys(VMM_CALLS, 0)  # asked every step: nothing
    with pytest.raises(hal.InvalidStateError, match="live view"):
        kv.resize(3 * G)  # would give the second chunk back under the view
    del tail
    assert _calls_of(be, lambda: kv.resize(3 * G))["unmap"] == 1
    assert kv.mapped_bytes == 3 * G and be.live.chunks == 1
    assert torch.equal(kv.view(torch.int64, (3 * G // 8,)), data[:3 * G // 8])
    kv.resize(2 * G)  # inside the first chunk: it stays
    assert kv.mapped_bytes == 3 * G
    kv.resize(6 * G)  # growth maps what is missing past the end: one new chunk
    assert be.live.chunks == 2 and kv.mapped_bytes == 6 * G
    assert torch.equal(kv.view(torch.int64, (3 * G // 8,)), data[:3 * G // 8])
    kv.resize(0)
    assert kv.mapped_bytes == 0 and be.live.chunks == 0
    kv.close()
    assert be.live.zero, be.live


def test_chunk_bytes_is_checked_and_rounded_to_the_granularity(be: hal.Backend) -> None:
    for bad in (0, -G, 1.5, True, "G"):
        with pytest.raises(hal.InvalidArgumentError, match="chunk_bytes"):
            graphkit.ElasticBuffer(be, max_bytes=4 * G, chunk_bytes=bad)  # type: ignore[arg-type]
    with graphkit.ElasticBuffer(be, max_bytes=4 * G, chunk_bytes=G + 1) as kv:
        assert kv.chunk_bytes == 2 * G
        kv.resize(3 * G)
        assert sorted(be.accounting.chunks.values()) == [G, 2 * G]
    with graphkit.ElasticReservation(be, reserve_bytes=8 * G) as res:
        assert res.buffer(4 * G).chunk_bytes == G  # shared free list: one granule by default
        assert res.buffer(4 * G, chunk_bytes=8 * G).chunk_bytes == 4 * G  # never more than the buffer
    assert be.live.zero, be.live


def test_mixed_chunks_share_a_reservations_free_list(be: hal.Backend) -> None:
    """Pre-created granules and a buffer's large chunks in one free list: growth takes the largest free chunk
    that fits before it creates one."""
    res = graphkit.ElasticReservation(be, reserve_bytes=32 * G, precreate_bytes=2 * G)
    big = res.buffer(16 * G, chunk_bytes=16 * G)
    small = res.buffer(16 * G)
    big.resize(2 * G)  # the two pre-created granules
    big.resize(8 * G)  # one new chunk of 6
    assert res.created == 3
    big.resize(2 * G)
    assert res.free_bytes == 6 * G
    small.resize(3 * G)  # granule chunks: the 6-granule chunk does not fit, three granules are created
    assert res.created == 6 and res.free_bytes == 6 * G
    big.resize(9 * G)  # takes the free 6-granule chunk, creates one more granule
    assert res.created == 7 and res.free_bytes == 0
    res.close()
    assert be.live.zero, be.live


@BAD_VALUE_SETTINGS
@given(chunk=st.sampled_from([None, 1, 2, 5]), precreate=st.integers(0, 4),
       steps=st.lists(st.one_of(st.tuples(st.just("resize"), st.integers(0, 24)),
                                st.tuples(st.just("sleep"), st.just(0))), max_size=16))
def test_bytes_below_the_size_survive_any_sequence_of_resizes_and_sleeps(be: hal.Backend, chunk: int | None,
                                                                         precreate: int, steps) -> None:
    """Two buffers of one reservation (pre-created granules, one buffer of ``chunk`` granule chunks, one of
    granule chunks), random resizes and sleeps: every granule below a buffer's mapped size keeps its stamp, the
    mapped size is the size asked or past it by less than a chunk, and a sleep releases every chunk."""
    saver = graphkit.MemorySaver(be)
    res = graphkit.ElasticReservation(be, reserve_bytes=64 * G, precreate_bytes=precreate * G)
    bufs = [res.buffer(24 * G, saver=saver, tag="kv", backup=True,
                       chunk_bytes=None if chunk is None else chunk * G),
            res.buffer(24 * G, saver=saver, tag="kv", backup=True)]
    stamps: list[list[int]] = [[], []]  # per buffer: the stamp of each granule mapped
    counter = itertools.count(1)
    try:
        for i, (op, arg) in enumerate(steps):
            buf, model = bufs[i % 2], stamps[i % 2]
            if op == "resize":
                buf.resize(arg * G)
                mapped = buf.mapped_bytes // G
                limit = buf.chunk_bytes // G if chunk is not None or i % 2 else 24
                assert arg <= mapped and (mapped == arg or mapped - arg < limit)
                del model[mapped:]
                whole = buf.view(torch.int64, (mapped * G // 8,)) if mapped else None
                for granule in range(len(model), mapped):
                    model.append(next(counter))
                    assert whole is not None
                    whole[granule * G // 8] = model[-1]
                del whole
            else:
                saver.pause("kv")
                assert be.live.chunk_bytes == res.free_bytes  # only the free list stays
                saver.resume("kv")
            for b, m in zip(bufs, stamps, strict=True):
                assert b.mapped_bytes == len(m) * G
                if m:  # no view outlives the check: a live view would stop the next shrink
                    assert b.view(torch.int64, (len(m) * G // 8,))[:: G // 8].tolist() == m
    finally:
        saver.close()
        res.close()
    assert be.live.zero, be.live


def test_a_shrink_and_a_close_wait_for_the_device_once_not_per_chunk(be: hal.Backend,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    kv = graphkit.ElasticBuffer(be, max_bytes=16 * G, chunk_bytes=G)
    kv.resize(16 * G)
    waits: list[int] = []
    real = be.synchronize
    monkeypatch.setattr(be, "synchronize", lambda: (waits.append(1), real())[1])
    kv.resize(8 * G)  # eight chunks unmapped after one wait
    assert len(waits) == 1 and be.live.mappings == 8
    kv.close()
    assert len(waits) == 2 and be.live.zero, be.live
