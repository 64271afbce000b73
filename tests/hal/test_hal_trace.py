"""With HAL_TRACE=1 every contract call is logged on logger "hal.trace"."""

from __future__ import annotations

import logging

import pytest

import hal

CALLED = ("granularity", "device_count", "mem_info", "create_vir_ptr", "create_phy_mem_handle",
          "map", "unmap", "release_phy_mem_handle", "release_vir_ptr", "shutdown")


def exercise(be: hal.Backend) -> None:
    g = be.granularity
    be.device_count()
    be.mem_info()
    va, h = be.create_vir_ptr(2 * g), be.create_phy_mem_handle(g)
    be.map(va, g, h)
    be.unmap(va, g)
    be.release_phy_mem_handle(h)
    be.release_vir_ptr(va, 2 * g)
    be.close()


def test_every_contract_call_is_traced(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("HAL_TRACE", "1")
    caplog.set_level(logging.DEBUG, logger="hal.trace")
    exercise(hal.get_backend("fake", granularity=1 << 16))
    messages = [r.getMessage() for r in caplog.records if r.name == "hal.trace"]
    for hook in CALLED:
        assert any(m.startswith(f"fake.{hook}(") for m in messages), f"{hook} was not traced: {messages}"
    created = next(m for m in messages if m.startswith("fake.create_vir_ptr("))
    assert f"size={2 << 16:#x}" in created and "-> 0x" in created


def test_a_failed_call_is_traced_with_its_error(monkeypatch: pytest.MonkeyPatch,
                                                caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("HAL_TRACE", "1")
    caplog.set_level(logging.DEBUG, logger="hal.trace")
    with hal.get_backend("fake", granularity=1 << 16) as be:
        be.faults.fail("create_vir_ptr")
        with pytest.raises(hal.DriverError):
            be.create_vir_ptr(be.granularity)
    assert any(r.getMessage().startswith("fake.create_vir_ptr(") and "raised DriverError" in r.getMessage()
               for r in caplog.records)


def test_no_trace_without_hal_trace(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.delenv("HAL_TRACE", raising=False)
    caplog.set_level(logging.DEBUG, logger="hal.trace")
    exercise(hal.get_backend("fake", granularity=1 << 16))
    assert not [r for r in caplog.records if r.name == "hal.trace"]
