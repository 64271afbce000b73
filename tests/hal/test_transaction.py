"""The undo stack every multi-step change to mapped memory runs in, and the steps built on it."""

from __future__ import annotations

import pytest

import hal
from graphkit.memory.backing import Backing, Chunk, Place
from hal.transaction import Transaction
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


def test_an_undo_that_must_not_run_twice_is_tried_once_and_the_first_error_propagates() -> None:
    calls: list[bool] = []

    def on_end(ok: bool) -> None:  # a router's callback: not idempotent
        calls.append(ok)
        raise hal.InvalidStateError("the router failed too", backend="t", call="capture")

    with pytest.raises(ValueError, match="the capture failed"), Transaction() as tx:
        tx.append(lambda: on_end(False), retry=False)
        raise ValueError("the capture failed")
    assert calls == [False] and len(tx.rollback_errors) == 1


def test_backing_steps_roll_back_and_keep_the_record_exact() -> None:
    be = hal.get_backend("fake", granularity=G)
    base = be.create_vir_ptr(4 * G)
    backing = Backing(be)
    chunks = [Chunk(G) for _ in range(4)]
    for chunk in chunks:
        backing.create(chunk)
    places = [Place(base + i * G, chunk) for i, chunk in enumerate(chunks)]
    be.faults.fail("map", nth=3)
    with pytest.raises(hal.DriverError), Transaction() as tx:
        for place in places:
            backing.map(place, tx)
    assert not any(p.mapped for p in places) and be.live.mappings == 0
    with Transaction() as tx:
        for place in places:
            backing.map(place, tx)
        tx.commit()
    assert all(p.mapped for p in places) and [c.maps for c in chunks] == [1, 1, 1, 1]
    be.faults.fail("unmap", nth=2)
    with pytest.raises(hal.DriverError), Transaction() as tx:
        for place in reversed(places):
            backing.unmap(place, tx)
    assert all(p.mapped for p in places) and be.live.mappings == 4 and not backing.paused
    with Transaction() as tx:
        for place in reversed(places):
            backing.unmap(place, tx)
        tx.commit()
    be.faults.fail("release_phy_mem_handle", nth=1)
    be.faults.fail("release_phy_mem_handle", nth=1)
    handles = [c.handle for c in chunks]
    assert [backing.release(c) for c in chunks] == [False, True, True, True]
    assert backing.pending == handles[:1] and all(c.handle is None for c in chunks)
    backing.retry()
    assert backing.pending == []
    be.release_vir_ptr(base, 4 * G)
    assert be.live.zero
    be.close()


def test_a_pause_that_cannot_map_back_leaves_a_hole_and_reads_paused_until_a_resume() -> None:
    be = hal.get_backend("fake", granularity=G)
    base = be.create_vir_ptr(2 * G)
    backing = Backing(be)
    chunks = [Chunk(G) for _ in range(2)]
    places = [Place(base + i * G, c) for i, c in enumerate(chunks)]
    with Transaction() as tx:
        for place in places:
            backing.create(place.chunk, tx)
            backing.map(place, tx)
        tx.commit()
    be.faults.fail("unmap", nth=2)  # the second unmap fails; mapping the first back fails twice
    be.faults.fail("map", nth=1)
    be.faults.fail("map", nth=1)
    with pytest.raises(hal.DriverError):
        backing.pause(places, chunks)
    assert backing.paused and not backing.sleeping and not places[1].mapped and places[0].mapped
    backing.resume(places, chunks)
    assert not backing.paused and all(p.mapped for p in places)
    assert backing.pause(places, chunks) == 2 * G and backing.paused
    backing.resume(places, chunks)
    backing.unmap_all(places, errors := [])
    for chunk in chunks:
        backing.release(chunk)
    assert not errors
    be.release_vir_ptr(base, 2 * G)
    assert be.live.zero
    be.close()
