"""The graph half of the conformance suite: streams, pools, capture, replay, routing and release.

Each class names the capabilities it needs (see :data:`hal.api.CAPABILITIES`);
on a backend that does not declare one of them, its tests skip with a reason
that names the backend, the missing capability and what the tests do with it
(a vmm-only plugin skips them all). The tests run small torch work
(``x * 2 + 1``, and functions with constants, in-place and ``out=`` ops and
views, compared with their eager results) on the backend's ``torch_device()``,
so they need torch. ``--hal-half graph`` runs this half alone.

They come with ``from hal.testing.suite import *`` like the vmm half.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import pytest

import hal
from hal.types import Route, round_up

__all__ = [
    "TestStreams",
    "TestPools",
    "TestCaptureReplay",
    "TestCapturedWork",
    "TestCustomPools",
    "TestCaptureRouting",
    "TestUsePool",
    "TestLazyGraphs",
    "TestGraphUpdate",
    "TestTensorAt",
    "TestGraphLifecycle",
    "TestUnmapAfterQueuedWork",
]

N = 1024  # elements of the test tensors
QUEUED_BYTES = 16 << 20  # memory the queued-work tests write: enough that a device is still at it when the host goes on
QUEUED_PASSES = 16  # passes of the replay over it
SEGMENT_SPACE = 64 << 20  # address space the callback pools of these tests map chunks into


def settle(be: hal.Backend) -> None:
    """Wait for all work of the device, then collect what Python dropped."""
    be.synchronize(None)
    gc.collect()


def full(be: hal.Backend, value: float) -> Any:
    """``N`` float32 elements of ``value`` on the backend's device, made outside any capture."""
    import torch

    t = torch.full((N,), value, dtype=torch.float32, device=be.torch_device())
    be.synchronize(None)
    return t


def equals(t: Any, value: float) -> bool:
    """Every element of ``t`` (read on the host after a device-wide wait) is ``value``."""
    import torch

    return bool(torch.equal(t.cpu(), torch.full(t.shape, value, dtype=t.dtype)))


def step(x: Any) -> Any:
    """The captured work: an intermediate (``x * 2``) and an output."""
    return x * 2 + 1


def captured(be: hal.Backend, x: Any, pool: Any = None, stream: Any = None,
             capture_error_mode: str | None = None) -> tuple[Any, Any]:
    """Warm ``step`` up on a capture stream, capture it into a new graph; return the graph and the output."""
    stream = stream if stream is not None else be.create_stream()
    with be.use_stream(stream):
        step(x)
    be.synchronize(stream)
    graph = be.create_graph()
    with be.capture(graph, pool, stream, capture_error_mode=capture_error_mode):
        y = step(x)
    return graph, y


def replay_and_wait(be: hal.Backend, graph: Any) -> None:
    """Replay ``graph`` after the work queued before it, and wait until the replay is done."""
    be.synchronize(None)
    be.replay(graph)
    be.synchronize(None)


def inside(blocks: list[tuple[int, int]], t: Any) -> bool:
    """``t``'s storage lies inside one of ``blocks``."""
    s = t.untyped_storage()
    return any(addr <= s.data_ptr() and s.data_ptr() + s.nbytes() <= addr + size for addr, size in blocks)


def overlaps(block: tuple[int, int], t: Any) -> bool:
    s = t.untyped_storage()
    return block[0] < s.data_ptr() + s.nbytes() and s.data_ptr() < block[0] + block[1]


class Segments:
    """``alloc``/``free`` callbacks that map a fresh chunk of the backend under test per segment.

    What graphkit's allocator does, in small: one reservation, a chunk
    created and mapped for each segment asked for, unmapped and released
    when it is freed. Records every call; never raises into the framework.
    """

    def __init__(self, be: hal.Backend, space: int = SEGMENT_SPACE) -> None:
        self.be = be
        self.size = round_up(space, be.granularity)
        self.base = be.create_vir_ptr(self.size)
        self.cursor = 0
        self.live: dict[int, tuple[int, Any]] = {}  # address -> (mapped size, handle)
        self.allocs: dict[int, int] = {}  # address -> nbytes asked for
        self.frees: dict[int, int] = {}  # address -> nbytes given back
        self.errors: list[str] = []
        self.refuse = False  # alloc returns 0 (out of memory) while set

    def alloc(self, nbytes: int) -> int:
        size = round_up(nbytes, self.be.granularity)
        if self.refuse or self.cursor + size > self.size:
            return 0
        ptr = self.base + self.cursor
        try:
            handle = self.be.create_phy_mem_handle(size)
            self.be.map(ptr, size, handle)
        except hal.HalError as exc:
            self.errors.append(f"alloc({nbytes}): {exc}")
            return 0
        self.cursor += size
        self.live[ptr] = (size, handle)
        self.allocs[ptr] = nbytes
        return ptr

    def free(self, ptr: int, nbytes: int) -> None:
        try:
            if ptr in self.frees:
                raise AssertionError(f"free({ptr:#x}) called twice")
            if self.allocs.get(ptr) != nbytes:
                raise AssertionError(f"free({ptr:#x}, {nbytes}) does not match an alloc ({self.allocs.get(ptr)})")
            self.frees[ptr] = nbytes
            size, handle = self.live.pop(ptr)
            self.be.unmap(ptr, size)
            self.be.release_phy_mem_handle(handle)
        except Exception as exc:  # noqa: BLE001 - a callback must never raise into the framework
            self.errors.append(f"free({ptr:#x}, {nbytes}): {type(exc).__name__}: {exc}")

    def holds(self, t: Any) -> bool:
        """``t``'s storage lies in memory these callbacks handed out."""
        return inside([(p, s) for p, (s, _) in self.live.items()], t)

    def close(self) -> None:
        """Release what is still mapped (a test that failed half-way) and the reservation."""
        for ptr, (size, handle) in list(self.live.items()):
            self.be.unmap(ptr, size)
            self.be.release_phy_mem_handle(handle)
        self.live.clear()
        self.be.release_vir_ptr(self.base, self.size)


#: What the tests of a class that needs a capability do with it (the second half of a skip reason).
WHAT_NEEDS = {
    "graphs": "these tests capture and replay torch work on the backend's device",
    "custom_pool": "these tests capture into pools whose segments come from allocator callbacks",
    "capture_routing": "these tests route captures to the pool a router chooses",
    "use_pool": "these tests allocate torch tensors inside use_pool",
    "graph_addresses": "these tests ask a captured graph which addresses its replay touches",
    "lazy_graphs": "these tests capture graphs instantiated at their first replay",
    "graph_update": "these tests replay lazy captures through one graph updated to each",
}


class _NeedsCapabilities:
    """Skips every test of the class on a backend that lacks one of :attr:`capabilities`."""

    capabilities: ClassVar[tuple[str, ...]] = ("graphs",)

    @pytest.fixture(autouse=True)
    def _capable(self, hal_backend: hal.Backend) -> None:
        missing = [c for c in self.capabilities if not hal_backend.supports(c)]
        if missing:
            has = ", ".join(sorted(hal_backend.capabilities)) or "none"
            pytest.skip(f"{hal_backend.name} lacks capability {', '.join(missing)} (it declares: {has}); "
                        f"{WHAT_NEEDS[missing[0]]}")
        pytest.importorskip("torch", reason="the graph tests run torch work on the backend's device")

    @pytest.fixture
    def segments(self, hal_backend: hal.Backend) -> Iterator[Segments]:
        seg = Segments(hal_backend)
        yield seg
        if not hal_backend.closed:
            settle(hal_backend)
            seg.close()


class TestStreams(_NeedsCapabilities):
    """Streams run work, and synchronize waits for it."""

    def test_work_on_a_new_stream(self, hal_backend: hal.Backend) -> None:
        be = hal_backend
        x = full(be, 1.0)
        stream = be.create_stream()
        assert stream is not None
        with be.use_stream(stream):
            y = x + 1
        be.synchronize(stream)
        be.synchronize(None)
        assert equals(y, 2.0)

    def test_current_and_default_capture_streams(self, hal_backend: hal.Backend) -> None:
        be = hal_backend
        assert be.current_stream() is not None
        assert be.default_capture_stream() is not None


class TestPools(_NeedsCapabilities):
    """Pools drawn from the device's own allocator."""

    def test_a_new_pool_has_no_blocks_and_is_released(self, hal_backend: hal.Backend) -> None:
        be = hal_backend
        pool = be.create_pool()
        assert be.live.pools == 1
        assert be.pool_active_blocks(pool) == []
        be.release_pool(pool)
        assert be.live.pools == 0

    def test_one_callback_alone_is_refused(self, hal_backend: hal.Backend) -> None:
        with pytest.raises(hal.InvalidArgumentError) as info:
            hal_backend.create_pool(lambda n: 0, None)
        assert info.value.backend == hal_backend.name and info.value.call == "create_pool"
        assert hal_backend.live.pools == 0


class TestCaptureReplay(_NeedsCapabilities):
    """Capture records the work once; replay reruns it on new input values, without Python."""

    def test_replay_recomputes_from_the_inputs(self, hal_backend: hal.Backend) -> None:
        be = hal_backend
        x = full(be, 1.0)
        calls = []

        def counted(t: Any) -> Any:
            calls.append(1)
            return step(t)

        stream = be.create_stream()
        graph = be.create_graph()
        be.synchronize(None)
        with be.capture(graph, None, stream):
            y = counted(x)
        assert be.live.graphs == 1 and len(calls) == 1
        x.fill_(3.0)
        replay_and_wait(be, graph)
        assert equals(y, 7.0), "replay did not recompute the output from the new input"
        assert len(calls) == 1, "replay ran the Python function again"
        x.fill_(-1.0)
        replay_and_wait(be, graph)
        assert equals(y, -1.0)
        be.release_graph(graph)
        assert be.live.graphs == 0

    def test_graphs_share_a_device_pool(self, hal_backend: hal.Backend) -> None:
        be = hal_backend
        pool = be.create_pool()
        stream = be.create_stream()
        x1, x2 = full(be, 1.0), full(be, 2.0)
        g1, y1 = captured(be, x1, pool, stream)
        g2, y2 = captured(be, x2, pool, stream)
        be.replay(g1)
        be.replay(g2)
        be.synchronize(None)
        assert equals(y1, 3.0) and equals(y2, 5.0), "two live outputs of one pool overlap"
        be.release_graph(g1)
        be.release_graph(g2)
        del y1, y2
        settle(be)
        be.release_pool(pool)

    def test_pool_active_blocks_lists_the_outputs_only(self, hal_backend: hal.Backend) -> None:
        be = hal_backend
        pool = be.create_pool()
        graph, y = captured(be, full(be, 1.0), pool)
        blocks = be.pool_active_blocks(pool)
        assert all(isinstance(a, int) and isinstance(n, int) and n > 0 for a, n in blocks), blocks
        assert inside(blocks, y), "the output's memory is not an active block of its pool"
        assert all(overlaps(b, y) for b in blocks), f"blocks other than the output outlived the capture: {blocks}"
        del y
        settle(be)
        assert be.pool_active_blocks(pool) == [], "the output's block stayed active after it died"
        be.release_graph(graph)
        be.release_pool(pool)

    @pytest.mark.parametrize("mode", ["global", "thread_local", "relaxed"])
    def test_every_capture_error_mode(self, hal_backend: hal.Backend, mode: str) -> None:
        be = hal_backend
        x = full(be, 1.0)
        graph, y = captured(be, x, capture_error_mode=mode)
        x.fill_(4.0)
        replay_and_wait(be, graph)
        assert equals(y, 9.0)
        be.release_graph(graph)

    def test_an_unknown_capture_error_mode_is_refused(self, hal_backend: hal.Backend) -> None:
        be = hal_backend
        graph = be.create_graph()
        with pytest.raises(hal.InvalidArgumentError) as info:
            be.capture(graph, None, be.create_stream(), capture_error_mode="strict")
        assert info.value.call == "capture" and "capture_error_mode" in str(info.value)
        be.release_graph(graph)

    def test_a_host_sync_inside_a_capture_raises_and_the_backend_stays_usable(self, hal_backend: hal.Backend) -> None:
        be = hal_backend
        x = full(be, 1.0)
        stream = be.create_stream()
        graph = be.create_graph()
        with pytest.raises(hal.CaptureError) as info:
            with be.capture(graph, None, stream):
                (x * 2).sum().item()
        assert info.value.backend and info.value.call == "capture"
        be.release_graph(graph)
        graph, y = captured(be, x, stream=stream)  # the next capture works
        replay_and_wait(be, graph)
        assert equals(y, 3.0)
        be.release_graph(graph)

    def test_a_graph_is_captured_once(self, hal_backend: hal.Backend) -> None:
        be = hal_backend
        graph, _ = captured(be, full(be, 1.0))
        with pytest.raises(hal.InvalidStateError):
            with be.capture(graph, None, be.create_stream()):
                pass
        be.release_graph(graph)

    def test_a_released_graph_refuses_to_replay(self, hal_backend: hal.Backend) -> None:
        be = hal_backend
        x = full(be, 1.0)
        graph, y = captured(be, x)
        replay_and_wait(be, graph)  # a capture need not run its work (a device graph does not): y holds 3 now
        assert equals(y, 3.0)
        be.release_graph(graph)
        x.fill_(5.0)
        with pytest.raises(hal.InvalidStateError) as info:
            be.replay(graph)
        assert info.value.call == "replay" and "released" in str(info.value)
        be.synchronize(None)
        assert equals(y, 3.0), "a replay of a released graph wrote its output"

    def test_a_graph_whose_pool_was_released_refuses_to_replay(self, hal_backend: hal.Backend) -> None:
        be = hal_backend
        pool = be.create_pool()
        graph, y = captured(be, full(be, 1.0), pool)
        del y
        settle(be)
        be.release_pool(pool)
        with pytest.raises(hal.InvalidStateError) as info:
            be.replay(graph)
        assert info.value.call == "replay" and "pool" in str(info.value) and "capture" in str(info.value)
        be.release_graph(graph)


M_PERTURB = -6  # glibc's mallopt parameter: fill memory given back by free() with a byte


@contextlib.contextmanager
def freed_host_memory_poisoned() -> Iterator[None]:
    """Inside the block, glibc's ``free()`` fills the heap memory it takes back with ``0xa5`` bytes.

    So a replay that reads a host tensor that died reads garbage whatever
    the allocator does with the memory next. Elsewhere (another C library)
    this does nothing.
    """
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        yield
        return
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    before = int(os.environ.get("MALLOC_PERTURB_", "0") or 0)
    mallopt(M_PERTURB, 0xA5)
    try:
        yield
    finally:
        mallopt(M_PERTURB, before)


def replays_like_eager(be: hal.Backend, work: Callable[..., tuple[Any, ...]], buffers: int = 0,
                       seeds: tuple[int, ...] = (1, 2)) -> None:
    """Capture ``work(x, *buffers)``, then replay it on new values of ``x`` and compare with eager ``work``.

    ``buffers`` are zeroed tensors made before the capture (outputs written
    with ``out=`` or ``copy_``); ``work`` returns the tensors to compare.
    Host memory freed during the check is filled with garbage (on glibc), and
    fresh tensors of garbage are made right before each replay, so a replay
    that reads memory it does not own (a tensor the capture made and
    dropped) reads garbage.
    """

    dev = be.torch_device()
    with freed_host_memory_poisoned() if dev.type == "cpu" else contextlib.nullcontext():
        _replays_like_eager(be, work, buffers, seeds)


def _replays_like_eager(be: hal.Backend, work: Callable[..., tuple[Any, ...]], buffers: int,
                        seeds: tuple[int, ...]) -> None:
    import torch

    dev = be.torch_device()

    def values(seed: int) -> Any:
        return torch.randint(-8, 8, (N,), generator=torch.Generator().manual_seed(seed)).float()

    x = values(0).to(dev)
    bufs = [torch.zeros(N, device=dev) for _ in range(buffers)]
    stream = be.create_stream()
    with be.use_stream(stream):
        work(x.clone(), *[b.clone() for b in bufs])
    be.synchronize(stream)
    graph = be.create_graph()
    with be.capture(graph, None, stream):
        outs = work(x, *bufs)
    settle(be)
    try:
        for seed in seeds:
            expected_bufs = [torch.zeros(N, device=dev) for _ in range(buffers)]
            expected = work(values(seed).to(dev), *expected_bufs)
            x.copy_(values(seed).to(dev))
            # the eager run just freed its own tensors, perhaps where the capture's were: overwrite them
            garbage = [torch.full((n,), float("nan"), device=dev) for n in (N,) * 64 + (N // 4, N // 2, 3) * 8]
            replay_and_wait(be, graph)
            del garbage
            for i, (got, want) in enumerate(zip((*outs, *bufs), (*expected, *expected_bufs), strict=True)):
                assert torch.equal(got.cpu(), want.cpu()), (
                    f"replay {seed}: result {i} differs from the eager run of the captured function "
                    f"(first values {got.flatten()[:4].tolist()} instead of {want.flatten()[:4].tolist()})")
    finally:
        be.release_graph(graph)


def constant_work(x: Any) -> tuple[Any, ...]:
    """Reads a constant made inside the captured function from Python data."""
    import torch

    c = torch.tensor([float(i % 7) - 3 for i in range(N)], device=x.device)
    return (x * c + 1,)


def in_place_work(x: Any, out: Any) -> tuple[Any, ...]:
    """In-place ops on an intermediate, on a view of it and into a buffer made before the capture."""
    t = x * 2
    t.add_(1)
    t.mul_(x)
    t[: N // 2].neg_()
    out.copy_(t)
    out.sub_(x)
    return (t,)


def out_variant_work(x: Any, a: Any, b: Any) -> tuple[Any, ...]:
    """``out=`` ops into buffers made before the capture and into an empty tensor made inside it."""
    import torch

    torch.mul(x, 3, out=a)
    torch.add(a, x, out=b)
    tmp = torch.empty_like(x)
    torch.sub(b, 1, out=tmp)
    torch.maximum(tmp, x, out=a)
    return (tmp,)


def view_work(x: Any) -> tuple[Any, ...]:
    """Views of an input and of intermediates: transposes, slices, strides, in-place view ops, writes through them."""
    side = int(N ** 0.5)
    m = x.view(side, side)
    t = m.t() * 2
    t[1:3].add_(m[0])
    s = t.reshape(-1)[::2]
    u = (m + 1).unsqueeze(0)
    u.squeeze_(0)
    d = u.diagonal()
    d.mul_(-1)
    return t, s, u, m.t()[::3, 1:]


class TestCapturedWork(_NeedsCapabilities):
    """Replays compute what the captured function computes: constants, in-place and out= ops, views."""

    def test_a_constant_made_inside_the_capture_replays_with_its_values(self, hal_backend: hal.Backend) -> None:
        if hal_backend.torch_device().type != "cpu":  # a host-to-device copy cannot be captured on a device
            pytest.skip(f"{hal_backend.name}: torch.tensor(data) inside a capture is a host-to-device copy, which "
                        "device graphs refuse; this test is for backends that record host work")
        replays_like_eager(hal_backend, constant_work)

    def test_in_place_ops_replay(self, hal_backend: hal.Backend) -> None:
        replays_like_eager(hal_backend, in_place_work, buffers=1)

    def test_out_variant_ops_replay(self, hal_backend: hal.Backend) -> None:
        replays_like_eager(hal_backend, out_variant_work, buffers=2)

    def test_views_replay(self, hal_backend: hal.Backend) -> None:
        replays_like_eager(hal_backend, view_work)


class TestCustomPools(_NeedsCapabilities):
    """Pools whose segments come from allocator callbacks (what graphkit's vmm pools are)."""

    capabilities = ("graphs", "custom_pool")

    def test_a_capture_draws_from_the_callbacks_and_release_gives_it_back(
        self, hal_backend: hal.Backend, segments: Segments
    ) -> None:
        be = hal_backend
        pool = be.create_pool(segments.alloc, segments.free)
        x = full(be, 1.0)
        graph, y = captured(be, x, pool)
        assert segments.allocs, "the capture never called alloc"
        assert segments.holds(y), "the output does not live in memory the callbacks handed out"
        x.fill_(3.0)
        replay_and_wait(be, graph)
        assert equals(y, 7.0)
        assert segments.frees == {}, "a segment was freed while its graph was alive"
        be.release_graph(graph)
        del y
        settle(be)
        be.release_pool(pool)
        settle(be)
        assert segments.errors == []
        assert segments.frees == segments.allocs, "release_pool did not give every segment back through free"

    def test_alloc_out_of_memory_fails_the_capture_not_the_process(
        self, hal_backend: hal.Backend, segments: Segments
    ) -> None:
        be = hal_backend
        segments.refuse = True
        pool = be.create_pool(segments.alloc, segments.free)
        x = full(be, 1.0)
        stream = be.create_stream()
        graph = be.create_graph()
        with pytest.raises(Exception) as info:  # the framework's out-of-memory error
            with be.capture(graph, pool, stream):
                step(x)
        assert "memory" in str(info.value).lower() or isinstance(info.value, MemoryError), info.value
        be.release_graph(graph)
        be.release_pool(pool)
        graph, y = captured(be, x, stream=stream)  # the backend still captures
        replay_and_wait(be, graph)
        assert equals(y, 3.0)
        be.release_graph(graph)


class TestCaptureRouting(_NeedsCapabilities):
    """route_captures: every capture started inside the block takes the pool its router chooses."""

    capabilities = ("graphs", "capture_routing")

    def test_captures_inside_the_block_take_the_routers_pool(self, hal_backend: hal.Backend) -> None:
        be = hal_backend
        pool = be.create_pool()
        events: list[Any] = []

        def router(graph: Any, requested: Any) -> Route:
            events.append("route")
            return Route(pool, on_end=lambda ok: events.append(("end", ok)),
                         on_release=lambda collected: events.append(("release", collected)))

        x = full(be, 1.0)
        with be.route_captures(router):
            graph, y = captured(be, x)
        assert events == ["route", ("end", True)]
        assert inside(be.pool_active_blocks(pool), y), "the routed capture did not draw from the router's pool"
        x.fill_(2.0)
        replay_and_wait(be, graph)
        assert equals(y, 5.0)
        other, _ = captured(be, x)  # after the block: not routed
        assert events == ["route", ("end", True)]
        be.release_graph(graph)
        assert events == ["route", ("end", True), ("release", False)]
        be.release_graph(other)
        assert events.count(("release", False)) == 1
        del y
        settle(be)
        be.release_pool(pool)

    def test_a_failed_routed_capture_ends_false_and_is_never_released(self, hal_backend: hal.Backend) -> None:
        be = hal_backend
        pool = be.create_pool()
        events: list[Any] = []

        def router(graph: Any, requested: Any) -> Route:
            return Route(pool, on_end=lambda ok: events.append(("end", ok)),
                         on_release=lambda collected: events.append(("release", collected)))

        x = full(be, 1.0)
        graph = be.create_graph()
        with be.route_captures(router):
            with pytest.raises(hal.CaptureError):
                with be.capture(graph, None, be.create_stream()):
                    (x * 2).sum().item()
        be.release_graph(graph)
        assert events == [("end", False)]
        be.release_pool(pool)

    def test_the_innermost_router_wins(self, hal_backend: hal.Backend) -> None:
        be = hal_backend
        pool = be.create_pool()
        seen: list[str] = []

        def router(tag: str) -> Any:
            def route(graph: Any, requested: Any) -> Route:
                seen.append(tag)
                return Route(pool)
            return route

        x = full(be, 1.0)
        with be.route_captures(router("outer")):
            with be.route_captures(router("inner")):
                g1, _ = captured(be, x)
            g2, _ = captured(be, x)
        assert seen == ["inner", "outer"]
        be.release_graph(g1)
        be.release_graph(g2)
        settle(be)
        be.release_pool(pool)


class TestUsePool(_NeedsCapabilities):
    """use_pool: the framework's allocations inside the block come from the pool."""

    capabilities = ("graphs", "custom_pool", "use_pool")

    def test_allocations_inside_the_block_live_in_the_pool(self, hal_backend: hal.Backend, segments: Segments) -> None:
        import torch

        be = hal_backend
        pool = be.create_pool(segments.alloc, segments.free)
        with be.use_pool(pool):
            t = torch.empty(N, dtype=torch.float32, device=be.torch_device())
        outside = torch.empty(N, dtype=torch.float32, device=be.torch_device())
        assert segments.holds(t), "an allocation inside use_pool does not live in the pool's segments"
        assert not segments.holds(outside), "an allocation after the block still came from the pool"
        t.fill_(5.0)
        be.synchronize(None)
        assert equals(t, 5.0)
        assert inside(be.pool_active_blocks(pool), t)
        del t
        settle(be)
        assert be.pool_active_blocks(pool) == []
        be.release_pool(pool)
        settle(be)
        assert segments.errors == [] and segments.frees == segments.allocs


class TestLazyGraphs(_NeedsCapabilities):
    """create_graph(lazy=True): instantiated at the first replay; replays as a graph instantiated at its capture."""

    capabilities = ("graphs", "lazy_graphs")

    def test_a_lazy_graph_replays_as_the_usual_one(self, hal_backend: hal.Backend) -> None:
        be = hal_backend
        x = full(be, 1.0)
        stream = be.create_stream()
        graphs, outs = {}, {}
        for lazy in (False, True):
            graphs[lazy] = be.create_graph(lazy=lazy)
            with be.capture(graphs[lazy], None, stream):
                outs[lazy] = step(x)
        for value, want in ((3.0, 7.0), (-1.0, -1.0)):
            x.fill_(value)
            for lazy in (True, False):
                replay_and_wait(be, graphs[lazy])
                assert equals(outs[lazy], want), f"the {'lazy' if lazy else 'usual'} graph did not recompute"
        for graph in graphs.values():
            be.release_graph(graph)
        assert be.live.graphs == 0


class TestGraphUpdate(_NeedsCapabilities):
    """update_graph: one graph replays any lazy capture of its topology; another topology is refused."""

    capabilities = ("graphs", "lazy_graphs", "graph_update")

    def test_one_graph_replays_each_capture_it_is_updated_to(self, hal_backend: hal.Backend) -> None:
        be = hal_backend
        xs = [full(be, float(k)) for k in range(3)]
        stream = be.create_stream()
        graphs, outs = [], []
        for k, x in enumerate(xs):
            graphs.append(be.create_graph(lazy=k > 0))
            with be.capture(graphs[-1], None, stream):
                outs.append(step(x))
        replay_and_wait(be, graphs[0])  # a capture need not run its work (a GPU's does not): run capture 0 once
        assert equals(outs[0], 1.0)
        for k in (2, 1, 2):
            xs[k].fill_(10.0 * k)
            be.update_graph(graphs[0], graphs[k])
            replay_and_wait(be, graphs[0])
            assert equals(outs[k], 20.0 * k + 1), f"the updated graph did not run capture {k}"
        assert equals(outs[0], 1.0), "capture 0's outputs changed, though it ran no more"
        for graph in graphs:
            be.release_graph(graph)

    def test_another_topology_or_an_eager_source_is_refused(self, hal_backend: hal.Backend) -> None:
        be = hal_backend
        x = full(be, 2.0)
        stream = be.create_stream()
        eager, other = be.create_graph(), be.create_graph(lazy=True)
        with be.capture(eager, None, stream):
            y = step(x)
        with be.capture(other, None, stream):
            step(step(step(x)))  # other kernels, more of them
        with pytest.raises(hal.InvalidArgumentError) as info:
            be.update_graph(eager, other)
        assert info.value.call == "update_graph"
        with pytest.raises(hal.InvalidArgumentError):
            be.update_graph(other, eager)
        x.fill_(4.0)
        replay_and_wait(be, eager)
        assert equals(y, 9.0), "a refused update changed the graph"
        for graph in (eager, other):
            be.release_graph(graph)


class TestTensorAt(_NeedsCapabilities):
    """tensor_at (optional, outside the capabilities): a framework view of mapped memory."""

    capabilities = ()

    def test_a_tensor_over_one_mapping_sees_writes_through_another(self, hal_backend: hal.Backend) -> None:
        be, g = hal_backend, hal_backend.granularity
        if not (be.implements("tensor_at") and be.implements("torch_device")):
            pytest.skip(f"{be.name} does not implement tensor_at and torch_device (optional hooks)")
        h = be.create_phy_mem_handle(g)
        va1, va2 = be.create_vir_ptr(g), be.create_vir_ptr(g)
        be.map(va1, g, h)
        be.map(va2, g, h)
        owner = object()
        a, b = be.tensor_at(va1, g, owner), be.tensor_at(va2, g)
        import torch

        assert a.dtype == torch.uint8 and a.numel() == g and a.device == be.torch_device()
        a.fill_(9)
        be.synchronize(None)
        assert int(b.min()) == int(b.max()) == 9
        del a, b
        settle(be)


class TestGraphLifecycle(_NeedsCapabilities):
    """close() releases graphs and pools still live; the accounting wrapper counts them."""

    def test_close_releases_live_graphs_and_pools(self, hal_backend: hal.Backend) -> None:
        be = hal_backend
        pool = be.create_pool()
        _graph, y = captured(be, full(be, 1.0), pool)
        be.create_graph()  # never captured
        assert (be.live.graphs, be.live.pools) == (2, 1)
        del y
        settle(be)
        be.close()
        assert be.closed and be.live.zero, be.live
        with pytest.raises(hal.InvalidStateError):
            be.create_graph()


class TestUnmapAfterQueuedWork(_NeedsCapabilities):
    """An unmap is ordered after the device work queued over the range: with ``wait=True`` (the facade waits
    unless the backend declares ``"unmap_waits"``), and without it on a backend that declares ``"unmap_waits"``.

    A replay queued over mapped memory, then the unmap at once: no fault, and the bytes the replay wrote are
    complete when read through a second mapping of the same chunk made before the unmap. A plugin whose
    unmap does not wait must not declare ``"unmap_waits"``: its callers wait.
    """

    def test_an_unmap_right_after_a_replay_waits_for_it(self, hal_backend: hal.Backend) -> None:
        be = hal_backend
        if not (be.implements("tensor_at") and be.implements("torch_device")):
            pytest.skip(f"{be.name} does not implement tensor_at and torch_device (optional hooks); these tests "
                        "replay work over mapped memory")
        import torch

        size = round_up(QUEUED_BYTES, be.granularity)
        h = be.create_phy_mem_handle(size)
        va1, va2 = be.create_vir_ptr(size), be.create_vir_ptr(size)
        be.map(va2, size, h)
        seen = be.tensor_at(va2, size).view(torch.float32)  # the second mapping: it stays
        rounds = [True, False] if be.supports("unmap_waits") else [True]
        mapped = False
        try:
            for value, wait in enumerate(rounds):
                be.map(va1, size, h)
                mapped = True
                x = be.tensor_at(va1, size).view(torch.float32)
                pool, graph = be.create_pool(), be.create_graph()
                with be.capture(graph, pool, be.create_stream()):
                    for _ in range(QUEUED_PASSES):
                        x.add_(1.0)
                x.fill_(float(value))  # after the capture: a host recorder runs the work it records
                be.synchronize(None)
                be.replay(graph)  # queued: a device is still writing x when the host unmaps
                del x
                be.unmap(va1, size, wait=wait)
                mapped = False
                be.synchronize(None)
                expected = float(value + QUEUED_PASSES)
                assert equals(seen, expected), (
                    f"{be.name}: unmap(wait={wait}) right after a replay: the replay's writes are not complete "
                    f"through another mapping of the chunk (expected every element {expected}); "
                    + ("the facade waited first, so the replay itself lost bytes" if wait else
                       "the backend declares 'unmap_waits' but its unmap did not wait for the queued replay"))
                be.release_graph(graph)
                settle(be)
                be.release_pool(pool)
        finally:
            del seen
            settle(be)
            if mapped:
                be.unmap(va1, size)
            be.unmap(va2, size)
            be.release_phy_mem_handle(h)
            be.release_vir_ptr(va1, size)
            be.release_vir_ptr(va2, size)
