"""The hal foundation scenario, exactly as documented for users."""

from __future__ import annotations

import ctypes

import pytest

import hal


def test_issue_scenario_as_written() -> None:
    import ctypes, hal  # noqa: E401,I001 - verbatim
    names = {b.name: b for b in hal.list_backends()}
    assert {"cuda", "ascend", "mlu", "fake"} <= set(names) and names["fake"].available
    be = hal.get_backend("fake", granularity=1 << 16, capacity=1 << 22)
    g = be.granularity
    h = be.create_phy_mem_handle(g)
    va1, va2 = be.create_vir_ptr(4 * g), be.create_vir_ptr(4 * g)
    be.map(va1, g, h)
    be.map(va2 + g, g, h)
    ctypes.memmove(va1, b"hal" * 10, 30)
    assert ctypes.string_at(va2 + g, 30) == b"hal" * 10

    with pytest.raises(hal.InvalidArgumentError):
        be.map(va1 + 1, g, h)
    with pytest.raises(hal.DeviceOutOfMemoryError):
        for _ in range(64):  # 1 chunk is live and the capacity holds 64: the 64th of these fails
            be.create_phy_mem_handle(g)
    assert be.live.chunks == (1 << 22) // g
    be.unmap(va1, g)
    be.unmap(va2 + g, g)
    be.release_phy_mem_handle(h)
    with pytest.raises(hal.InvalidStateError):
        be.release_phy_mem_handle(h)

    be.close()
    live = be.live
    assert (live.chunks, live.ranges, live.mappings) == (0, 0, 0)
    assert live.zero


def test_aliasing_is_real_both_ways() -> None:
    with hal.get_backend("fake", granularity=1 << 16, capacity=1 << 22) as be:
        g = be.granularity
        h1, h2 = be.create_phy_mem_handle(g), be.create_phy_mem_handle(g)
        va1, va2 = be.create_vir_ptr(2 * g), be.create_vir_ptr(2 * g)
        be.map(va1, g, h1)
        be.map(va1 + g, g, h2)
        be.map(va2, g, h2)  # swapped order in the second range
        be.map(va2 + g, g, h1)
        ctypes.memmove(va2 + g + 100, b"first", 5)
        ctypes.memmove(va1 + g + 100, b"second", 6)
        assert ctypes.string_at(va1 + 100, 5) == b"first"
        assert ctypes.string_at(va2 + 100, 6) == b"second"


def test_one_chunk_past_capacity_is_out_of_memory() -> None:
    with hal.get_backend("fake", granularity=1 << 16, capacity=1 << 22) as be:
        with pytest.raises(hal.DeviceOutOfMemoryError) as info:
            be.create_phy_mem_handle((1 << 22) + be.granularity)
        assert info.value.call == "create_phy_mem_handle"
        assert be.live.zero
        assert be.mem_info().free == 1 << 22
