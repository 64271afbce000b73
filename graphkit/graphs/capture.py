"""Capturing one function into one graph, with the hygiene every backend gets for free.

* warm-up on the capture stream first, so lazily created state (cuBLAS
  workspaces, caches) is born outside the capture, not in memory that other
  graphs overwrite;
* the garbage collector is off during the capture (a collection freeing a
  device tensor there would need the allocator lock the capture holds);
* afterwards, anything still allocated in the capture's pool other than the
  outputs is reported: a cache or workspace born inside a capture holds
  memory of its own in a vmm pool (it outlived its capture: graphkit gave it
  bytes no other graph maps), a granule per size, and in a shared pool it
  lives in memory that other graphs overwrite.
"""

from __future__ import annotations

import functools
import logging
import sys
import time
import traceback
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

import hal
from graphkit.graphs.strategies import Lease
from hal.gcguard import gc_disabled
from hal.transaction import Transaction
from hal.types import fmt_bytes

log = logging.getLogger(__name__)


class CaptureHygieneError(hal.CaptureError):
    """Memory other than the outputs outlived a capture (raised when hygiene is strict); a
    :class:`hal.CaptureError`, hence a ``RuntimeError``."""


@dataclass
class Captured:
    """A captured graph with its outputs and what the capture cost."""

    graph: Any
    outputs: Any
    seconds: float
    leftovers: list[tuple[int, int]] = field(default_factory=list)


def weak_alias(t: Any) -> Any:
    """A tensor over the same memory as ``t`` that does not keep that memory allocated.

    This is how vLLM holds graph outputs: the pool may hand the memory to the
    next capture, which is safe because outputs are read right after each
    replay. Non-tensors pass through.
    """
    if not isinstance(t, torch.Tensor) or not t.numel():
        return t
    storage = torch._C._construct_storage_from_data_pointer(
        t.untyped_storage().data_ptr(), t.device, t.untyped_storage().nbytes())
    return torch.empty((), dtype=t.dtype, device=t.device).set_(storage, t.storage_offset(), t.shape, t.stride())


#: where torch.compile's CUDA graph trees capture: they manage one pool of their own and check it
GRAPH_TREES_MODULE = "torch._inductor.cudagraph_trees"
#: make_graphed_callables: forward and backward graphs share one pool (backward reads forward's memory)
GRAPHED_CALLABLES = ("torch.cuda.graphs", frozenset({"make_graphed_callables", "_make_graphed_callables"}))


def framework_capturer(depth: int = 48) -> str | None:
    """Which part of torch started the capture now beginning, when it is one that needs its own pool logic.

    ``"graph_trees"`` (torch.compile ``mode="reduce-overhead"``),
    ``"graphed_callables"`` (``torch.cuda.make_graphed_callables``) or None.
    Read from the calling frames: cheap, and needs no change in torch.
    """
    frame: FrameType | None = sys._getframe(1)
    module, names = GRAPHED_CALLABLES
    while frame is not None and depth:
        name = frame.f_globals.get("__name__")
        if name == GRAPH_TREES_MODULE:
            return "graph_trees"
        if name == module and frame.f_code.co_name in names:
            return "graphed_callables"
        frame, depth = frame.f_back, depth - 1
    return None


def tensors_of(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def active_blocks(backend: hal.Backend, lease: Lease) -> set[tuple[int, int]]:
    """Blocks of the lease's pool in use now (none known for a graph-private pool)."""
    return set() if lease.pool is None else set(backend.pool_active_blocks(lease.pool))


def leftover_blocks(backend: hal.Backend, lease: Lease, outputs: Any,
                    before: AbstractSet[tuple[int, int]] = frozenset()) -> list[tuple[int, int]]:
    """Blocks of the lease's pool in use now, not in use ``before``, holding none of the outputs."""
    if lease.pool is None:
        return []
    spans = []
    for t in tensors_of(outputs):
        if t.numel():
            storage = t.untyped_storage()
            spans.append((storage.data_ptr(), storage.data_ptr() + storage.nbytes()))
    return sorted((ptr, size) for ptr, size in active_blocks(backend, lease) - set(before)
                  if not any(lo < ptr + size and ptr < hi for lo, hi in spans))


def report_leftovers(backend: hal.Backend, leftovers: list[tuple[int, int]], what: str,
                     strict: bool = False) -> None:
    """Log (or raise, when ``strict``) memory that outlived a capture."""
    if not leftovers:
        return
    total = sum(size for _, size in leftovers)
    sizes = ", ".join(f"{fmt_bytes(s)} ({s} bytes) at {p:#x}" for p, s in leftovers[:8])
    message = (f"{what}: {len(leftovers)} block(s), {fmt_bytes(total)} in all, still allocated in the "
               f"graph pool after capture besides the outputs: {sizes}. A tensor created inside the "
               "capture and kept (a cache, a workspace) costs a granule of its own per size in a vmm pool and, in "
               "a shared pool, lives in memory that other graphs overwrite; create it before capturing (a "
               "warm-up run does that)")
    if strict:
        raise CaptureHygieneError(message, backend=backend.name, call="capture")
    log.warning(message)


def release_cached_memory(backend: hal.Backend) -> None:
    """Give memory cached by the framework's allocator back to the device (torch.cuda/npu/mlu.empty_cache)."""
    device = backend.torch_device()
    module = getattr(torch, device.type, None)
    if device.type != "cpu" and module is not None and hasattr(module, "empty_cache"):
        backend.synchronize()
        module.empty_cache()


def warm_up(backend: hal.Backend, fn: Callable[..., Any], inputs: dict[str, Any], stream: Any,
            runs: int = 1) -> Any:
    """Run ``fn(**inputs)`` ``runs`` times on the capture stream, wait for it, return the last result."""
    result = None
    if runs <= 0:
        return result
    with backend.use_stream(stream):
        for _ in range(runs):
            result = fn(**inputs)
    backend.synchronize(stream)
    return result


def warm_up_checked(backend: hal.Backend, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], *,
                    runs: int, stream: Any, call: str) -> Any:
    """:func:`warm_up` of ``fn(*args, **kwargs)`` for a caller's arguments, checked first; ``stream`` defaults
    to the stream the framework's capture API uses when given none."""
    if not callable(fn):
        raise hal.InvalidArgumentError(f"fn={fn!r} must be callable", backend=backend.name, call=call)
    if not isinstance(runs, int) or isinstance(runs, bool) or runs < 0:
        raise hal.InvalidArgumentError(f"runs={runs!r} must be an int >= 0", backend=backend.name, call=call)
    stream = stream if stream is not None else backend.default_capture_stream()
    return warm_up(backend, functools.partial(fn, *args, **kwargs), {}, stream, runs)


def capture(backend: hal.Backend, fn: Callable[..., Any], inputs: dict[str, Any], lease: Lease,
            stream: Any, *, capture_error_mode: str | None = None, what: str = "capture",
            strict_hygiene: bool = False, verify: Callable[[Any], None] | None = None,
            lazy: bool = False) -> Captured:
    """Capture ``fn(**inputs)`` into a new graph drawing from ``lease``'s pool.

    :param verify: called with the captured graph (recorded with
        ``inspect=True``); it raises to refuse the graph.
    :param lazy: leave the graph uninstantiated (``create_graph(lazy=True)``): an executables budget owns it.

    The graph is released again if the capture fails or is refused.
    """
    before = active_blocks(backend, lease)
    graph = backend.create_graph(lazy=lazy)
    t0 = time.perf_counter()
    outputs: Any = None
    with Transaction() as tx:
        tx.append(lambda: backend.release_graph(graph))
        try:
            with gc_disabled(), torch.no_grad():
                with backend.capture(graph, pool=lease.pool, stream=stream,
                                     capture_error_mode=capture_error_mode, inspect=verify is not None):
                    outputs = fn(**inputs)
            backend.synchronize(stream)
            if verify is not None:
                verify(graph)
        except BaseException as exc:  # not an undo: frees the outputs before the graph goes (the undo)
            # the traceback keeps the finished frames of fn alive, and with them the tensors it made
            # inside the capture: free them now, while their pool and its memory still exist, rather
            # than whenever the garbage collector reaches the traceback
            traceback.clear_frames(exc.__traceback__)
            outputs = None  # this frame outlives the exception's handlers: its outputs must not
            raise
        tx.commit()
    seconds = time.perf_counter() - t0
    try:
        leftovers = leftover_blocks(backend, lease, outputs, before)
        report_leftovers(backend, leftovers, what, strict=strict_hygiene)
    except hal.HalError as exc:  # rejected, or the check itself failed: nobody else holds the graph
        traceback.clear_frames(exc.__traceback__)  # the check's frames hold the outputs too
        outputs = None
        backend.release_graph(graph)
        raise
    return Captured(graph, outputs, seconds, leftovers)
