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
