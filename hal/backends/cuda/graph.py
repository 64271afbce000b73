"""torch.cuda graphs, streams and captures on one device."""

from __future__ import annotations

import contextlib
import gc
import logging
from dataclasses import dataclass
from typing import Any, Iterator

from hal.backends.cuda.torch_pool import CudaPool
from hal.errors import CaptureError, InvalidArgumentError, InvalidStateError

log = logging.getLogger("hal.cuda")

NAME = "cuda"

#: words in torch/CUDA error messages that say the captured work could not be captured
_CAPTURE_WORDS = ("captur",)


@dataclass(eq=False)
class CudaGraph:
    """A ``torch.cuda.CUDAGraph`` with the stream and pool it was captured on."""

    torch_graph: Any
    device: int
    stream: Any = None
    pool: CudaPool | None = None
    captured: bool = False
    released: bool = False

    def __repr__(self) -> str:
        state = "released" if self.released else "captured" if self.captured else "empty"
        return f"<cuda graph device={self.device} {state}>"


def new_graph(device: int) -> CudaGraph:
    import torch

    with torch.cuda.device(device):
        return CudaGraph(torch.cuda.CUDAGraph(), device)


@contextlib.contextmanager
def _gc_off() -> Iterator[None]:
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _note(exc: BaseException, text: str) -> None:
    if hasattr(exc, "add_note"):
        exc.add_note(text)


@contextlib.contextmanager
def capture(graph: CudaGraph, pool: CudaPool | None, stream: Any, capture_error_mode: str) -> Iterator[CudaGraph]:
    """Capture the work of the block into ``graph`` on ``stream``, drawing memory from ``pool``.

    The garbage collector is off inside the block. A capture that cannot be
    captured raises :class:`hal.CaptureError`; a custom pool that runs out of
    memory makes torch raise its ``OutOfMemoryError``, with the pool's reason
    attached as a note. Either way the graph is reset and may be released.
    """
    import torch

    if graph.captured or graph.released:
        raise InvalidStateError(f"{graph!r} cannot be captured again", backend=NAME, call="capture")
    if pool is not None:
        if pool.released:
            raise InvalidStateError(f"{pool!r} was released", backend=NAME, call="capture")
        if pool.device != graph.device:
            raise InvalidArgumentError(f"{pool!r} is not on device {graph.device}", backend=NAME, call="capture")
    if stream is None or stream.device != torch.device("cuda", graph.device):
        raise InvalidArgumentError(f"stream={stream!r} is not a stream of device {graph.device}",
                                   backend=NAME, call="capture")
    if pool is not None and pool.callbacks is not None:
        pool.callbacks.last_error = None
    with torch.cuda.device(graph.device):
        previous = torch.cuda.current_stream()
        try:
            with torch.cuda.graph(graph.torch_graph, pool=None if pool is None else pool.id,
                                  stream=stream, capture_error_mode=capture_error_mode):
                with _gc_off():
                    yield graph
        except torch.OutOfMemoryError as exc:
            reason = pool.callbacks.last_error if pool is not None and pool.callbacks is not None else None
            if reason:
                _note(exc, f"hal cuda: {reason}")
            _reset_after_failure(graph, previous)
            raise
        except RuntimeError as exc:
            _reset_after_failure(graph, previous)
            text = str(exc)
            if any(w in text.lower() for w in _CAPTURE_WORDS):
                raise CaptureError(
                    f"the work inside the block could not be captured: {text.strip().splitlines()[0]} "
                    "(host synchronisations such as .item(), .cpu() or printing a tensor, and "
                    "allocations of device memory outside the pool, are not allowed in a capture)",
                    backend=NAME, call="capture") from exc
            raise
        except BaseException:
            _reset_after_failure(graph, previous)
            raise
    graph.stream = stream
    graph.pool = pool
    graph.captured = True
    if pool is not None:
        pool.graphs += 1


def _reset_after_failure(graph: CudaGraph, previous_stream: Any) -> None:
    import torch

    if torch.cuda.current_stream() != previous_stream:  # torch skips restoring it when capture_end raises
        torch.cuda.set_stream(previous_stream)
    try:
        graph.torch_graph.reset()
    except RuntimeError as exc:
        log.debug("reset of a failed capture: %s", exc)


def replay(graph: CudaGraph) -> None:
    """Launch ``graph`` on its capture stream, ordered after (and before) the current stream's work."""
    import torch

    if not graph.captured or graph.released:
        raise InvalidStateError(f"{graph!r} cannot be replayed", backend=NAME, call="replay")
    with torch.cuda.device(graph.device):
        current = torch.cuda.current_stream()
        stream = graph.stream
        if current == stream:
            graph.torch_graph.replay()
            return
        stream.wait_stream(current)
        with torch.cuda.stream(stream):
            graph.torch_graph.replay()
        current.wait_stream(stream)


def release(graph: CudaGraph) -> None:
    """Wait for the graph's last replay, then destroy it; idempotent."""
    import torch

    if graph.released:
        return
    graph.released = True
    with torch.cuda.device(graph.device):
        if graph.captured and graph.stream is not None:
            graph.stream.synchronize()
        graph.torch_graph.reset()
    if graph.pool is not None:
        graph.pool.graphs -= 1
        graph.pool = None
    graph.torch_graph = None
    graph.stream = None
