"""The per-stream library state hal makes ahead of captures (cuBLAS workspaces), against a stand-in torch.

The stand-in behaves as torch 2.11 was measured to on an H100: the first GEMM (or the first request for the
BLAS handle) on a (handle, stream) pair leaves a 32 MiB workspace allocated, the first GEMM with a bias
another 1 MiB; a new thread has a handle of its own.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest

from hal.backends._native.stream_state import StreamState
from hal.routing import GraphClassRouting
from hal.types import Route

MiB = 1 << 20


class Blas:
    """torch and torch.cuda, as far as preparing a stream touches them."""

    def __init__(self) -> None:
        self.stream = "s0"
        self.capturing = False
        self.allocated = 0
        self.workspaces: set[tuple[Any, ...]] = set()
        self.gemms: list[tuple[str, str]] = []  # (stream, op) of every GEMM run
        self.handles: dict[int, int] = {}
        self.float32, self.bfloat16, self.float16 = "f32", "bf16", "f16"
        self.ns = SimpleNamespace(
            is_current_stream_capturing=lambda: self.capturing, current_device=lambda: 0,
            current_stream=lambda: SimpleNamespace(stream_id=self.stream), memory_allocated=lambda d: self.allocated,
            current_blas_handle=self.handle, stream=self.use_stream)

    def handle(self) -> int:
        handle = self.handles.setdefault(threading.get_ident(), len(self.handles) + 1)
        self._workspace(handle, "cublas", 32 * MiB)  # asking for the handle makes the stream's workspace
        return handle

    def _workspace(self, handle: int, kind: str, size: int) -> None:
        if (handle, self.stream, kind) not in self.workspaces:
            self.workspaces.add((handle, self.stream, kind))
            self.allocated += size

    @contextlib.contextmanager
    def use_stream(self, stream: Any) -> Iterator[None]:
        previous, self.stream = self.stream, stream
        try:
            yield
        finally:
            self.stream = previous

    def device(self, kind: str, index: int) -> tuple[str, int]:
        return kind, index

    def ones(self, *shape: int, dtype: str, device: Any) -> SimpleNamespace:
        return SimpleNamespace(dtype=dtype, device=device)

    def mm(self, a: Any, b: Any) -> None:
        assert not self.capturing
        self.gemms.append((self.stream, "mm"))
        self.handle()

    def addmm(self, bias: Any, a: Any, b: Any) -> None:
        assert not self.capturing
        self.gemms.append((self.stream, "addmm"))
        self._workspace(self.handle(), "cublasLt", 1 * MiB)


@pytest.fixture
def blas() -> Blas:
    return Blas()


def test_a_stream_is_prepared_once_per_thread_and_the_sizes_are_measured(blas: Blas) -> None:
    state = StreamState(blas, blas.ns, "cuda")
    state.prepare_current()
    assert len(blas.gemms) == 6  # a plain GEMM and one with a bias, in three dtypes
    assert state.sizes(0) == {32 * MiB: "cuBLAS's workspace", 1 * MiB: "cuBLASLt's workspace"}
    state.prepare_current()
    assert len(blas.gemms) == 6  # nothing left to make
    state.prepare("s1")
    assert {s for s, _ in blas.gemms[6:]} == {"s1"} and len(blas.gemms) == 12
    worker = threading.Thread(target=state.prepare_current)  # another thread: another handle, another workspace
    worker.start()
    worker.join()
    assert len(blas.gemms) == 18
    assert blas.allocated == 3 * 33 * MiB


def test_nothing_is_made_while_the_stream_captures(blas: Blas) -> None:
    state = StreamState(blas, blas.ns, "cuda")
    blas.capturing = True
    state.prepare_current()
    assert blas.gemms == [] and blas.allocated == 0
    blas.capturing = False
    state.prepare_current()
    assert len(blas.gemms) == 6


class FrameworkGraph:
    """A framework graph class with the capture API that routing wraps."""

    events: ClassVar[list[str]] = []

    def capture_begin(self, pool: Any = None, capture_error_mode: str = "global") -> None:
        FrameworkGraph.events.append(f"begin {pool}")

    def capture_end(self) -> None:
        FrameworkGraph.events.append("end")

    def reset(self) -> None:
        pass


def test_a_routed_capture_has_its_stream_prepared_before_it_begins() -> None:
    FrameworkGraph.events = []
    routing = GraphClassRouting(FrameworkGraph, lambda: 0, lambda pool: pool,
                                prepare=lambda: FrameworkGraph.events.append("prepare"))
    with routing.activate(0, lambda graph, requested: Route("mine") if requested == "route me" else None):
        routed, passed = FrameworkGraph(), FrameworkGraph()
        routed.capture_begin("route me")
        routed.capture_end()
        passed.capture_begin("leave me")  # a capture no router takes is the caller's own business
        passed.capture_end()
    assert FrameworkGraph.events == ["prepare", "begin mine", "end", "begin leave me", "end"]


def test_a_failed_preparation_ends_the_route_and_the_capture_does_not_begin() -> None:
    FrameworkGraph.events = []
    ended: list[bool] = []

    def prepare() -> None:
        raise RuntimeError("out of memory")

    routing = GraphClassRouting(FrameworkGraph, lambda: 0, lambda pool: pool, prepare=prepare)
    with routing.activate(0, lambda graph, requested: Route("mine", on_end=ended.append)):
        with pytest.raises(RuntimeError, match="out of memory"):
            FrameworkGraph().capture_begin()
    assert ended == [False] and FrameworkGraph.events == []


def test_the_fake_backend_has_nothing_to_prepare(be: Any) -> None:
    be.prepare_capture_stream()
    assert be.stream_state_sizes() == {}
