"""The vmm contract through the facade: the documented scenario, aliasing, out of memory, the arguments it
refuses before a driver sees them (sizes that would wrap, bad addresses, bad fault rules) and live counts."""

from __future__ import annotations

import ctypes
import errno
import gc
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import hal
from hal.api import VMM_HOOKS
from hal.host import _os as hostvm
from hal.testing.state import snapshot
from tests.conftest import G
from tests.values import BAD_VALUE_SETTINGS, NOT_A_SIZE


def test_the_documented_scenario_runs_as_written() -> None:
    import ctypes, hal  # noqa: E401,I001 - as the README writes it
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


@BAD_VALUE_SETTINGS
@given(value=st.one_of(NOT_A_SIZE, st.just(0)))
def test_sizes_that_are_no_byte_count_are_hal_errors(be: hal.Backend, value: object) -> None:
    for call in (be.create_vir_ptr, be.create_phy_mem_handle):
        with pytest.raises(hal.HalError):
            call(value)  # type: ignore[arg-type]
    if value != 0:  # an empty tensor is fine
        with pytest.raises(hal.HalError):
            be.tensor_at(0x1000, value)  # type: ignore[arg-type]
    assert be.live.ranges == 0 and be.live.chunks == 0


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


def test_live_counts_every_graph_dropped_without_release(be: hal.Backend) -> None:
    """Tracked by identity: ids of collected graphs are reused, the count must not shrink with them."""
    for _ in range(1000):
        be.create_graph()  # dropped at once, never released
    gc.collect()
    assert be.live.graphs == 1000
    kept = [be.create_graph() for _ in range(3)]
    for graph in kept:
        be.release_graph(graph)
    assert be.live.graphs == 1000
    pool = be.create_pool()
    be.release_pool(pool)
    be.release_pool(pool)  # twice: counted once
    assert be.live.pools == 0


def test_close_releases_pools_and_graphs_left_live() -> None:
    be = hal.get_backend("fake", granularity=G)
    graph = be.create_graph()
    x = torch.ones(4)
    with be.capture(graph):
        y = x * 2
    kept_pool = be.create_pool()
    be.create_graph()  # dropped unreleased
    assert be.live.graphs == 2 and be.live.pools == 1
    be.close()
    assert be.live.zero, be.live
    assert graph.released and kept_pool._released
    del y


# -- failure paths -------------------------------------------------------------------------------------------------
# A failure in any one contract call leaves the facade's bookkeeping exactly as before.


QUERY_HOOKS = ("granularity", "mem_info", "device_count")


@pytest.fixture
def be() -> Iterator[hal.Backend]:
    backend = hal.get_backend("fake", granularity=1 << 16, capacity=1 << 22)
    yield backend
    backend.close()
    assert backend.live.zero


def prepare(be: hal.Backend, hook: str) -> Callable[[], Any]:
    """Put ``be`` in a state where calling ``hook`` is valid; return that call."""
    g = be.granularity
    va = be.create_vir_ptr(4 * g)
    h = be.create_phy_mem_handle(g)
    be.map(va, g, h)  # something live of every kind
    calls: dict[str, Callable[[], Any]] = {
        "create_vir_ptr": lambda: be.create_vir_ptr(2 * g),
        "create_phy_mem_handle": lambda: be.create_phy_mem_handle(2 * g),
        "granularity": lambda: be.recommended_granularity,
        "mem_info": be.mem_info,
        "device_count": be.device_count,
    }
    if hook == "release_vir_ptr":
        va2 = be.create_vir_ptr(2 * g)
        return lambda: be.release_vir_ptr(va2, 2 * g)
    if hook == "release_phy_mem_handle":
        h2 = be.create_phy_mem_handle(g)
        return lambda: be.release_phy_mem_handle(h2)
    if hook == "map":
        return lambda: be.map(va + 2 * g, g, h)
    if hook == "unmap":
        return lambda: be.unmap(va, g)
    return calls[hook]


def test_a_closed_backend_refuses_every_call_naming_it() -> None:
    be = hal.get_backend("fake", granularity=G)
    g = be.granularity
    be.close()
    calls = {"mem_info": be.mem_info, "device_count": be.device_count,
             "granularity": lambda: be.recommended_granularity, "create_vir_ptr": lambda: be.create_vir_ptr(G),
             "create_graph": be.create_graph, "current_device": be.current_device,
             "stream_state_sizes": be.stream_state_sizes,
             "create_stream": be.create_stream, "synchronize": be.synchronize}
    for call, fn in calls.items():
        with pytest.raises(hal.InvalidStateError, match=f"fake.{call}: the backend is closed; get a new one with "
                                                        r"hal\.get_backend\(\)"):
            fn()
    assert be.granularity == g and be.closed  # what it was stays readable


def test_snapshot_sees_bookkeeping_changes(be: hal.Backend) -> None:
    """The comparison below is not vacuous: a successful call changes the snapshot."""
    call = prepare(be, "map")
    before = snapshot(be)
    assert {"_ranges", "_handles", "_mappings"} <= set(before.bookkeeping)
    call()
    after = snapshot(be)
    assert after != before and after.live.mappings == before.live.mappings + 1


@pytest.mark.parametrize("hook", [*VMM_HOOKS, *QUERY_HOOKS])
def test_injected_fault_leaves_bookkeeping_unchanged(be: hal.Backend, hook: str) -> None:
    call = prepare(be, hook)
    before = snapshot(be)
    be.faults.fail(hook)
    with pytest.raises(hal.DriverError) as info:
        call()
    assert (info.value.backend, info.value.call, info.value.code) == ("fake", hook, -1)
    assert "HAL_INJECTED_FAULT" in str(info.value)
    assert be.faults.fired == [hook]
    assert snapshot(be) == before
    call()  # nothing was left half-done: the same call now succeeds
    assert be.faults.pending == 0


#: hook -> the host VM function the fake calls for it
HOSTVM_CALLS = {
    "create_vir_ptr": "reserve",
    "release_vir_ptr": "free",
    "create_phy_mem_handle": "create_chunk",
    "release_phy_mem_handle": "release_chunk",
    "map": "map_chunk",
    "unmap": "unmap_chunk",
}


@pytest.mark.parametrize("hook", VMM_HOOKS)
def test_driver_failure_leaves_bookkeeping_unchanged(be: hal.Backend, hook: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    call = prepare(be, hook)
    before = snapshot(be)
    real = getattr(hostvm, HOSTVM_CALLS[hook])

    def failing(*args: Any) -> Any:
        raise OSError(errno.ENOMEM, "simulated driver failure")

    monkeypatch.setattr(hostvm, HOSTVM_CALLS[hook], failing)
    with pytest.raises(hal.HalError) as info:
        call()
    assert info.value.call == hook
    assert snapshot(be) == before
    monkeypatch.setattr(hostvm, HOSTVM_CALLS[hook], real)
    call()  # the backend is still consistent with the facade


def test_nth_call_fails_and_earlier_ones_stay(be: hal.Backend) -> None:
    g = be.granularity
    va = be.create_vir_ptr(4 * g)
    h = be.create_phy_mem_handle(g)
    be.faults.fail("map", nth=3)
    be.map(va, g, h)
    be.map(va + g, g, h)
    before = snapshot(be)
    with pytest.raises(hal.DriverError):
        be.map(va + 2 * g, g, h)
    assert snapshot(be) == before and be.live.mappings == 2
    with pytest.raises(hal.InvalidStateError):  # the handle is still known to be mapped twice
        be.release_phy_mem_handle(h)


def test_custom_error_is_raised_as_given(be: hal.Backend) -> None:
    error = hal.DeviceOutOfMemoryError("simulated full device", backend="fake", call="create_phy_mem_handle")
    be.faults.fail("create_phy_mem_handle", error=error)
    with pytest.raises(hal.DeviceOutOfMemoryError) as info:
        be.create_phy_mem_handle(be.granularity)
    assert info.value is error and be.live.chunks == 0


def test_fault_rules_are_checked(be: hal.Backend) -> None:
    with pytest.raises(ValueError, match="not_a_hook"):
        be.faults.fail("not_a_hook")
    with pytest.raises(ValueError, match="nth=0"):
        be.faults.fail("map", nth=0)
    be.faults.fail("map")
    be.faults.clear()
    assert be.faults.pending == 0


def _protection(ptr: int) -> str:
    """The permissions /proc/self/maps shows for the mapping that holds ``ptr`` (``rw-s``, ``---s``...)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            span, perms = line.split()[:2]
            lo, hi = (int(x, 16) for x in span.split("-"))
            if lo <= ptr < hi:
                return perms
    raise AssertionError(f"{ptr:#x} is mapped nowhere")


def test_maps_in_a_deferred_access_block_are_made_accessible_at_its_end_with_one_call_per_run(
        be: hal.Backend) -> None:
    """Inside ``deferred_access()`` the chunks mapped stay inaccessible (touching one faults, as on a GPU before
    its ``cuMemSetAccess``); at the block's end one call per contiguous run makes them read-write, also when the
    block raised. A block inside a block joins it."""
    va = be.create_vir_ptr(8 * G)
    handles = [be.create_phy_mem_handle(G) for _ in range(6)]
    calls = be.plugin.access_calls
    with be.count_calls() as counted, be.deferred_access():
        for i in range(4):
            be.map(va + i * G, G, handles[i])
        with be.deferred_access():  # joins the outer block
            be.map(va + 5 * G, G, handles[4])
        assert _protection(va) == _protection(va + 5 * G) == "---s"
    assert counted["deferred_access"] == 2 and counted["map"] == 5
    assert be.plugin.access_calls - calls == 2  # [0, 4) and [5, 6): two runs
    assert _protection(va) == _protection(va + 3 * G) == _protection(va + 5 * G) == "rw-s"
    ctypes.memset(va, 7, 4 * G)
    with pytest.raises(KeyError), be.deferred_access():
        be.map(va + 6 * G, G, handles[5])
        raise KeyError("the block's own error")  # not the plugin's: not turned into a hal error
    assert _protection(va + 6 * G) == "rw-s"
    for i in (0, 1, 2, 3, 5, 6):
        be.unmap(va + i * G, G)
    for handle in handles:
        be.release_phy_mem_handle(handle)
    be.release_vir_ptr(va, 8 * G)
    assert be.live.zero
