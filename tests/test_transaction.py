"""The undo stack every multi-step change to mapped memory runs in, and the steps built on it."""

from __future__ import annotations

import pytest

import hal
from graphkit.memory.transaction import Transaction, map_run, release_or_keep, unmap_run
from tests.conftest import G


def test_commit_keeps_every_step_and_an_exception_undoes_them_last_first() -> None:
    done: list[str] = []
    with Transaction() as tx:
        tx.append(lambda: done.append("undo a"))
        tx.commit()
    assert done == [] and tx.committed
    with pytest.raises(KeyError), Transaction() as tx:
        tx.append(lambda: done.append("undo a"))
        tx.append(lambda: done.append("undo b"))
        raise KeyError("step c failed")
    assert done == ["undo b", "undo a"] and tx.clean


def test_a_failing_undo_is_tried_again_then_recorded_and_the_rest_still_run() -> None:
    calls = {"flaky": 0, "broken": 0}
    done: list[str] = []

    def flaky() -> None:
        calls["flaky"] += 1
        if calls["flaky"] == 1:
            raise hal.DriverError("once", backend="t", call="unmap")

    def broken() -> None:
        calls["broken"] += 1
        raise hal.DriverError("always", backend="t", call="map")

    with pytest.raises(ValueError), Transaction() as tx:
        tx.append(lambda: done.append("first"))
        tx.append(broken)
        tx.append(flaky)
        raise ValueError
    assert calls == {"flaky": 2, "broken": 2} and done == ["first"]
    assert not tx.clean and len(tx.rollback_errors) == 1


def test_map_and_unmap_runs_roll_back_and_keep_the_record_exact() -> None:
    be = hal.get_backend("fake", granularity=G)
    base = be.create_vir_ptr(4 * G)
    handles = [be.create_phy_mem_handle(G) for _ in range(4)]
    mapped: set[int] = set()
    be.faults.fail("map", nth=3)
    with pytest.raises(hal.DriverError), Transaction() as tx:
        map_run(be, base, G, handles, tx, on_map=mapped.add, on_unmap=mapped.discard)
    assert mapped == set() and be.live.mappings == 0
    with Transaction() as tx:
        map_run(be, base, G, handles, tx, on_map=mapped.add, on_unmap=mapped.discard)
        tx.commit()
    assert mapped == {0, 1, 2, 3}
    be.faults.fail("unmap", nth=2)
    with pytest.raises(hal.DriverError), Transaction() as tx:
        unmap_run(be, base, G, handles, tx, on_unmap=mapped.discard, on_map=mapped.add)
    assert mapped == {0, 1, 2, 3} and be.live.mappings == 4
    with Transaction() as tx:
        unmap_run(be, base, G, handles, tx, on_unmap=mapped.discard, on_map=mapped.add)
        tx.commit()
    keep: list[object] = []
    be.faults.fail("release_phy_mem_handle", nth=1)
    be.faults.fail("release_phy_mem_handle", nth=1)
    assert [release_or_keep(be, h, keep) for h in handles] == [False, True, True, True]
    assert keep == handles[:1] and release_or_keep(be, keep.pop(), keep)
    be.release_vir_ptr(base, 4 * G)
    assert be.live.zero
    be.close()
