"""The asynchronous fake: an unmap that did not wait for the work queued over the range is a use after unmap."""

from __future__ import annotations

import gc
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import graphkit
import hal
from hal.backends.fake import FakeBackend
from hal.testing import graph_suite
from tests.conftest import G
from tests.paths import ROOT


@pytest.fixture
def abe() -> Iterator[hal.Backend]:
    """An asynchronous fake, whatever the environment says."""
    backend = hal.get_backend("fake", granularity=G, asynchronous=True)
    yield backend
    gc.collect()
    backend.close()


class Mapped:
    """One chunk mapped at the start of a reserved range of two granules."""

    def __init__(self, be: hal.Backend) -> None:
        self.be = be
        self.va = be.create_vir_ptr(2 * G)
        self.handle = be.create_phy_mem_handle(G)
        be.map(self.va, G, self.handle)

    def floats(self) -> torch.Tensor:
        return self.be.tensor_at(self.va, G).view(torch.float32)

    def free(self, *, wait: bool = False) -> None:
        self.be.unmap(self.va, G, wait=wait)
        self.be.release_phy_mem_handle(self.handle)
        self.be.release_vir_ptr(self.va, 2 * G)


def captured_add(be: hal.Backend, x: torch.Tensor) -> tuple[Any, Any]:
    """A graph whose replay adds 1 to ``x``, and the pool it was captured into."""
    graph, pool = be.create_graph(), be.create_pool()
    with be.capture(graph, pool, be.create_stream()):
        x.add_(1)
    return graph, pool


def test_an_unmap_after_a_replay_without_a_wait_is_refused_and_changes_nothing(abe: hal.Backend) -> None:
    m = Mapped(abe)
    x = m.floats()
    x.fill_(1)
    abe.synchronize()  # the tensor is made and filled; only the replay below is queued work
    graph, pool = captured_add(abe, x)
    abe.unmap(m.va, G)  # a capture runs nothing on a device: nothing is in flight yet
    abe.map(m.va, G, m.handle)
    abe.synchronize()
    abe.replay(graph)
    live = abe.live
    with pytest.raises(hal.UseAfterUnmapError) as caught:
        abe.unmap(m.va, G)
    text = str(caught.value)
    assert text.startswith("fake.unmap: ") and f"[{m.va:#x}, {m.va + G:#x})" in text
    assert "the replay of a graph captured into the fake device pool" in text
    assert text.endswith("Synchronize the device or the streams that used it first, or unmap with wait=True")
    assert isinstance(caught.value, hal.InvalidStateError)
    assert abe.live == live  # still mapped, as the facade and the backend see it
    assert float(x.sum()) == 3 * x.numel()  # the bytes are still there (filled, then the replay and the capture)
    abe.synchronize()
    abe.unmap(m.va, G)
    abe.release_graph(graph)
    abe.release_pool(pool)
    abe.release_phy_mem_handle(m.handle)
    abe.release_vir_ptr(m.va, 2 * G)


def test_a_released_graphs_queued_replay_stays_in_flight_whatever_graph_takes_its_id(
        abe: hal.Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    """The record of queued replays is keyed by a serial no two graphs share: a graph made after a replayed one was
    released and collected -- CPython may give it the dead one's ``id()``, as every graph gets the same one here --
    does not take over the record and drop the dead graph's queued replay (its unmap went through under it)."""
    import hal.host.inflight

    monkeypatch.setattr(hal.host.inflight, "id", lambda obj: 1, raising=False)  # every id() the dead one's
    m = Mapped(abe)
    x = m.floats()
    graph, pool = captured_add(abe, x)
    abe.synchronize()
    abe.replay(graph)
    abe.release_graph(graph)  # released, its replay still queued
    del graph
    gc.collect()
    other = abe.create_graph()
    with abe.capture(other, pool):
        torch.ones(4) * 2
    abe.replay(other)
    with pytest.raises(hal.UseAfterUnmapError, match="the replay of a graph captured into the fake device pool"):
        abe.unmap(m.va, G)
    abe.synchronize()
    m.free()
    abe.release_graph(other)
    abe.release_pool(pool)


def test_a_capture_says_it_captures_and_refuses_a_device_wide_wait(abe: hal.Backend) -> None:
    """While this thread records a capture the asynchronous fake says so (``capturing()``), and a device-wide wait
    inside it is refused as a GPU refuses it (it would end the capture)."""
    import threading

    graph = abe.create_graph()
    seen: list[bool] = []
    assert not abe.capturing()
    with pytest.raises(hal.CaptureError, match=r"synchronize\(\) inside a capture on this thread"):
        with abe.capture(graph):
            seen.append(abe.capturing())
            worker = threading.Thread(target=lambda: seen.append(abe.capturing()))
            worker.start()
            worker.join()
            abe.synchronize()
    assert seen == [True, False] and not abe.capturing()
    abe.release_graph(graph)


def test_memory_that_goes_back_inside_a_capture_is_unmapped_without_a_wait(abe: hal.Backend) -> None:
    """A capture whose allocation fails half-way gives back the granules it mapped, inside the capture: no wait
    for the device there (the capture runs nothing, and a wait would end it), the allocation's own error stays
    the one raised, and the pools stay usable."""
    pools = graphkit.GraphPools(abe)
    graph = abe.create_graph()
    abe.faults.fail("map", nth=3)  # the third granule of one allocation of four
    with pytest.raises(hal.DeviceOutOfMemoryError, match="injected"):
        with abe.capture(graph, pool=pools.pool("k")):
            torch.empty(4 * G // 4 - 64)
    assert abe.faults.fired == ["map"]
    assert pools.allocator.spaces[pools.lease("k").space_id].mapped == 0  # given back
    abe.release_graph(graph)
    again = abe.create_graph()
    with abe.capture(again, pool=pools.pool("k")):
        y = torch.ones(4 * G // 4 - 64)
    abe.release_graph(again)
    del y
    pools.close()
    assert abe.live.zero, abe.live


def test_a_wait_on_any_stream_lets_the_unmap_through(abe: hal.Backend) -> None:
    m = Mapped(abe)
    x = m.floats()
    graph, pool = captured_add(abe, x)
    abe.replay(graph)
    abe.synchronize(abe.create_stream())  # one queue on fake: a stream's wait is the device's
    m.free()
    abe.release_graph(graph)
    abe.release_pool(pool)


def test_memory_a_pool_handed_out_is_in_flight_until_a_wait(abe: hal.Backend) -> None:
    segments: list[Mapped] = []

    def alloc(nbytes: int) -> int:
        assert nbytes == G
        segments.append(Mapped(abe))
        return segments[-1].va

    def free(ptr: int, nbytes: int) -> None:
        next(s for s in segments if s.va == ptr).free(wait=True)

    pool = abe.create_pool(alloc, free)
    with abe.use_pool(pool):
        y = torch.ones(256)  # eager kernels may still be writing it on a device
    (m,) = segments
    assert m.va <= y.data_ptr() < m.va + G
    with pytest.raises(hal.UseAfterUnmapError, match="a block of the fake custom pool at"):
        abe.unmap(m.va, G)
    del y
    with pytest.raises(hal.UseAfterUnmapError):  # dropping the tensor does not wait for its kernels either
        abe.unmap(m.va, G)
    abe.synchronize()
    abe.unmap(m.va, G)
    abe.map(m.va, G, m.handle)  # for the pool's free callback
    abe.release_pool(pool)
    assert abe.live.mappings == 0


def test_unmap_and_release_with_wait_wait_first(abe: hal.Backend) -> None:
    m = Mapped(abe)
    m.floats().fill_(2)
    abe.unmap(m.va, G, wait=True)
    abe.map(m.va, G, m.handle)
    abe.tensor_at(m.va, G)
    with pytest.raises(hal.UseAfterUnmapError, match="a tensor from tensor_at at"):
        abe.unmap(m.va, G)
    with pytest.raises(hal.InvalidStateError, match="still mapped"):  # a chunk goes only once unmapped
        abe.release_phy_mem_handle(m.handle, wait=True)
    abe.unmap(m.va, G, wait=True)
    abe.release_phy_mem_handle(m.handle, wait=True)
    abe.release_vir_ptr(m.va, 2 * G)


@pytest.mark.parametrize("wait", [1, None, "yes"])
def test_wait_is_a_bool(abe: hal.Backend, wait: Any) -> None:
    m = Mapped(abe)
    with pytest.raises(hal.InvalidArgumentError, match=f"unmap: wait={wait!r} must be True or False"):
        abe.unmap(m.va, G, wait=wait)
    with pytest.raises(hal.InvalidArgumentError, match="release_phy_mem_handle: wait="):
        abe.release_phy_mem_handle(m.handle, wait=wait)
    m.free()


def test_close_waits_before_it_unmaps_what_is_left(abe: hal.Backend, caplog: pytest.LogCaptureFixture) -> None:
    m = Mapped(abe)
    m.floats().fill_(1)  # in flight, and never unmapped by the caller
    abe.close()  # no UseAfterUnmapError: close waited first
    assert abe.closed and abe.live.zero
    assert "close() releases 1 mapping(s)" in caplog.text


def test_the_option_off_runs_as_before() -> None:
    with hal.get_backend("fake", granularity=G, asynchronous=False) as be:
        m = Mapped(be)
        x = m.floats()
        graph, pool = captured_add(be, x)
        be.replay(graph)
        m.free()  # no wait needed: host work is done when it is issued
        be.release_graph(graph)
        be.release_pool(pool)


def test_the_environment_sets_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HAL_FAKE_ASYNC", "0")
    assert FakeBackend().in_flight is None
    monkeypatch.setenv("HAL_FAKE_ASYNC", "1")
    assert FakeBackend().in_flight is not None
    assert FakeBackend(asynchronous=False).in_flight is None  # the option wins over the environment
    monkeypatch.setenv("HAL_FAKE_ASYNC", "yes")
    with pytest.raises(hal.InvalidArgumentError, match="HAL_FAKE_ASYNC='yes' must be 1"):
        FakeBackend()
    with pytest.raises(hal.InvalidArgumentError, match="asynchronous=1 must be True or False"):
        hal.get_backend("fake", asynchronous=1)


def test_the_suite_runs_asynchronous_in_child_processes_too() -> None:
    code = "import hal; print(hal.get_backend('fake').plugin.in_flight is not None)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "True"


class CountedWaits(FakeBackend):
    """A fake that counts the device waits asked of it."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.waits = 0

    @hal.hookimpl
    def synchronize(self, stream: Any) -> None:
        self.waits += 1
        FakeBackend.synchronize(self, stream)


class WaitingUnmap(CountedWaits):
    """A fake whose unmap waits for the queued work itself, as ROCm's ``hipMemUnmap`` does."""

    @hal.hookimpl
    def capabilities(self) -> frozenset[str]:
        return FakeBackend.capabilities(self) | {"unmap_waits"}

    @hal.hookimpl
    def unmap(self, ptr: int, size: int) -> None:
        assert self.in_flight is not None
        self.in_flight.waited()  # the driver waits for the queued work
        FakeBackend.unmap(self, ptr, size)


def test_unmap_with_wait_synchronizes_the_device_once() -> None:
    plugin = CountedWaits(granularity=G, asynchronous=True)
    with hal.Backend("counted", plugin) as be:
        m = Mapped(be)
        m.floats()
        m.free(wait=True)
        assert plugin.waits == 1
        m = Mapped(be)
        m.floats()
    assert plugin.waits == 2  # close() waited once before it unmapped what was left


def test_a_backend_whose_unmap_waits_is_not_synchronized_for_it() -> None:
    plugin = WaitingUnmap(granularity=G, asynchronous=True)
    with hal.Backend("waiting", plugin) as be:
        assert be.supports("unmap_waits")
        m = Mapped(be)
        m.floats()
        m.free(wait=True)
        m = Mapped(be)
        m.floats()
    assert plugin.waits == 0  # neither the unmap with wait=True nor close() asked for a wait


class ClaimsUnmapWaits(FakeBackend):
    """Declares ``"unmap_waits"`` while its unmap does not wait."""

    @hal.hookimpl
    def capabilities(self) -> frozenset[str]:
        return FakeBackend.capabilities(self) | {"unmap_waits"}


def test_the_conformance_suite_catches_a_false_unmap_waits_and_passes_the_others() -> None:
    case = graph_suite.TestUnmapAfterQueuedWork()
    with hal.Backend("claims", ClaimsUnmapWaits(granularity=G, asynchronous=True)) as be:
        with pytest.raises(hal.UseAfterUnmapError, match="the replay of a graph"):
            case.test_an_unmap_right_after_a_replay_waits_for_it(be)
    for plugin in (WaitingUnmap(granularity=G, asynchronous=True), FakeBackend(granularity=G, asynchronous=True)):
        with hal.Backend("passes", plugin) as be:
            case.test_an_unmap_right_after_a_replay_waits_for_it(be)


def test_a_saver_closed_before_its_queued_kernels_are_done_waits_for_them(abe: hal.Backend) -> None:
    """The shape of a region closed right after kernels that write it were queued (a GPU faults there)."""
    saver = graphkit.MemorySaver(abe)
    with saver.region("t"):
        data = torch.empty(1 << 20, dtype=torch.uint8)
    data.fill_(3)
    for _ in range(3):
        data.add_(1)  # queued on a device
    del data
    saver.close()  # must wait for the work first, not fault
    assert abe.live.mappings == 0
