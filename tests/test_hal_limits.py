"""Arguments the facade refuses before a driver sees them (sizes that would wrap, bad addresses, bad faults)."""

from __future__ import annotations

import pytest

import hal

G = 1 << 16


@pytest.fixture
def be():
    backend = hal.get_backend("fake", granularity=G)
    yield backend
    backend.close()


@pytest.mark.parametrize("size", [2 ** 64, 2 ** 64 + G, 2 ** 70])
def test_sizes_that_would_wrap_in_size_t_are_refused(be: hal.Backend, size: int) -> None:
    for call in (be.create_vir_ptr, be.create_phy_mem_handle):
        with pytest.raises(hal.InvalidArgumentError, match="2\\*\\*64"):
            call(size)
    assert be.live.zero


@pytest.mark.parametrize("ptr", [-G, 2 ** 64, 1.5, "0x1000", None])
def test_bad_addresses_are_refused(be: hal.Backend, ptr: object) -> None:
    with pytest.raises(hal.InvalidArgumentError, match="ptr="):
        be.release_vir_ptr(ptr, G)  # type: ignore[arg-type]
    with pytest.raises(hal.InvalidArgumentError, match="ptr="):
        be.unmap(ptr, G)  # type: ignore[arg-type]


@pytest.mark.parametrize("nth", [0, -1, 1.5, True, "2"])
def test_fault_rules_take_whole_counts(be: hal.Backend, nth: object) -> None:
    with pytest.raises(hal.InvalidArgumentError, match="nth="):
        be.faults.fail("map", nth=nth)  # type: ignore[arg-type]
    with pytest.raises(hal.InvalidArgumentError, match="hook="):
        be.faults.fail("no_such_hook")
    assert be.faults.pending == 0
