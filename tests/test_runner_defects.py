"""Runner defects, each with the test that shows it fixed: gradients, failed first captures, hygiene, close races."""

from __future__ import annotations

import gc
import random
import threading
import time
from collections.abc import Callable

import pytest
import torch

import graphkit
import hal
from tests.conftest import G


def test_a_call_that_wants_gradients_runs_eagerly_and_the_runner_keeps_working(be: hal.Backend) -> None:
    w = torch.randn(16, 16)
    runner = graphkit.GraphRunner(lambda x: torch.tanh(x @ w), sizes=[2, 4], backend=be, progress=False)
    runner.capture(x=torch.zeros(4, 16))
    x = torch.randn(3, 16, requires_grad=True)
    y = runner(x=x)
    y.sum().backward()  # gradients flow: the call ran eagerly with autograd
    assert x.grad is not None and x.grad.shape == x.shape
    for _ in range(3):  # and the graphs still serve plain calls
        plain = torch.randn(3, 16)
        torch.testing.assert_close(runner(x=plain), torch.tanh(plain @ w))
    with torch.no_grad():  # no gradients wanted: the graph serves it
        torch.testing.assert_close(runner(x=x), torch.tanh(x @ w))
    runner.close()


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


def _call_until_closed(runner: graphkit.GraphRunner, step: Callable[[torch.Tensor], torch.Tensor],
                       start: threading.Barrier, seed: int, rounds: int, batch: Callable[[int], int],
                       errors: list[BaseException], wrong: list[int], calls: list[int] | None = None) -> None:
    """One calling thread: compare each answer with ``step``; stop at the runner's close (a hal error)."""
    gen = torch.Generator().manual_seed(seed)
    start.wait()
    for i in range(rounds):
        x = torch.randn(batch(i), 32, generator=gen)
        try:
            y = runner(x=x)
        except hal.InvalidStateError:
            return
        except BaseException as exc:  # noqa: BLE001 - anything else is a defect
            errors.append(exc)
            return
        if calls is not None:
            calls[0] += 1
        if not torch.allclose(y, step(x), rtol=1e-4, atol=1e-4):
            wrong.append(i)


def test_close_racing_calls_gives_hal_errors_only(be: hal.Backend) -> None:
    w = torch.randn(32, 32)
    runner = graphkit.GraphRunner(lambda x: x @ w, sizes=[1, 2, 4, 8], backend=be, progress=False, on_demand=True)
    runner.capture(x=torch.zeros(8, 32))
    errors: list[BaseException] = []
    wrong: list[int] = []
    start = threading.Barrier(5)

    def caller(seed: int) -> None:
        _call_until_closed(runner, lambda x: x @ w, start, seed, 200, lambda i: 1 + i % 8, errors, wrong)

    threads = [threading.Thread(target=caller, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    start.wait()
    runner.close()
    for t in threads:
        t.join()
    assert not errors, errors
    assert not wrong
    with pytest.raises(hal.InvalidStateError, match="closed"):
        runner(x=torch.zeros(2, 32))
    with pytest.raises(hal.InvalidStateError, match="closed"):
        runner.capture(x=torch.zeros(8, 32))
    assert be.live.graphs == 0


@pytest.mark.parametrize("pool", ["vmm", "shared"])
def test_eight_threads_call_capture_and_release_while_close_arrives(be: hal.Backend, pool: str) -> None:
    """Six callers capturing on demand, two releasing sizes; close() arrives mid-way."""
    w = torch.randn(32, 32)
    runner = graphkit.GraphRunner(lambda x: torch.tanh(x @ w), sizes=[1, 2, 4, 8, 16], backend=be, kind=pool,
                                  progress=False, on_demand=True)
    runner.capture(x=torch.zeros(16, 32))
    errors: list[BaseException] = []
    wrong: list[int] = []
    calls = [0]
    start = threading.Barrier(9)

    def caller(seed: int) -> None:
        _call_until_closed(runner, lambda x: torch.tanh(x @ w), start, seed, 400,
                           lambda i: 1 + (i * 7 + seed) % 16, errors, wrong, calls)

    def releaser(seed: int) -> None:
        rng = random.Random(seed)
        start.wait()
        for _ in range(200):
            try:
                runner.release_size(rng.choice([1, 2, 4, 8, 16]))
            except hal.InvalidArgumentError:
                continue  # not captured (yet, or any more)
            except hal.InvalidStateError:
                return
            except BaseException as exc:  # noqa: BLE001 - anything else is a defect
                errors.append(exc)
                return

    threads = [threading.Thread(target=caller, args=(s,)) for s in range(6)]
    threads += [threading.Thread(target=releaser, args=(s,)) for s in range(2)]
    for t in threads:
        t.start()
    start.wait()
    while calls[0] < 60 and any(t.is_alive() for t in threads):
        time.sleep(0.005)
    runner.close()  # mid-way: callers and releasers are still going
    for t in threads:
        t.join()
    assert not errors, errors
    assert not wrong
    assert calls[0] >= 60
    assert be.live.graphs == 0 and be.live.pools == 0 and be.live.mappings == 0


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


@pytest.mark.parametrize("sizes", [[True, 2], [1.5], [0], [], ["4"]])
def test_sizes_must_be_positive_ints(be: hal.Backend, sizes: list) -> None:
    with pytest.raises(hal.InvalidArgumentError, match="sizes="):
        graphkit.GraphRunner(lambda x: x, sizes=sizes, backend=be, progress=False)


VIEW_AFTER_CLOSE = """
import torch, hal, graphkit
be = hal.get_backend("fake", granularity=1 << 16)
runner = graphkit.GraphRunner(lambda x: x * 2, sizes=[4, 8], backend=be, outputs="view", progress=False)
runner.capture(x=torch.zeros(8, 16))
held = runner(x=torch.ones(3, 16))
runner.close()
total = float(held.sum())  # after close: garbage, but no fault
print("read", total)
del held
be.close()
assert be.live.zero, be.live
print("clean")
"""


def test_reading_a_view_output_after_close_does_not_fault() -> None:
    """In a process of its own: before the fix, this read was a segmentation fault (D13)."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", VIEW_AFTER_CLOSE], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "read" in proc.stdout and "clean" in proc.stdout


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
