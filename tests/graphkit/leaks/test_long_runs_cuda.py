"""Soak on an NVIDIA GPU: 1,000 capture/replay/release cycles with device memory and host RSS flat."""

from __future__ import annotations

import gc
import resource

import pytest
import torch

import graphkit
import hal

pytestmark = [pytest.mark.cuda, pytest.mark.slow]
MIB = 1 << 20
CYCLES = 1_000


def _rss() -> int:
    """Resident set size of this process now (bytes), from /proc."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _sample(be: hal.Backend) -> tuple[int, int]:
    """Device memory in use and host RSS, after everything that can be given back was."""
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    return be.mem_info().used, _rss()


@pytest.fixture
def be():
    backend = hal.get_backend("cuda")
    yield backend
    torch.cuda.synchronize()
    gc.collect()
    backend.close()


def test_a_thousand_capture_replay_release_cycles_grow_nothing(be: hal.Backend) -> None:
    w = torch.randn(512, 512, device="cuda") / 16
    x = torch.randn(64, 512, device="cuda")

    def step(t: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(t @ w) + t

    pools = graphkit.GraphPools(be)
    step(x)  # an engine's warm-up, on its own stream
    samples: list[tuple[int, int]] = []
    for i in range(CYCLES):
        n = (8, 64, 1, 32)[i % 4]
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pools.pool(i)):
            out = step(x[:n])
        graph.replay()
        if i % 97 == 0:
            torch.testing.assert_close(out, step(x[:n]))
        graph.reset()
        del graph, out
        pools.release(i)
        if i in (99, CYCLES - 1):  # after a warm first hundred, and at the end
            samples.append(_sample(be))
    (dev0, rss0), (dev1, rss1) = samples
    assert dev1 - dev0 <= 4 * MIB, f"device memory grew by {(dev1 - dev0) / MIB:.1f} MiB over {CYCLES - 100} cycles"
    assert rss1 - rss0 <= 32 * MIB, f"host RSS grew by {(rss1 - rss0) / MIB:.1f} MiB over {CYCLES - 100} cycles"
    report = pools.report()
    assert not report.keys
    pools.close()
    assert be.live.graphs == 0


def test_a_thousand_runner_cycles_grow_nothing(be: hal.Backend) -> None:
    """The same through GraphRunner: capture on demand, replay, release the size, again."""
    w = torch.randn(256, 256, device="cuda") / 16
    runner = graphkit.GraphRunner(lambda x: torch.tanh(x @ w), sizes=[1, 4, 16], backend=be, progress=False,
                                  on_demand=True)
    runner.capture(x=torch.zeros(16, 256, device="cuda"))
    samples: list[tuple[int, int]] = []
    # every on-demand capture snapshots its pool: pool ids pass 256 (see torch_compat.memory_snapshot)
    for i in range(CYCLES):
        x = torch.randn(1 + i % 16, 256, device="cuda")
        torch.testing.assert_close(runner(x=x), torch.tanh(x @ w))
        runner.release_size(runner.bucket_for(x.shape[0]))
        if i in (99, CYCLES - 1):
            samples.append(_sample(be))
    (dev0, rss0), (dev1, rss1) = samples
    assert dev1 - dev0 <= 4 * MIB, f"device memory grew by {(dev1 - dev0) / MIB:.1f} MiB"
    assert rss1 - rss0 <= 32 * MIB, f"host RSS grew by {(rss1 - rss0) / MIB:.1f} MiB"
    runner.close()
    assert be.live.graphs == 0
