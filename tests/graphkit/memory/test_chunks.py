"""graphkit.memory.chunks: the shared chunks every space maps at the same offsets, written by their own verbs."""

from __future__ import annotations

import ctypes
from collections.abc import Iterator

import pytest

import graphkit
import hal
from graphkit.memory.backing import Chunk
from graphkit.memory.chunks import SharedChunks
from graphkit.memory.ranges import SpaceTable, VirtualSpace
from hal.transaction import Transaction
from tests.conftest import G
from tests.graphkit.memory.owners import reach_ins


@pytest.fixture
def parts(be: hal.Backend) -> Iterator[tuple[SharedChunks, SpaceTable]]:
    """Chunks and a table of spaces, as an allocator holds them; everything released after the test."""
    chunks, table = SharedChunks(be), SpaceTable(be, 16 * G)
    yield chunks, table
    for space in list(table.spaces.values()):
        chunks.unmap_space(space)
        table.remove(space)
    chunks.trim(0)
    assert be.live.zero, be.live


def _space(chunks: SharedChunks, table: SpaceTable, granules: int) -> VirtualSpace:
    space = table.open(8 * G)
    chunks.map_up_to(space, granules, None)
    return space


def test_only_the_chunks_module_writes_the_shared_chunks_record() -> None:
    assert reach_ins("graphkit/memory/chunks.py", "SharedChunks") == []


def test_its_chunk_list_is_shown_never_handed_out(parts: tuple[SharedChunks, SpaceTable]) -> None:
    chunks, table = parts
    _space(chunks, table, 2)
    assert not hasattr(chunks, "chunks") and chunks.count == 2
    chunks.held.clear()  # a copy
    assert len(chunks.held) == 2 and chunks.physical_bytes == 2 * G
    for name in ("paused", "pending", "map_calls", "parked_bytes", "count", "physical_bytes"):
        with pytest.raises(AttributeError):
            setattr(chunks, name, 0)


def test_every_space_maps_chunk_i_at_offset_i(parts: tuple[SharedChunks, SpaceTable]) -> None:
    chunks, table = parts
    big, small = _space(chunks, table, 3), _space(chunks, table, 1)
    assert chunks.count == 3 and chunks.map_calls == 4
    assert [p.chunk for p in big.places] == [chunks.chunk(i) for i in range(3)]
    assert small.place(0).chunk is chunks.chunk(0)
    ctypes.memmove(small.base, b"same", 4)
    assert ctypes.string_at(big.base, 4) == b"same"
    chunks.map_up_to(small, 1, None)  # maps them already: nothing
    assert chunks.map_calls == 4


def test_a_failed_map_up_to_takes_back_what_it_made(parts: tuple[SharedChunks, SpaceTable], be: hal.Backend) -> None:
    chunks, table = parts
    space = _space(chunks, table, 1)
    be.faults.fail("map", nth=2)
    with pytest.raises(hal.DriverError, match="injected"):
        chunks.map_up_to(space, 4, None)
    assert chunks.count == 1 and space.mapped == 1 and be.live.chunks == 1 and be.live.mappings == 1


def test_the_limit_refuses_chunks_past_it_before_any_driver_call(parts: tuple[SharedChunks, SpaceTable],
                                                                be: hal.Backend) -> None:
    chunks, table = parts
    space = _space(chunks, table, 1)
    with pytest.raises(hal.DeviceOutOfMemoryError, match="max_physical_bytes"):
        chunks.map_up_to(space, 3, 2 * G)
    assert chunks.count == 1 and be.live.chunks == 1


def test_adopt_puts_a_chunk_at_an_index_and_a_rollback_puts_back_the_old_one(
        parts: tuple[SharedChunks, SpaceTable]) -> None:
    chunks, table = parts
    _space(chunks, table, 2)
    old, fresh = chunks.chunk(1), Chunk(G)
    with Transaction() as tx:
        chunks.adopt(1, fresh, tx)
        assert chunks.chunk(1) is fresh
    assert chunks.chunk(1) is old  # not committed: undone
    with Transaction() as tx:
        chunks.adopt(1, fresh, tx)
        tx.commit()
    assert chunks.chunk(1) is fresh and chunks.count == 2
    chunks.adopt(1, old, Transaction())  # back, so that the teardown finds what the spaces map


def test_precreate_is_all_or_nothing_and_stays_within_the_reserve(parts: tuple[SharedChunks, SpaceTable],
                                                                  be: hal.Backend) -> None:
    chunks, _ = parts
    be.faults.fail("create_phy_mem_handle", nth=3)
    with pytest.raises(hal.DriverError, match="injected"):
        chunks.precreate(3 * G, None, 8 * G)
    assert chunks.count == 0 and be.live.chunks == 0
    with pytest.raises(hal.DeviceOutOfMemoryError, match="reserve_bytes"):
        chunks.precreate(9 * G, None, 8 * G)
    chunks.precreate(3 * G, None, 8 * G)
    assert chunks.count == 3 and chunks.physical_bytes == 3 * G


def test_trim_releases_the_chunks_no_space_reaches(parts: tuple[SharedChunks, SpaceTable], be: hal.Backend) -> None:
    chunks, table = parts
    big, small = _space(chunks, table, 3), _space(chunks, table, 1)
    chunks.unmap_space(big)
    table.remove(big)
    chunks.trim(table.reach())
    assert chunks.count == 1 and be.live.chunks == 1 and small.place(0).chunk is chunks.chunk(0)


def test_a_pause_releases_every_chunk_and_a_resume_makes_them_again(parts: tuple[SharedChunks, SpaceTable],
                                                                   be: hal.Backend) -> None:
    chunks, table = parts
    space = _space(chunks, table, 2)
    assert chunks.pause(list(table.places())) == 2 * G
    assert chunks.paused and chunks.physical_bytes == 0 and chunks.count == 2 and be.live.chunks == 0
    assert chunks.footprint_bytes(table.places()) == 2 * G  # what a resume makes again
    chunks.resume(table.places())
    assert not chunks.paused and chunks.physical_bytes == 2 * G and all(p.mapped for p in space.places)


def test_stop_pauses_it_for_good_and_forget_drops_the_record(be: hal.Backend) -> None:
    chunks, table = SharedChunks(be), SpaceTable(be, 16 * G)
    space = _space(chunks, table, 2)
    errors: list[BaseException] = []
    table.release_all(chunks.unmap_at_close([space], False, errors), errors)
    chunks.release_at_close(errors)
    chunks.stop()
    assert errors == [] and chunks.paused and chunks.physical_bytes == 0 and chunks.count == 2
    chunks.forget()
    table.forget()
    assert chunks.count == 0 and be.live.zero


def test_release_keeps_other_spaces_and_trims_chunks(be: hal.Backend) -> None:
    a = graphkit.SharedVMMAllocator(be, reserve_bytes=16 * G)
    big = a.switch_to_new_virtual_space()
    a.allocate(5 * G)
    small = a.switch_to_new_virtual_space()
    p = a.allocate(G)
    ctypes.memmove(p, b"kept", 4)
    a.release_virtual_space(big)
    assert a.physical_bytes == G and a.num_virtual_spaces == 1
    assert ctypes.string_at(p, 4) == b"kept"
    assert be.live.chunks == 1 and be.live.ranges == 1
    a.release_virtual_space(small)
    assert a.physical_bytes == 0 and be.live.chunks == 0
    with pytest.raises(hal.InvalidStateError, match="not a live virtual space"):
        a.release_virtual_space(small)
    a.close()
    a.close()
    assert be.live.zero


def test_an_allocation_whose_rollback_fails_leaves_the_allocator_usable(be: hal.Backend) -> None:
    a = graphkit.SharedVMMAllocator(be, reserve_bytes=8 * G)
    a.switch_to_new_virtual_space()
    be.faults.fail("map", nth=3)
    be.faults.fail("unmap", nth=1)
    be.faults.fail("unmap", nth=1)
    with pytest.raises(hal.DriverError, match="injected"):
        a.allocate(4 * G)
    assert not a.paused  # what stayed mapped is recorded as mapped: no hole
    p = a.allocate(4 * G)
    ctypes.memmove(p + 3 * G, b"end", 3)
    a.close()
    assert be.live.zero, be.live


def test_the_reach_in_check_finds_a_write_into_a_part_from_another_module() -> None:
    user = ("from graphkit.memory.chunks import SharedChunks\n"
            "def wake(owner: SharedChunks):\n    owner._backing = None\n    return owner.count, self._chunks\n")
    assert reach_ins("graphkit/memory/chunks.py", "SharedChunks", {"user.py": user}) == ["user.py:3 owner._backing"]
