"""graphkit.memory.backing: the release/restore machine over chunks and places, and the state it alone writes."""

from __future__ import annotations

import ctypes

import pytest

import graphkit
import hal
from graphkit.memory.backing import Backing, Chunk, Place
from hal.transaction import Transaction
from tests.conftest import G
from tests.graphkit.memory.owners import reach_ins


def _mapped(be: hal.Backend, backing: Backing, count: int) -> tuple[int, list[Place]]:
    """A range of ``count`` granules, each mapped to a chunk of its own through ``backing``."""
    base = be.create_vir_ptr(count * G)
    places = [Place(base + i * G, Chunk(G)) for i in range(count)]
    for place in places:
        backing.create(place.chunk)
        backing.map(place)
    return base, places


def _close(be: hal.Backend, backing: Backing, base: int, places: list[Place]) -> None:
    backing.unmap_all(places, [])
    for place in places:
        backing.release(place.chunk)
    backing.retry()
    be.release_vir_ptr(base, len(places) * G)


def test_only_the_backing_module_writes_a_backings_state() -> None:
    assert reach_ins("graphkit/memory/backing.py", "Backing") == []


@pytest.mark.parametrize("name", ["sleeping", "holes", "pending", "map_calls", "map_seconds", "paused"])
def test_what_a_backing_shows_is_read_only(be: hal.Backend, name: str) -> None:
    backing = Backing(be)
    with pytest.raises(AttributeError):
        setattr(backing, name, getattr(backing, name))


def test_pending_is_a_copy_its_owner_cannot_change(be: hal.Backend) -> None:
    backing = Backing(be)
    backing.keep_pending(["h"])
    backing.pending.append("other")
    assert backing.pending == ["h"]
    assert backing.take_pending() == ["h"] and backing.pending == []


def test_kept_pending_chunks_are_released_by_the_next_retry(be: hal.Backend) -> None:
    backing = Backing(be)
    handle = be.create_phy_mem_handle(G)
    backing.keep_pending([handle])
    assert be.live.chunks == 1 and backing.pending == [handle]
    backing.retry()
    assert be.live.chunks == 0 and backing.pending == []


def test_a_release_that_fails_twice_is_pending_and_never_raises(be: hal.Backend) -> None:
    backing = Backing(be)
    chunk = Chunk(G)
    backing.create(chunk)
    be.faults.fail("release_phy_mem_handle", nth=1)
    be.faults.fail("release_phy_mem_handle", nth=1)
    assert not backing.release(chunk) and chunk.handle is None and len(backing.pending) == 1
    backing.retry()
    assert backing.pending == [] and be.live.zero


def test_mark_sleeping_pauses_it_until_a_resume(be: hal.Backend) -> None:
    backing = Backing(be)
    base, places = _mapped(be, backing, 2)
    backing.mark_sleeping()
    assert backing.sleeping and backing.paused and not backing.holes
    backing.resume(places, [p.chunk for p in places])
    assert not backing.paused
    _close(be, backing, base, places)
    assert be.live.zero


def test_a_counted_backing_counts_its_map_calls(be: hal.Backend) -> None:
    counted, plain = Backing(be, counted=True), Backing(be)
    base, places = _mapped(be, counted, 2)
    other, more = _mapped(be, plain, 1)
    assert counted.map_calls == 2 and counted.map_seconds > 0 and plain.map_calls == 0
    _close(be, counted, base, places)
    _close(be, plain, other, more)


def test_a_pause_releases_every_chunk_and_a_resume_maps_the_same_addresses(be: hal.Backend) -> None:
    backing = Backing(be)
    base, places = _mapped(be, backing, 3)
    assert backing.pause(places, [p.chunk for p in places]) == 3 * G
    assert backing.sleeping and be.live.chunks == 0 and be.live.mappings == 0
    backing.resume(places, [p.chunk for p in places])
    assert not backing.paused and be.live.chunks == 3 and all(p.mapped for p in places)
    ctypes.memmove(base + 2 * G, b"back", 4)
    assert ctypes.string_at(places[2].ptr, 4) == b"back"
    _close(be, backing, base, places)
    assert be.live.zero


def test_a_failed_pause_is_undone_whole_and_leaves_it_awake(be: hal.Backend) -> None:
    """The pause's undo stack: the places it unmapped are mapped back, then sleeping is what it was."""
    backing = Backing(be)
    base, places = _mapped(be, backing, 3)
    be.faults.fail("unmap", nth=2)
    with pytest.raises(hal.DriverError, match="injected"):
        backing.pause(places, [p.chunk for p in places])
    assert not backing.sleeping and not backing.paused
    assert all(p.mapped for p in places) and be.live.mappings == 3 and be.live.chunks == 3
    _close(be, backing, base, places)
    assert be.live.zero


def test_a_remap_that_fails_twice_leaves_a_recorded_hole(be: hal.Backend) -> None:
    backing = Backing(be)
    base, places = _mapped(be, backing, 2)
    be.faults.fail("unmap", nth=2)
    be.faults.fail("map", nth=1)
    be.faults.fail("map", nth=1)  # the remap of the first unmap, and its retry
    with pytest.raises(hal.DriverError, match="injected"):
        backing.pause(places, [p.chunk for p in places])
    assert backing.holes and backing.paused and not backing.sleeping
    assert [p.mapped for p in places] == [True, False]
    backing.fill(places)
    assert not backing.paused and all(p.mapped for p in places)
    _close(be, backing, base, places)
    assert be.live.zero


def test_a_rolled_back_creation_releases_the_chunk(be: hal.Backend) -> None:
    backing = Backing(be)
    chunk = Chunk(G)
    with Transaction() as tx:
        backing.create(chunk, tx)
        assert be.live.chunks == 1
    assert chunk.handle is None and be.live.chunks == 0


def test_the_allocators_pause_whose_remap_fails_twice_reads_paused_until_restored(be: hal.Backend) -> None:
    """Through the allocator: exactly one granule is missing and it says so; a restore maps it, bytes intact."""
    a = graphkit.SharedVMMAllocator(be, reserve_bytes=8 * G)
    a.switch_to_new_virtual_space()
    p1 = a.allocate(3 * G)
    a.switch_to_new_virtual_space()
    a.allocate(2 * G)
    ctypes.memmove(p1, b"graphs!!", 8)
    mapped = be.live.mappings
    be.faults.fail("unmap", nth=2)
    be.faults.fail("map", nth=1)
    be.faults.fail("map", nth=1)  # the remap and its retry both fail
    with pytest.raises(hal.DriverError, match="injected"):
        a.release_physical()
    assert a.paused and be.live.mappings == mapped - 1
    with pytest.raises(hal.InvalidStateError, match="restore_physical"):
        a.allocate(16)
    a.restore_physical()
    assert not a.paused and be.live.mappings == mapped
    assert ctypes.string_at(p1, 8) == b"graphs!!"  # the chunk was never released: data intact
    a.release_physical()
    a.restore_physical()
    a.close()
    assert be.live.zero, be.live


def test_hand_over_gives_the_handle_away_and_the_chunk_holds_none(be: hal.Backend) -> None:
    backing = Backing(be)
    chunk = Chunk(G)
    backing.create(chunk)
    handle = chunk.handle
    assert backing.hand_over(chunk) is handle and chunk.handle is None
    assert not backing.release(chunk) and be.live.chunks == 1  # nothing left to release here: the holder does
    be.release_phy_mem_handle(handle)
