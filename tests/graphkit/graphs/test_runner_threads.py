"""GraphRunner under concurrency: calls from several threads, and captures, releases and calls racing close()."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable

import pytest
import torch

import graphkit
import hal
from tests.graphkit.graphs.test_runner import close_to, mlp


def test_two_threads_get_correct_outputs(graph_backend: hal.Backend) -> None:
    be = graph_backend
    dev = be.torch_device()
    step = mlp(dev, width=32)
    runner = graphkit.GraphRunner(step, sizes=[1, 2, 4, 8, 16], backend=be, progress=False)
    runner.capture(x=torch.zeros(16, 32, device=dev))
    failures: list[str] = []

    def work(seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for i in range(200):
            n = int(torch.randint(1, 17, (1,), generator=gen))
            x = torch.randn(n, 32, generator=gen).to(dev)
            out = runner(x=x)
            if out.shape != (n, 32) or not close_to(out, step(x)):
                failures.append(f"thread {seed} call {i} batch {n}")

    threads = [threading.Thread(target=work, args=(s,)) for s in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures[:5]
    runner.close()


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
