"""GraphRunner when things fail: a failed capture, a rejected graph, driver faults in capture, release and
close; what failed is finished by close() again and nothing is left live."""

from __future__ import annotations

import gc

import pytest
import torch

import graphkit
import hal
from tests.conftest import G


def test_a_failed_first_capture_does_not_pin_its_examples(be: hal.Backend) -> None:
    calls = {"n": 0}

    def step(x: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        if x.shape[1] != 8:
            return x * float(x.sum().item())  # a host sync: the capture fails
        return x * 2

    runner = graphkit.GraphRunner(step, sizes=[2, 4], backend=be, progress=False, warmup=0)
    with pytest.raises(hal.CaptureError):
        runner.capture(x=torch.zeros(4, 5))
    runner.capture(x=torch.zeros(4, 8))  # new examples, new static buffers
    assert runner.inputs.buffers["x"].shape == (4, 8)
    torch.testing.assert_close(runner(x=torch.ones(3, 8)), torch.full((3, 8), 2.0))
    runner.close()
    assert be.live.graphs == 0


@pytest.mark.parametrize("pool", ["vmm", "private", "shared"])
def test_strict_hygiene_releases_the_graph_it_rejects(be: hal.Backend, pool: str) -> None:
    """Every pool kind is checked, a graph-private one too."""
    cache: dict = {}

    def step(x: torch.Tensor) -> torch.Tensor:
        cache.setdefault("table", torch.ones(512, 4))  # born in the capture and kept
        return x + cache["table"][: x.shape[0]]

    runner = graphkit.GraphRunner(step, sizes=[4], backend=be, kind=pool, progress=False, warmup=0,
                                  strict_hygiene=True)
    with pytest.raises(graphkit.CaptureHygieneError):
        runner.capture(x=torch.zeros(4, 4))
    assert be.live.graphs == 0  # the rejected graph was released
    cache.clear()
    runner.close()
    assert be.live.pools == 0


@pytest.mark.parametrize("hook", ["release_graph", "release_pool", "unmap", "release_phy_mem_handle"])
def test_a_fault_during_close_releases_everything_else(be: hal.Backend, hook: str) -> None:
    w = torch.randn(64, 64)
    runner = graphkit.GraphRunner(lambda x: torch.tanh(x @ w), sizes=[1, 2, 4, 8], backend=be, progress=False)
    runner.capture(x=torch.zeros(8, 64))
    be.faults.fail(hook, nth=1)
    try:
        runner.close()  # a hal error, or a clean recovery (a chunk release is retried at once)
    except hal.DriverError as exc:
        assert "injected" in str(exc)
    be.faults.clear()
    with pytest.raises(hal.InvalidStateError, match="closed"):
        runner(x=torch.zeros(1, 64))
    live = be.live
    assert live.graphs <= 1 and live.pools <= 1  # only what the failed call held
    be.close()  # and the backend releases that
    assert be.live.zero, be.live


@pytest.mark.parametrize("hook,nth", [("mem_info", 3), ("synchronize", 4), ("pool_active_blocks", 2)])
def test_a_fault_late_in_capture_leaves_nothing_behind(hook: str, nth: int) -> None:
    """After the graph is captured (the tail: synchronize, memory figures, the hygiene check)."""
    w = torch.randn(32, 32)
    be = hal.get_backend("fake", granularity=G)
    runner = graphkit.GraphRunner(lambda x: torch.tanh(x @ w), sizes=[8], backend=be, progress=False)
    be.faults.fail(hook, nth=nth)
    with pytest.raises(hal.DriverError, match="injected"):
        runner.capture(x=torch.zeros(8, 32))
    assert be.faults.fired == [hook]
    be.faults.clear()
    runner.close()
    gc.collect()
    assert be.live.zero, be.live
    be.close()


@pytest.mark.parametrize("hook", ["synchronize", "release_graph", "release_pool", "unmap"])
def test_close_goes_on_past_a_fault_and_a_second_close_finishes(be: hal.Backend, hook: str) -> None:
    runner = graphkit.GraphRunner(lambda x: torch.tanh(x) * 2, sizes=[4, 8], backend=be, progress=False)
    runner.capture(x=torch.zeros(8, 8))
    be.faults.fail(hook, nth=1)
    with pytest.raises(hal.DriverError, match="injected"):
        runner.close()
    with pytest.raises(hal.InvalidStateError, match="closed"):
        runner(x=torch.zeros(2, 8))
    runner.close()
    gc.collect()
    assert be.live.zero, be.live


def test_a_size_whose_pool_would_not_go_keeps_its_key_for_close(be: hal.Backend) -> None:
    runner = graphkit.GraphRunner(lambda x: x + 1, sizes=[2, 4], backend=be, progress=False)
    runner.capture(x=torch.zeros(4, 8))
    be.faults.fail("release_pool", nth=1)
    with pytest.raises(hal.DriverError, match="injected"):
        runner.release_size(2)
    assert runner.captured_sizes == [4] and 2 in runner.pools  # the key keeps the pool, to release again
    assert torch.equal(runner(x=torch.ones(1, 8)), torch.full((1, 8), 2.0))
    runner.close()
    assert 2 not in runner.pools and be.live.zero, be.live


def test_close_after_the_backends_close_finishes(be: hal.Backend) -> None:
    """The backend's close released every graph, pool and chunk: the runner's close only forgets them."""
    runner = graphkit.GraphRunner(lambda x: x * 2, sizes=[2, 4], backend=be, progress=False)
    runner.capture(x=torch.zeros(4, 8))
    be.close()
    runner.close()
    assert runner.pools is not None and runner.pools.closed and runner.pools.allocator.closed
    assert runner.captured_sizes == []
    with pytest.raises(hal.InvalidStateError, match="closed"):
        runner(x=torch.zeros(1, 8))
    runner.close()
