"""Graphs over vmm pools through hal and graphkit, on ``fake`` and (where present) ``cuda``.

Every capture gets a fresh virtual space of one SharedVMMAllocator and a
fresh pool over it; all spaces share the same physical chunks.
"""

from __future__ import annotations

import gc
import logging
import random
from dataclasses import dataclass
from typing import Any

import pytest
import torch

import hal
from graphkit import SharedVMMAllocator

HIDDEN = 256
SIZES = [1, 4, 16, 64]
BIG = [256, 2048, 8192]


def step(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.silu(x @ w1) @ w2 + x


@dataclass
class Capture:
    graph: Any
    pool: Any
    space: int
    out: torch.Tensor | None


class Bench:
    """Weights, static inputs, a capture stream and the allocator of one test."""

    def __init__(self, be: hal.Backend, sizes: list[int] = SIZES, **allocator_options: Any) -> None:
        self.be = be
        self.dev = be.torch_device()
        gen = torch.Generator(device="cpu").manual_seed(0)
        self.w1 = (torch.randn(HIDDEN, 2 * HIDDEN, generator=gen) / HIDDEN ** 0.5).to(self.dev)
        self.w2 = (torch.randn(2 * HIDDEN, HIDDEN, generator=gen) / HIDDEN ** 0.5).to(self.dev)
        self.x = {n: torch.randn(n, HIDDEN, generator=gen).to(self.dev) for n in sizes}
        self.stream = be.create_stream()
        allocator_options.setdefault("reserve_bytes", 64 << 20)
        self.alloc = SharedVMMAllocator(be, **allocator_options)
        self.captures: dict[int, Capture] = {}
        self.warm_up(sizes)

    def warm_up(self, sizes: list[int]) -> None:
        """Run every size once on the current stream, as an engine warms up (hal prepares the capture stream)."""
        with torch.no_grad():
            for n in sizes:
                step(self.x[n], self.w1, self.w2)
        self.be.synchronize(None)

    def capture(self, n: int) -> Capture:
        be = self.be
        space = self.alloc.switch_to_new_virtual_space()
        pool = be.create_pool(*self.alloc.pool_callbacks(space))
        graph = be.create_graph()
        try:
            with torch.no_grad(), be.capture(graph, pool, self.stream):
                out = step(self.x[n], self.w1, self.w2)
        except BaseException:
            be.release_graph(graph)
            be.release_pool(pool)
            self.alloc.release_virtual_space(space)
            raise
        self.captures[n] = cap = Capture(graph, pool, space, out)
        return cap

    def check(self, n: int) -> float:
        """Replay graph ``n`` on fresh inputs; return the relative error against eager."""
        self.x[n].copy_(torch.randn_like(self.x[n]))
        self.be.replay(self.captures[n].graph)
        out = self.captures[n].out.clone()
        with torch.no_grad():
            ref = step(self.x[n], self.w1, self.w2)
        return float((out - ref).norm() / ref.norm())

    def release(self, n: int) -> None:
        cap = self.captures.pop(n)
        cap.out = None
        self.be.release_graph(cap.graph)
        self.be.release_pool(cap.pool)
        self.alloc.release_virtual_space(cap.space)

    def close(self) -> None:
        self.be.synchronize(None)
        for n in list(self.captures):
            self.release(n)
        self.alloc.close()


def _settle(be: hal.Backend) -> None:
    """Wait for the device and give torch's cached, unused blocks back to the driver.

    Garbage of earlier tests (an exception's traceback holding its tensors) is collected first: freed later,
    in the middle of a measurement, it would give memory back there.
    """
    gc.collect()
    be.synchronize(None)
    if be.name == "cuda":
        torch.cuda.empty_cache()


def _overlaps(block: tuple[int, int], t: torch.Tensor) -> bool:
    s = t.untyped_storage()
    return block[0] < s.data_ptr() + s.nbytes() and s.data_ptr() < block[0] + block[1]


def test_vmm_captures_share_physical_memory(graph_backend: hal.Backend) -> None:
    bench = Bench(graph_backend)
    try:
        for n in sorted(SIZES, reverse=True):
            cap = bench.capture(n)
            leftovers = [b for b in graph_backend.pool_active_blocks(cap.pool) if not _overlaps(b, cap.out)]
            assert leftovers == [], f"memory other than the output outlived the capture of {n}"
            assert cap.out.device == bench.dev
        stats = bench.alloc.stats()
        g = graph_backend.granularity
        assert stats.num_virtual_spaces == len(SIZES)
        assert bench.alloc.physical_bytes == -(-max(stats.high_water.values()) // g) * g
        assert sum(stats.high_water.values()) > max(stats.high_water.values())
        order = SIZES * 3
        random.Random(1).shuffle(order)
        for n in order:
            assert bench.check(n) < 1e-4, f"size {n}"
    finally:
        bench.close()


def test_outputs_of_a_vmm_pool_are_valid_until_the_next_replay(graph_backend: hal.Backend) -> None:
    bench = Bench(graph_backend, sizes=[16, 64])
    try:
        small, large = bench.capture(16), bench.capture(64)
        graph_backend.replay(small.graph)
        kept = small.out.clone()
        graph_backend.replay(large.graph)  # overwrites the physical bytes under small.out
        graph_backend.synchronize(None)
        assert not torch.equal(small.out, kept), "graphs of one allocator should share memory"
    finally:
        bench.close()


def test_capture_out_of_memory_leaves_everything_usable(graph_backend: hal.Backend,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    bench = Bench(graph_backend, sizes=[1, 4096], max_physical_bytes=4 << 20)
    try:
        small = bench.capture(1)
        assert bench.check(1) < 1e-4
        before = bench.alloc.physical_bytes
        with caplog.at_level(logging.ERROR):
            with pytest.raises((torch.OutOfMemoryError, hal.DeviceOutOfMemoryError)) as info:
                bench.capture(4096)
        assert "max_physical_bytes" in caplog.text, "the allocator's reason is logged"
        if graph_backend.name == "cuda":
            assert isinstance(info.value, torch.OutOfMemoryError)
            assert any("no segment" in note for note in getattr(info.value, "__notes__", []))
        assert bench.alloc.physical_bytes == before and bench.alloc.num_virtual_spaces == 1
        for _ in range(3):
            assert bench.check(1) < 1e-4, "the earlier graph still replays right"
        bench.release(1)
        bench.capture(1)  # the allocator takes new captures
        assert bench.check(1) < 1e-4
        assert small.graph is not bench.captures[1].graph
    finally:
        bench.close()


def test_memory_returns_after_teardown(graph_backend: hal.Backend) -> None:
    be = graph_backend
    bench = Bench(be)
    # the capture stream's library workspaces (made by hal before its first capture) belong to the stream,
    # for the process's life, not to the graphs: made before the count starts
    be.prepare_capture_stream(bench.stream)
    _settle(be)
    before = be.mem_info().used
    try:
        for n in SIZES:
            bench.capture(n)
        for n in SIZES:
            assert bench.check(n) < 1e-4
        assert be.mem_info().used > before
    finally:
        bench.close()
    _settle(be)
    after = be.mem_info().used
    assert after - before <= be.granularity, f"{after - before} bytes did not come back"
    assert be.live.pools == 0 and be.live.graphs == 0 and be.live.chunks == 0


def test_capture_of_a_host_sync_raises_capture_error(graph_backend: hal.Backend) -> None:
    bench = Bench(graph_backend, sizes=[4])
    try:
        space = bench.alloc.switch_to_new_virtual_space()
        pool = graph_backend.create_pool(*bench.alloc.pool_callbacks(space))
        graph = graph_backend.create_graph()
        with pytest.raises(hal.CaptureError):
            with torch.no_grad(), graph_backend.capture(graph, pool, bench.stream):
                y = step(bench.x[4], bench.w1, bench.w2)
                float(y.sum())
        del y  # it lives in the space: drop it before the space goes (its addresses get reused)
        graph_backend.release_graph(graph)
        if graph_backend.name == "cuda":  # the failed capture gave back its reference on the pool
            assert pool.mempool.use_count() == 1
        graph_backend.release_pool(pool)
        bench.alloc.release_virtual_space(space)
        bench.capture(4)
        assert bench.check(4) < 1e-4
    finally:
        bench.close()


def test_pool_active_blocks_finds_a_tensor_born_in_the_capture(graph_backend: hal.Backend) -> None:
    bench = Bench(graph_backend, sizes=[4])
    be = graph_backend
    space = bench.alloc.switch_to_new_virtual_space()
    pool = be.create_pool(*bench.alloc.pool_callbacks(space))
    graph = be.create_graph()
    try:
        with torch.no_grad(), be.capture(graph, pool, bench.stream):
            cache = torch.zeros(1000, device=bench.dev)  # outlives the capture: a "workspace"
            out = step(bench.x[4], bench.w1, bench.w2) + cache[:HIDDEN]
        blocks = be.pool_active_blocks(pool)
        assert any(_overlaps(b, cache) for b in blocks)
        assert any(_overlaps(b, out) for b in blocks)
        del cache, out
    finally:
        be.release_graph(graph)
        be.release_pool(pool)
        bench.alloc.release_virtual_space(space)
        bench.close()


def test_device_pool_shared_by_captures(graph_backend: hal.Backend) -> None:
    be = graph_backend
    bench = Bench(be, sizes=[4, 16])
    pool = be.create_pool()
    graphs = []
    try:
        for n in (16, 4):
            g = be.create_graph()
            with torch.no_grad(), be.capture(g, pool, bench.stream):
                out = step(bench.x[n], bench.w1, bench.w2)
            graphs.append((n, g, out))
        for n, g, out in graphs:
            bench.x[n].copy_(torch.randn_like(bench.x[n]))
            be.replay(g)
            ref = step(bench.x[n], bench.w1, bench.w2)
            assert float((out - ref).norm() / ref.norm()) < 1e-4
    finally:
        for _, g, _ in graphs:
            be.release_graph(g)
        graphs.clear()
        be.release_pool(pool)
        bench.close()


def test_a_lazy_graph_replays_as_an_eager_one(graph_backend: hal.Backend) -> None:
    be = graph_backend
    if not be.supports("lazy_graphs"):
        pytest.skip(f"{be.name} has no lazy graphs here")
    bench = Bench(be, sizes=[16])
    graphs, outs = {}, {}
    try:
        for lazy in (False, True):
            graphs[lazy] = be.create_graph(lazy=lazy)
            with torch.no_grad(), be.capture(graphs[lazy], None, bench.stream):
                outs[lazy] = step(bench.x[16], bench.w1, bench.w2)
        bench.x[16].copy_(torch.randn_like(bench.x[16]))
        for _ in range(2):  # the first replay of the lazy one instantiates it
            for graph in graphs.values():
                be.replay(graph)
        be.synchronize()
        ref = step(bench.x[16], bench.w1, bench.w2)
        assert torch.equal(outs[True], outs[False])
        assert float((outs[True] - ref).norm() / ref.norm()) < 1e-4
    finally:
        for graph in graphs.values():
            be.release_graph(graph)
        bench.close()


def test_one_executable_graph_updated_across_captures_of_one_topology(graph_backend: hal.Backend) -> None:
    be = graph_backend
    if not be.supports("graph_update"):
        pytest.skip(f"{be.name} cannot update graphs here")
    stream = be.create_stream()
    device = be.torch_device()
    xs = [torch.randn(64, generator=torch.Generator().manual_seed(k)).to(device) for k in range(4)]
    graphs, outs = [], []
    try:
        for k, x in enumerate(xs):  # elementwise kernels on tensors of one size: one topology
            graphs.append(be.create_graph(lazy=k > 0))
            with torch.no_grad(), be.capture(graphs[-1], None, stream):
                outs.append(torch.sigmoid(x * 3 - 1) + x)
        for k in (3, 1, 2, 3):  # (graph 0's own work is gone after the first update: it is no lazy source)
            be.update_graph(graphs[0], graphs[k])
            be.replay(graphs[0])
            be.synchronize()
            torch.testing.assert_close(outs[k], torch.sigmoid(xs[k] * 3 - 1) + xs[k])
            xs[k].add_(1)  # the next replay of this capture sees new inputs
    finally:
        for graph in graphs:
            be.release_graph(graph)


@pytest.mark.cuda
def test_cuda_custom_pool_refused_under_cuda_malloc_async() -> None:
    import os
    import subprocess
    import sys

    code = (
        "import hal, pytest\n"
        "be = hal.get_backend('cuda')\n"
        "assert 'custom_pool' not in be.capabilities, be.capabilities\n"
        "try:\n"
        "    be.plugin.create_pool(lambda n: 0, lambda p, n: None)\n"
        "except hal.UnsupportedError as exc:\n"
        "    print('refused:', exc)\n"
        "be.close()\n"
    )
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="backend:cudaMallocAsync",
               PYTORCH_ALLOC_CONF="backend:cudaMallocAsync")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "refused:" in out.stdout and "cudaMallocAsync" in out.stdout


@pytest.mark.cuda
@pytest.mark.multi_gpu
def test_cuda_capture_on_device_1_while_device_0_is_current() -> None:
    be0, be1 = hal.get_backend("cuda", device=0), hal.get_backend("cuda", device=1)
    try:
        with torch.cuda.device(0):
            bench = Bench(be1, sizes=BIG, reserve_bytes=256 << 20)
            for be in (be0, be1):  # torch.cuda.graph empties the cache: start from an empty one
                with torch.cuda.device(be.device):
                    _settle(be)
            used0, used1 = be0.mem_info().used, be1.mem_info().used
            cached1 = torch.cuda.memory_reserved(1)
            for n in BIG:
                cap = bench.capture(n)
                assert cap.out.device == torch.device("cuda", 1)
            assert torch.cuda.current_device() == 0
            grew1 = be1.mem_info().used - used1
            grew0 = be0.mem_info().used - used0
            assert grew1 >= bench.alloc.physical_bytes, "the chunks live on device 1"
            assert grew0 < bench.alloc.physical_bytes, "device 0 did not get them"
            for n in BIG:
                assert bench.check(n) < 1e-4
            bench.close()
            torch.cuda.empty_cache()
            # what torch's caching allocator still holds on device 1 is torch's, not graphkit's: the BLAS
            # workspaces hal made on the capture stream before the first capture stay for the process, as
            # torch keeps the ones it makes itself
            kept = torch.cuda.memory_reserved(1) - cached1
            grown = be1.mem_info().used - used1
            assert grown - kept <= be1.granularity, (grown, kept, be1.stream_state_sizes())
    finally:
        be1.close()
        be0.close()


def test_private_pool_capture_after_a_failed_one(graph_backend: hal.Backend) -> None:
    be = graph_backend
    bench = Bench(be, sizes=[4])
    graphs = [be.create_graph(), be.create_graph()]
    try:
        with pytest.raises(hal.CaptureError):
            with torch.no_grad(), be.capture(graphs[0], None, bench.stream):
                float(step(bench.x[4], bench.w1, bench.w2).sum())
        with torch.no_grad(), be.capture(graphs[1], None, bench.stream):
            out = step(bench.x[4], bench.w1, bench.w2)
        for _ in range(2):
            bench.x[4].copy_(torch.randn_like(bench.x[4]))
            be.replay(graphs[1])
            ref = step(bench.x[4], bench.w1, bench.w2)
            assert float((out - ref).norm() / ref.norm()) < 1e-4
        del out
    finally:
        for g in graphs:
            be.release_graph(g)
        bench.close()


@pytest.mark.parametrize("mode", [None, "global", "thread_local", "relaxed"])
def test_capture_error_modes(graph_backend: hal.Backend, mode: str | None) -> None:
    bench = Bench(graph_backend, sizes=[16])
    try:
        space = bench.alloc.switch_to_new_virtual_space()
        pool = graph_backend.create_pool(*bench.alloc.pool_callbacks(space))
        graph = graph_backend.create_graph()
        with torch.no_grad(), graph_backend.capture(graph, pool, bench.stream, capture_error_mode=mode):
            out = step(bench.x[16], bench.w1, bench.w2)
        bench.captures[16] = Capture(graph, pool, space, out)
        del out
        assert bench.check(16) < 1e-4
    finally:
        bench.close()
