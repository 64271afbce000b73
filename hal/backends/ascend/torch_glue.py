"""torch_npu behind the graph, stream and pool hooks of the ascend backend.

Imported only when an ascend backend is opened with torch_npu installed
(``torch.npu`` is ``torch_npu.npu``). Pools over hal allocator callbacks go
through ``torch_npu._C._npu_customAllocator`` and ``torch.npu.MemPool``, which
older torch_npu builds lack: :func:`capabilities` reports what this build has.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import importlib
import logging
import re
from dataclasses import dataclass
from typing import Any, ContextManager, Iterator

from hal.api import AllocFn, FreeFn
from hal.backends.ascend.lib import ACL_ERROR_RT_NO_STREAM_RESOURCE, NAME
from hal.errors import CaptureError, UnsupportedError

log = logging.getLogger("hal.ascend")

#: ``void* alloc(size_t size, int device, aclrtStream stream)``
ALLOC_FN = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)
#: ``void free(void* ptr, size_t size, int device, aclrtStream stream)``
FREE_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)

#: every callback pair ever handed to torch_npu: it may call them until the process ends
_KEEP_ALIVE: list[tuple[Any, Any]] = []

_STREAMS_EXHAUSTED = re.compile(
    rf"\b{ACL_ERROR_RT_NO_STREAM_RESOURCE}\b|ACL_ERROR_RT_NO_STREAM_RESOURCE|"
    r"stream resources? (are|is) insufficient|no stream resource", re.IGNORECASE)


def allocator_callbacks(alloc: AllocFn, free: FreeFn) -> tuple[Any, Any]:
    """C callbacks with torch_npu's allocator signatures around ``alloc`` and ``free``.

    They never let an exception out (a failed ``alloc`` returns NULL, so torch
    raises its own out-of-memory error; the exception is logged) and they stay
    alive for the lifetime of the process.
    """

    def c_alloc(size: int, device: int, stream: Any) -> int | None:
        try:
            return int(alloc(size)) or None
        except BaseException:  # noqa: BLE001 - nothing may cross into C
            log.exception("%s: allocator callback failed for %d bytes; returning NULL", NAME, size)
            return None

    def c_free(ptr: int | None, size: int, device: int, stream: Any) -> None:
        try:
            free(ptr or 0, size)
        except BaseException:  # noqa: BLE001 - nothing may cross into C
            log.exception("%s: free callback failed for %d bytes at %#x", NAME, size, ptr or 0)

    pair = (ALLOC_FN(c_alloc), FREE_FN(c_free))
    _KEEP_ALIVE.append(pair)
    return pair


def address_of(callback: Any) -> int:
    """The C function pointer of a ctypes callback, as torch's ``_customAllocator`` wants it."""
    return ctypes.cast(callback, ctypes.c_void_p).value or 0


def stream_exhaustion(exc: BaseException) -> CaptureError | None:
    """A :class:`hal.CaptureError` with advice when ``exc`` says the NPU ran out of streams."""
    if not _STREAMS_EXHAUSTED.search(str(exc)):
        return None
    return CaptureError(
        f"graph capture ran out of NPU streams (ACL_ERROR_RT_NO_STREAM_RESOURCE = "
        f"{ACL_ERROR_RT_NO_STREAM_RESOURCE}): a device has about 2048 streams, roughly 1800 graphs, and "
        "piecewise graphs cost num_layers + 1 graphs per captured size. Capture fewer sizes, or full graphs "
        f"instead of piecewise ones. [{type(exc).__name__}: {exc}]",
        backend=NAME, call="capture")


def capabilities(ext: Any, ns: Any) -> frozenset[str]:
    """What this torch_npu build offers: ``"graphs"``, and ``"custom_pool"`` where MemPool exists."""
    caps = set()
    if all(hasattr(ns, a) for a in ("NPUGraph", "graph", "graph_pool_handle")):
        caps.add("graphs")
    if hasattr(ns, "MemPool") and hasattr(getattr(ext, "_C", None), "_npu_customAllocator"):
        caps.add("custom_pool")
    return frozenset(caps)


@dataclass(eq=False)
class NpuPool:
    """A pool for captures: ``id`` is what ``torch.npu.graph(pool=...)`` takes."""

    id: Any
    mempool: Any = None
    callbacks: tuple[Any, Any] | None = None
    released: bool = False


def active_blocks(segments: list[dict]) -> list[tuple[int, int]]:
    """``(address, size)`` of every allocated block in a torch memory snapshot."""
    found = []
    for seg in segments:
        at = int(seg.get("address", 0))
        for block in seg.get("blocks", ()):
            addr = int(block.get("address", at))
            if block.get("state") == "active_allocated":
                found.append((addr, int(block["size"])))
            at = addr + int(block["size"])
    return sorted(found)


class NpuGlue:
    """The torch side of one ascend device."""

    def __init__(self, device: int, ext: Any = None) -> None:
        import torch

        self.torch = torch
        self.ext = ext if ext is not None else importlib.import_module("torch_npu")
        self.ns = getattr(self.ext, "npu", None) or getattr(torch, "npu")
        self.device = device
        self.capabilities = capabilities(self.ext, self.ns)
        self._no_snapshot_logged = False
        self.ns.set_device(device)

    def torch_device(self) -> Any:
        return self.torch.device("npu", self.device)

    def create_stream(self) -> Any:
        return self.ns.Stream(device=self.torch_device())

    def current_stream(self) -> Any:
        return self.ns.current_stream(self.torch_device())

    def use_stream(self, stream: Any) -> ContextManager[Any]:
        return self.ns.stream(stream)

    def synchronize(self, stream: Any) -> None:
        if stream is None:
            self.ns.synchronize(self.torch_device())
        else:
            stream.synchronize()

    def create_pool(self, alloc: AllocFn | None, free: FreeFn | None) -> NpuPool:
        if alloc is None or free is None:
            return NpuPool(id=self.ns.graph_pool_handle())
        if "custom_pool" not in self.capabilities:
            raise UnsupportedError("this torch_npu has no MemPool or _npu_customAllocator "
                                   "(it arrived with the builds for torch 2.5.1 alpha002 / 7.0.0)",
                                   backend=NAME, call="create_pool")
        callbacks = allocator_callbacks(alloc, free)
        allocator = self.ext._C._npu_customAllocator(*map(address_of, callbacks))
        mempool = self.ns.MemPool(allocator)
        return NpuPool(id=mempool.id, mempool=mempool, callbacks=callbacks)

    def pool_active_blocks(self, pool: NpuPool) -> list[tuple[int, int]]:
        if pool.mempool is not None and hasattr(pool.mempool, "snapshot"):
            return active_blocks(pool.mempool.snapshot())
        if hasattr(self.ns, "memory_snapshot"):
            want = tuple(pool.id)
            return active_blocks([s for s in self.ns.memory_snapshot()
                                  if tuple(s.get("segment_pool_id", ())) == want])
        if not self._no_snapshot_logged:
            log.info("%s: this torch_npu has no memory snapshot API; pool_active_blocks reports nothing", NAME)
            self._no_snapshot_logged = True
        return []

    def release_pool(self, pool: NpuPool) -> None:
        pool.mempool = None  # torch frees the segments once no graph holds the pool
        pool.released = True

    def create_graph(self) -> Any:
        return self.ns.NPUGraph()

    @contextlib.contextmanager
    def capture(self, graph: Any, pool: NpuPool | None, stream: Any, capture_error_mode: str) -> Iterator[Any]:
        """``torch.npu.graph`` with GC off (hazard: Python in the allocator callbacks) and
        stream exhaustion turned into :class:`hal.CaptureError`."""
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            with self.ns.graph(graph, pool=None if pool is None else pool.id, stream=stream,
                               capture_error_mode=capture_error_mode):
                yield graph
        except Exception as exc:
            translated = stream_exhaustion(exc)
            if translated is None:
                raise
            raise translated from exc
        finally:
            if gc_was_enabled:
                gc.enable()

    def replay(self, graph: Any) -> None:
        graph.replay()

    def release_graph(self, graph: Any) -> None:
        graph.reset()
