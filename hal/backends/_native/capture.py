"""One graph capture through a torch device namespace (``torch.cuda.graph``, ``torch.npu.graph``, ``torch.mlu.graph``).

The path every torch-based backend takes: the capture is routed where a
router is active (:mod:`hal.routing`), its pool checked,
the stream's lazily made library state made first
(:mod:`hal.backends._native.stream_state`), the garbage collector is off
inside the block, the graph under construction
is read just before the capture ends where an inspector was asked for, and
a capture that fails is undone -- the current stream given back, the
allocator no longer routing the stream's allocations to the pool, the
random generators out of capture mode, the graph reset -- before the error
leaves, turned into :class:`hal.CaptureError` where the glue recognises it
and with the pool's reason attached to an out-of-memory error.

What differs between vendors comes from the glue (:class:`CaptureGlue`):
how a backend graph wraps the framework's graph, what is checked before a
capture and recorded after it, the pool id of a capture without a pool, and
which failures are capture errors.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any, NoReturn, Protocol

from hal.backends._native import torch_compat as compat
from hal.errors import CaptureError, InvalidArgumentError, InvalidStateError
from hal.gcguard import gc_disabled
from hal.routing import ADDRESSES, REFUSED, UNROUTED, GraphClassRouting, forget
from hal.transaction import Transaction
from hal.types import GraphAddresses

#: reads the graph being captured on a stream: ``inspector(stream) -> GraphAddresses``
StreamInspector = Callable[[Any], GraphAddresses]

#: where a capture failed: entering the framework's block, inside it, or ending it
Phase = str
BEGIN, BODY, END = "begin", "body", "end"

#: why a capture that ended in an error is a capture error, whatever the vendor
HOST_SYNC_ADVICE = ("host synchronisations such as .item(), .cpu() or printing a tensor are not allowed "
                    "in a capture")


class CapturePool(Protocol):
    """What a capture reads of a pool (a :class:`~hal.backends._native.torch_glue.TorchPool`)."""

    id: tuple
    device: int
    released: bool
    callbacks: Any


class CaptureGlue(Protocol):
    """What a capture uses of a glue (a :class:`~hal.backends._native.torch_glue.TorchGlue`)."""

    @property
    def backend(self) -> str: ...
    @property
    def ns(self) -> Any: ...
    @property
    def device(self) -> int: ...
    @property
    def log(self) -> logging.Logger: ...
    @property
    def routing(self) -> GraphClassRouting | None: ...
    @property
    def graph_class(self) -> str: ...
    def private(self, api: compat.PrivateApi) -> Any | None: ...
    def on_device(self, device: int | None = None) -> AbstractContextManager[Any]: ...
    def check_capture(self, graph: Any, stream: Any) -> None: ...
    def torch_graph_of(self, graph: Any) -> Any: ...
    def capture_pool_id(self, pool: Any) -> Any: ...
    def captured(self, graph: Any, stream: Any, pool: Any) -> None: ...
    def capture_error(self, exc: BaseException, phase: Phase) -> CaptureError | None: ...
    def explain_out_of_memory(self, exc: BaseException, pool: Any) -> None: ...
    def prepare_capture_stream(self, stream: Any) -> None: ...


@contextlib.contextmanager
def capture(glue: CaptureGlue, graph: Any, pool: CapturePool | None, stream: Any, mode: str,
            inspect: StreamInspector | None) -> Iterator[Any]:
    """Capture the work of the block into ``graph`` on ``stream``, drawing memory from ``pool``.

    :param inspect: reads the graph under construction on ``stream`` just before the capture
        ends; what it returns (or why it failed) is recorded on the framework's graph.
    :raises: a route's own error when its ``on_end(True)`` refuses the graph (the graph is
        then empty, as after a failed capture).
    """
    glue.check_capture(graph, stream)
    torch_graph = glue.torch_graph_of(graph)
    forget(torch_graph, ADDRESSES, REFUSED)
    if glue.routing is not None:  # inside route_captures the router chooses the pool
        pool = glue.routing.begin(torch_graph, pool, glue.device) or pool
    check_pool(glue, torch_graph, pool)
    if pool is not None and pool.callbacks is not None:
        pool.callbacks.last_error = None
    with glue.on_device(), gc_disabled():  # see hal.gcguard: the allocator callbacks run inside
        _prepare(glue, torch_graph, stream)
        attempt = _Attempt(glue, torch_graph, pool, stream, mode)
        attempt.begin()
        body: BaseException | None = None
        try:
            yield graph
        except BaseException as exc:  # not an undo: kept; re-raised as a CaptureError or undone below  # noqa: BLE001
            body = exc
        if body is None and inspect is not None:
            record_addresses(glue, torch_graph, stream, inspect)
        attempt.end(body)
    glue.captured(graph, stream, pool)


def _prepare(glue: CaptureGlue, torch_graph: Any, stream: Any) -> None:
    """The stream's lazily made library state, made before the capture (ending a route the router began
    when that fails)."""
    routing = glue.routing
    with Transaction() as tx:
        if routing is not None:
            tx.append(lambda: routing.end(torch_graph, False))
        glue.prepare_capture_stream(stream)
        tx.commit()


def check_pool(glue: CaptureGlue, torch_graph: Any, pool: CapturePool | None) -> None:
    """Refuse a released pool or one of another device (ending a route the router began)."""
    if pool is None:
        return
    problem = (f"{pool!r} was released" if pool.released
               else f"{pool!r} is not on device {glue.device}" if pool.device != glue.device else None)
    if problem:
        if glue.routing is not None:
            glue.routing.end(torch_graph, False)
        raise (InvalidStateError if pool.released else InvalidArgumentError)(problem, backend=glue.backend,
                                                                               call="capture")


def record_addresses(glue: CaptureGlue, torch_graph: Any, stream: Any, inspect: StreamInspector) -> None:
    """Read what the graph under construction on ``stream`` uses; keep it (or why the read failed) on
    ``torch_graph``, where a route's ``on_end`` and the backend look for it."""
    try:
        found: GraphAddresses | str = inspect(stream)
    except Exception as exc:  # noqa: BLE001 - the capture still ends; graph_addresses says why there is nothing
        found = f"{type(exc).__name__}: {exc}"
        glue.log.warning("%s: the addresses of a capture could not be read: %s", glue.backend, found)
    torch_graph.__dict__[ADDRESSES] = found


def first_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message (its type's name when it has none)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


class _Attempt:
    """The framework's capture block around one capture, entered and left by hand, and undone on failure."""

    def __init__(self, glue: CaptureGlue, torch_graph: Any, pool: CapturePool | None, stream: Any,
                 mode: str) -> None:
        self.glue, self.torch_graph, self.pool = glue, torch_graph, pool
        # a capture without a pool may get an id of its own, so that a failure can be undone
        self.pool_id = glue.capture_pool_id(pool)
        self.previous_stream = glue.ns.current_stream()
        self.block = glue.ns.graph(torch_graph, pool=self.pool_id, stream=stream, capture_error_mode=mode)

    def begin(self) -> None:
        try:
            with Transaction() as tx:
                tx.append(lambda: self.undo(ended=False), retry=False)
                self.block.__enter__()
                tx.commit()
        except BaseException as exc:  # not an undo (that ran as the transaction left): the error is translated
            translated = self.glue.capture_error(exc, BEGIN)
            if translated is None:
                raise
            raise translated from exc

    def end(self, body: BaseException | None) -> None:
        """Leave the framework's block (after ``body`` failed the block, when it did); raise on failure."""
        try:
            with warnings.catch_warnings():
                if body is not None:  # the graph is empty or partial: the framework's warning about it is noise
                    warnings.simplefilter("ignore")
                self.block.__exit__(type(body) if body else None, body, body.__traceback__ if body else None)
        except BaseException as end_exc:  # not an undo: _end_failed raises it, or what stands for it  # noqa: BLE001
            self._end_failed(body, end_exc)
        if body is not None:
            self._body_failed(body)

    def _end_failed(self, body: BaseException | None, end_exc: BaseException) -> NoReturn:
        if self.torch_graph.__dict__.pop(REFUSED, False):  # ended, then refused by its route
            self.undo(ended=True)
            if body is not None:
                raise body from end_exc
            raise end_exc
        forget(self.torch_graph, ADDRESSES)
        self.undo(ended=False)
        first = body if body is not None else end_exc
        translated = self.glue.capture_error(first, END)
        if translated is not None:
            raise translated from end_exc
        raise CaptureError(f"the work inside the block could not be captured: {first_line(first)} "
                           f"({HOST_SYNC_ADVICE})", backend=self.glue.backend, call="capture") from end_exc

    def _body_failed(self, body: BaseException) -> NoReturn:
        forget(self.torch_graph, ADDRESSES)
        self.undo(ended=True)
        self.glue.explain_out_of_memory(body, self.pool)
        translated = self.glue.capture_error(body, BODY)
        if translated is not None:
            raise translated from body
        raise body

    def undo(self, ended: bool) -> None:
        """Leave the allocator and the current stream as they were before the capture.

        When the framework's ``capture_end`` fails (an invalidated capture), it raises before
        it stops routing the capture stream's allocations to the pool, and the graph never owns
        the reference on the pool that ``capture_begin`` took; both are undone here, or later
        allocations would still go to a dead capture's pool.
        """
        ns = self.glue.ns
        if ns.current_stream() != self.previous_stream:  # the block skips restoring it when capture_end raises
            ns.set_stream(self.previous_stream)
        if not ended:
            self._stop_routing_to_pool()
            self._rearm_generators()
        try:
            self.torch_graph.reset()
        except RuntimeError as exc:
            self.glue.log.debug("reset of a failed capture: %s", exc)

    def _stop_routing_to_pool(self) -> None:
        """Stop routing allocations to the capture's pool and drop the reference ``capture_begin`` took."""
        glue = self.glue
        if self.pool_id is None:
            return
        end, release = glue.private(compat.END_ALLOCATE_TO_POOL), glue.private(compat.RELEASE_POOL)
        if end is None or release is None:
            glue.log.warning("%s: this build cannot stop routing allocations to the pool of a failed capture; "
                             "capture on a new stream from now on", glue.backend)
            return
        try:
            end(glue.device, self.pool_id)
        except RuntimeError:
            return  # the framework got past its own bookkeeping
        release(glue.device, self.pool_id)
        glue.log.debug("%s: undid the allocator state of a failed capture into pool %s", glue.backend, self.pool_id)

    def _rearm_generators(self) -> None:
        """Take the device's random generators out of capture mode after a capture that never ended.

        The framework puts them in capture mode when a capture begins and out of it when the
        capture ends; a failed end leaves them there, and every later random op on the device
        fails ("Offset increment outside graph capture"). An empty capture that ends well puts
        them back.
        """
        ns = self.glue.ns
        try:
            stream = ns.Stream()
            empty = getattr(ns, self.glue.graph_class)()
            setattr(empty, UNROUTED, True)  # housekeeping: a router inside route_captures must not see it
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "the graph is empty"
                with ns.graph(empty, stream=stream):
                    pass
            empty.reset()
        except Exception as exc:  # noqa: BLE001 - pragma: no cover on a CPU; the capture's own error matters more
            self.glue.log.warning("%s: could not take the random generators out of capture mode: %s",
                                  self.glue.backend, exc)
