"""A failure in any one contract call leaves the facade's bookkeeping exactly as before."""

from __future__ import annotations

import errno
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import hal
from hal.api import VMM_HOOKS
from hal.host import _os as hostvm
from hal.testing.state import snapshot

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
