"""SharedVMMAllocator.stand_in: granules of a space backed for a while by scratch chunks, then by their own."""

from __future__ import annotations

import pytest
import torch

import graphkit
import hal
from tests.conftest import G


def _two_spaces(be: hal.Backend) -> tuple[graphkit.SharedVMMAllocator, int, torch.Tensor, torch.Tensor]:
    """An allocator whose two spaces reach two granules each, over the same shared chunks."""
    alloc = graphkit.SharedVMMAllocator(be, reserve_bytes=4 * G)
    a = alloc.switch_to_new_virtual_space()
    in_a = be.tensor_at(alloc.allocate(2 * G), 2 * G)
    alloc.switch_to_new_virtual_space()
    in_b = be.tensor_at(alloc.allocate(2 * G), 2 * G)
    in_a.fill_(7)
    return alloc, a, in_a, in_b


def test_a_granule_stands_in_for_a_while_and_its_space_gets_its_own_bytes_back(be: hal.Backend) -> None:
    alloc, a, in_a, in_b = _two_spaces(be)
    chunks = be.live.chunks
    with alloc.stand_in({a: [1]}) as addresses:  # the device is waited for first: in_a's fill may be queued
        assert addresses == [alloc.spaces[a].base + G]
        assert be.live.chunks == chunks + 1
        in_a[G:].fill_(9)  # into the scratch chunk
        assert torch.all(in_b == 7) and torch.all(in_a[:G] == 7)  # the shared chunks are untouched
    assert torch.all(in_a == 7)  # its own chunk at the same address again, bytes as they were
    assert be.live.chunks == chunks and alloc.physical_bytes == 2 * G
    in_b.fill_(5)
    assert torch.all(in_a == 5)  # shared again, as before
    del in_a, in_b
    alloc.close()
    assert be.live.zero


def test_a_granule_that_is_not_mapped_cannot_stand_in(be: hal.Backend) -> None:
    alloc, a, in_a, in_b = _two_spaces(be)
    with pytest.raises(hal.InvalidStateError, match="granule 3 of space"), alloc.stand_in({a: [3]}):
        pass
    assert be.live.chunks == 2
    del in_a, in_b
    alloc.close()


@pytest.mark.parametrize("hook", ["create_phy_mem_handle", "map", "unmap"])
def test_a_fault_while_standing_in_maps_everything_back(be: hal.Backend, hook: str) -> None:
    alloc, a, in_a, in_b = _two_spaces(be)
    before = be.live
    be.faults.fail(hook, nth=2)  # the second granule's step fails: the first one's swap is undone
    with pytest.raises(hal.DriverError, match="injected"), alloc.stand_in({a: [0, 1]}):
        pass
    be.faults.clear()
    assert be.live == before and not alloc.paused
    in_b.fill_(3)
    assert torch.all(in_a == 3)  # both granules map the shared chunks again
    del in_a, in_b
    alloc.close()
    assert be.live.zero


@pytest.mark.parametrize("hook", ["map", "unmap", "synchronize"])
def test_a_fault_while_mapping_back_is_tried_again_and_nothing_stays_on_scratch(be: hal.Backend, hook: str) -> None:
    """One fault on the way back (the wait for the device, the scratch's unmap, the own chunk's map): tried once
    more, every granule maps its own chunk again and every scratch chunk is released (it used to stay mapped in
    the other space, released by nobody, not even a retried close)."""
    alloc, a, in_a, in_b = _two_spaces(be)
    before = be.live
    with alloc.stand_in({a: [0, 1]}):
        be.faults.fail(hook, nth=1)
    assert be.faults.fired == [hook]
    assert be.live == before and not alloc.paused and alloc.survivor_bytes == 0
    assert torch.all(in_a == 7)
    in_b.fill_(3)
    assert torch.all(in_a == 3)  # shared again
    del in_a, in_b
    alloc.close()
    assert be.live.zero


def test_a_granule_whose_own_chunk_will_not_map_back_keeps_its_scratch_and_the_fault_is_raised(
        be: hal.Backend) -> None:
    """Two faults on the way back: the granule keeps the scratch chunk as a chunk of its own, with the bytes it
    held; the space's release or the allocator's close releases it. No scratch chunk is ever left to nobody."""
    alloc, a, in_a, in_b = _two_spaces(be)
    with pytest.raises(hal.DriverError, match="would not map their own chunks again"):
        with alloc.stand_in({a: [1]}):
            in_a[G:].fill_(7)  # what the verifier leaves there: the granule's own bytes
            be.faults.fail("map", nth=1)  # the own chunk's map fails; the scratch's map back (the rollback) works
            be.faults.fail("map", nth=2)  # and the own chunk's map fails again, when it is tried once more
    assert alloc.survivor_bytes == G and not alloc.paused
    assert torch.all(in_a == 7)
    in_b.fill_(3)
    assert torch.all(in_a[:G] == 3) and torch.all(in_a[G:] == 7)  # the kept granule is its space's alone
    del in_a, in_b
    alloc.release_virtual_space(a)
    assert alloc.survivor_bytes == 0
    alloc.close()
    assert be.live.zero
