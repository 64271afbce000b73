"""The lifecycle of a ``torch.cuda.CUDAGraph`` in the cuda backend: capture, replay, release.

Beyond the shared glue's capture, a cuda graph remembers the stream and pool
it was captured on, replays on that stream (ordered with the caller's), and
a capture that fails half-way is undone: torch's allocator stops routing the
stream's allocations to the pool, the pool's reference is dropped and the
random generators leave capture mode.

With ``inspect``, the graph under construction is read just before torch
ends the capture (:mod:`hal.backends.cuda.introspect`) and what it uses is
kept on the :class:`CudaGraph`. A routed capture whose route refuses the
graph at its end is undone the same way, and the route's error propagates.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hal.backends._native import torch_compat as compat
from hal.backends._native.routing import ADDRESSES, REFUSED, UNROUTED, forget
from hal.backends._native.torch_glue import TorchPool
from hal.backends.cuda.errors import NAME
from hal.errors import CaptureError, InvalidArgumentError, InvalidStateError
from hal.gcguard import gc_disabled
from hal.types import GraphAddresses

if TYPE_CHECKING:
    from hal.backends.cuda.torch_glue import CudaGlue

log = logging.getLogger("hal.cuda")


@dataclass(eq=False)
class CudaGraph:
    """A ``torch.cuda.CUDAGraph`` with the stream and pool it was captured on."""

    torch_graph: Any
    device: int
    stream: Any = None
    pool: TorchPool | None = None
    captured: bool = False
    released: bool = False
    #: what the graph uses, read at its capture (``inspect``), or why that could not be read
    addresses: GraphAddresses | str | None = None

    def __repr__(self) -> str:
        state = "released" if self.released else "captured" if self.captured else "empty"
        return f"<cuda graph device={self.device} {state}>"


def _check_pool(glue: CudaGlue, graph: CudaGraph, pool: TorchPool | None) -> None:
    """Refuse a released pool or one of another device (ending a route the router began)."""
    if pool is None:
        return
    problem = (f"{pool!r} was released" if pool.released
               else f"{pool!r} is not on device {graph.device}" if pool.device != graph.device else None)
    if problem:
        if glue.routing is not None:
            glue.routing.end(graph.torch_graph, False)
        raise (InvalidStateError if pool.released else InvalidArgumentError)(problem, backend=NAME, call="capture")


#: reads the graph being captured on a stream: ``inspector(stream) -> GraphAddresses``
StreamInspector = Callable[[Any], GraphAddresses]


@contextlib.contextmanager
def capture(glue: CudaGlue, graph: CudaGraph, pool: TorchPool | None, stream: Any,
            capture_error_mode: str, inspect: StreamInspector | None = None) -> Iterator[CudaGraph]:
    """Capture the work of the block into ``graph`` on ``stream``, drawing memory from ``pool``.

    A context manager around ``torch.cuda.graph``. The garbage collector is
    off inside the block. Work that cannot be captured raises
    :class:`hal.CaptureError`; a custom pool that runs out of memory makes
    torch raise its ``OutOfMemoryError``, with the pool's reason attached as
    a note. After a failure the graph is empty (release it) and torch's
    allocator no longer routes the stream's allocations to the pool.

    :param inspect: reads the graph under construction on ``stream`` just
        before the capture ends; what it returns (or why it failed) is kept
        in ``graph.addresses``.
    :raises: a route's own error when its ``on_end(True)`` refuses the graph
        (the graph is then empty, as after a failed capture).
    """
    torch, cuda = glue.torch, glue.ns
    if graph.captured or graph.released:
        raise InvalidStateError(f"{graph!r} cannot be captured again", backend=NAME, call="capture")
    if stream is None or stream.device != torch.device("cuda", graph.device):
        raise InvalidArgumentError(f"stream={stream!r} is not a stream of device {graph.device}",
                                   backend=NAME, call="capture")
    graph.addresses = None
    forget(graph.torch_graph, ADDRESSES, REFUSED)
    if glue.routing is not None:  # inside route_captures the router chooses the pool
        pool = glue.routing.begin(graph.torch_graph, pool, graph.device) or pool
    _check_pool(glue, graph, pool)
    if pool is not None and pool.callbacks is not None:
        pool.callbacks.last_error = None
    with cuda.device(graph.device):
        # a private pool gets an id of its own, so that a failed capture can be undone
        pool_id = pool.id if pool is not None else tuple(cuda.graph_pool_handle())
        previous = cuda.current_stream()
        torch_capture = cuda.graph(graph.torch_graph, pool=pool_id, stream=stream,
                                   capture_error_mode=capture_error_mode)
        try:
            torch_capture.__enter__()
        except BaseException:
            _undo_failed_capture(glue, graph, pool_id, previous, capture_ended=False)
            raise
        body: BaseException | None = None
        try:
            with gc_disabled():
                yield graph
        except BaseException as exc:  # noqa: BLE001 - kept, then re-raised as CaptureError or undone after exit
            body = exc
        if body is None and inspect is not None:
            _record_addresses(graph, stream, inspect)
        try:
            with warnings.catch_warnings():
                if body is not None:  # the graph is empty or partial: torch's warning about it is noise
                    warnings.simplefilter("ignore")
                torch_capture.__exit__(type(body) if body else None, body, body.__traceback__ if body else None)
        except BaseException as end_exc:
            if graph.torch_graph.__dict__.pop(REFUSED, False):  # ended, then refused by its route
                graph.addresses = None
                _undo_failed_capture(glue, graph, pool_id, previous, capture_ended=True)
                if body is not None:
                    raise body from end_exc
                raise
            graph.addresses = None
            forget(graph.torch_graph, ADDRESSES)
            _undo_failed_capture(glue, graph, pool_id, previous, capture_ended=False)
            first = body if body is not None else end_exc
            raise CaptureError(
                f"the work inside the block could not be captured: {_first_line(first)} "
                "(host synchronisations such as .item(), .cpu() or printing a tensor are not allowed "
                "in a capture)", backend=NAME, call="capture") from end_exc
        if body is not None:
            forget(graph.torch_graph, ADDRESSES)
            _undo_failed_capture(glue, graph, pool_id, previous, capture_ended=True)
            if isinstance(body, torch.OutOfMemoryError):
                glue.explain_out_of_memory(body, pool)
            elif isinstance(body, RuntimeError) and "captur" in str(body).lower():
                raise CaptureError(f"the work inside the block could not be captured: {_first_line(body)}",
                                   backend=NAME, call="capture") from body
            raise body
    graph.stream = stream
    graph.pool = pool
    graph.captured = True
    graph.addresses = graph.torch_graph.__dict__.get(ADDRESSES)  # ours, or what a route asked for
    if pool is not None:
        pool.graphs += 1


def _record_addresses(graph: CudaGraph, stream: Any, inspect: StreamInspector) -> None:
    """Read what the graph under construction on ``stream`` uses; keep it (or why it failed) on the graph
    and on its torch graph, where a route's ``on_end`` looks for it."""
    try:
        found: GraphAddresses | str = inspect(stream)
    except Exception as exc:  # noqa: BLE001 - the capture still ends; graph_addresses says why there is nothing
        found = f"{type(exc).__name__}: {exc}"
        log.warning("cuda: the addresses of a capture could not be read: %s", found)
    graph.torch_graph.__dict__[ADDRESSES] = found


def addresses(graph: CudaGraph | Any) -> GraphAddresses:
    """What a graph captured with ``inspect`` (or routed with an inspecting route) uses.

    :param graph: a :class:`CudaGraph` or a ``torch.cuda.CUDAGraph``.
    :raises InvalidStateError: nothing was recorded for it, or the read failed.
    """
    if isinstance(graph, CudaGraph):
        if graph.released or not graph.captured:
            raise InvalidStateError(f"{graph!r} is not captured", backend=NAME, call="graph_addresses")
        found = graph.addresses
    else:
        found = getattr(graph, "__dict__", {}).get(ADDRESSES)
    if isinstance(found, GraphAddresses):
        return found
    why = (f"reading it failed: {found}" if isinstance(found, str)
           else "it was captured without inspect=True (or by a route without inspect)")
    raise InvalidStateError(f"no addresses were recorded for {graph!r}: {why}", backend=NAME,
                            call="graph_addresses")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _rearm_generators(glue: CudaGlue, device: int) -> None:
    """Take the device's random generators out of capture mode after a capture that never ended.

    torch puts them in capture mode when a capture begins and out of it when
    the capture ends; a failed end leaves them there, and every later random
    op on the device fails ("Offset increment outside graph capture"). An
    empty capture that ends well puts them back.
    """
    cuda = glue.ns
    try:
        with cuda.device(device):
            stream = cuda.Stream()
            empty = cuda.CUDAGraph()
            setattr(empty, UNROUTED, True)  # housekeeping: a router inside route_captures must not see it
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "the graph is empty"
                with cuda.graph(empty, stream=stream):
                    pass
            empty.reset()
    except RuntimeError as exc:  # pragma: no cover - device machines only
        log.warning("cuda: could not take the random generators out of capture mode: %s", exc)


def _stop_routing_to_pool(glue: CudaGlue, device: int, pool_id: tuple) -> None:
    """Stop routing allocations to ``pool_id`` and drop the reference a failed ``capture_begin`` took."""
    end, release = glue.private(compat.END_ALLOCATE_TO_POOL), glue.private(compat.RELEASE_POOL)
    if end is None or release is None:
        log.warning("cuda: this torch cannot stop routing allocations to the pool of a failed capture; "
                    "capture on a new stream from now on")
        return
    try:
        end(device, pool_id)
    except RuntimeError:
        return  # torch got past its own bookkeeping
    release(device, pool_id)
    log.debug("cuda: undid the allocator state of a failed capture into pool %s", pool_id)


def _undo_failed_capture(glue: CudaGlue, graph: CudaGraph, pool_id: tuple, previous_stream: Any,
                         capture_ended: bool) -> None:
    """Leave torch's allocator and the current stream as they were before a failed capture.

    When ``cudaStreamEndCapture`` fails (an invalidated capture), torch's
    ``capture_end`` raises before it stops routing the capture stream's
    allocations to the pool and the graph never owns the reference on the
    pool that ``capture_begin`` took; both are undone here, or later
    allocations would still be routed to a dead capture's pool.
    """
    cuda = glue.ns
    if cuda.current_stream() != previous_stream:  # torch skips restoring it when capture_end raises
        cuda.set_stream(previous_stream)
    if not capture_ended:
        _stop_routing_to_pool(glue, graph.device, pool_id)
        _rearm_generators(glue, graph.device)
    try:
        graph.torch_graph.reset()
    except RuntimeError as exc:
        log.debug("reset of a failed capture: %s", exc)


def replay(glue: CudaGlue, graph: CudaGraph) -> None:
    """Launch ``graph`` on its capture stream, ordered after (and before) the current stream's work."""
    cuda = glue.ns
    if not graph.captured or graph.released:
        raise InvalidStateError(f"{graph!r} cannot be replayed", backend=NAME, call="replay")
    with cuda.device(graph.device):
        current = cuda.current_stream()
        stream = graph.stream
        if current == stream:
            graph.torch_graph.replay()
            return
        stream.wait_stream(current)
        with cuda.stream(stream):
            graph.torch_graph.replay()
        current.wait_stream(stream)


def release(glue: CudaGlue, graph: CudaGraph) -> None:
    """Wait for the graph's last replay, then destroy it; idempotent."""
    if graph.released:
        return
    graph.released = True
    if graph.pool is not None:  # before the reset: a routed graph's reset may release its pool
        graph.pool.graphs -= 1
        graph.pool = None
    with glue.ns.device(graph.device):
        if graph.captured and graph.stream is not None:
            graph.stream.synchronize()
        graph.torch_graph.reset()
    forget(graph.torch_graph, ADDRESSES)
    graph.addresses = None
    graph.torch_graph = None
    graph.stream = None
