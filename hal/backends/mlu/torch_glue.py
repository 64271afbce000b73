"""torch_mlu behind the graph, stream and pool hooks of the mlu backend.

Imported only when an mlu backend is opened with torch_mlu installed. torch_mlu
has ``torch.mlu.MLUGraph`` and ``torch_mlu._MLUC._mlu_customAllocator`` but no
public ``MemPool``, so a pool over hal allocator callbacks is not possible
there: :func:`capabilities` reports ``"custom_pool"`` only for a build that
has both, and graphkit falls back to a shared pool otherwise.

Capture mode: torch_mlu's own default is ``"relaxed"``; this glue passes on
the mode the caller asks for and uses ``"relaxed"`` when none is given.
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
from hal.backends.mlu.lib import CAPTURE_CODES, CODE_NAMES, NAME
from hal.errors import CaptureError, UnsupportedError

log = logging.getLogger("hal.mlu")

DEFAULT_CAPTURE_MODE = "relaxed"

#: ``void* alloc(size_t size, int device, cnrtQueue_t queue)``
ALLOC_FN = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)
#: ``void free(void* ptr, size_t size, int device, cnrtQueue_t queue)``
FREE_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)

#: every callback pair ever handed to torch_mlu: it may call them until the process ends
_KEEP_ALIVE: list[tuple[Any, Any]] = []

_CAPTURE_FAILURE = re.compile(
    "|".join([rf"\b{c}\b" for c in sorted(CAPTURE_CODES)] + [CODE_NAMES[c] for c in sorted(CAPTURE_CODES)]))


def allocator_callbacks(alloc: AllocFn, free: FreeFn) -> tuple[Any, Any]:
    """C callbacks with torch_mlu's allocator signatures around ``alloc`` and ``free``.

    They never let an exception out (a failed ``alloc`` returns NULL, so torch
    raises its own out-of-memory error; the exception is logged) and they stay
    alive for the lifetime of the process.
    """

    def c_alloc(size: int, device: int, queue: Any) -> int | None:
        try:
            return int(alloc(size)) or None
        except BaseException:  # noqa: BLE001 - nothing may cross into C
            log.exception("%s: allocator callback failed for %d bytes; returning NULL", NAME, size)
            return None

    def c_free(ptr: int | None, size: int, device: int, queue: Any) -> None:
        try:
            free(ptr or 0, size)
        except BaseException:  # noqa: BLE001 - nothing may cross into C
            log.exception("%s: free callback failed for %d bytes at %#x", NAME, size, ptr or 0)

    pair = (ALLOC_FN(c_alloc), FREE_FN(c_free))
    _KEEP_ALIVE.append(pair)
    return pair


def address_of(callback: Any) -> int:
    """The C function pointer of a ctypes callback, as ``_mlu_customAllocator`` wants it."""
    return ctypes.cast(callback, ctypes.c_void_p).value or 0


def capture_failure(exc: BaseException) -> CaptureError | None:
    """A :class:`hal.CaptureError` when ``exc`` carries one of CNDrv's queue-capture errors."""
    match = _CAPTURE_FAILURE.search(str(exc))
    if match is None:
        return None
    return CaptureError(
        f"the MLU refused the capture ({match.group(0)}): a host synchronisation, a foreign queue or "
        "another thread touched the capturing queue; move that work out of the captured region "
        f"[{type(exc).__name__}: {exc}]", backend=NAME, call="capture")


def capabilities(ext: Any, ns: Any) -> frozenset[str]:
    """What this torch_mlu build offers: ``"graphs"``, and ``"custom_pool"`` only where MemPool exists."""
    caps = set()
    if all(hasattr(ns, a) for a in ("MLUGraph", "graph", "graph_pool_handle")):
        caps.add("graphs")
    if hasattr(ns, "MemPool") and hasattr(getattr(ext, "_MLUC", None), "_mlu_customAllocator"):
        caps.add("custom_pool")
    return frozenset(caps)


@dataclass(eq=False)
class MluPool:
    """A pool for captures: ``id`` is what ``torch.mlu.graph(pool=...)`` takes."""

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


class MluGlue:
    """The torch side of one MLU device."""

    def __init__(self, device: int, ext: Any = None) -> None:
        import torch

        self.torch = torch
        self.ext = ext if ext is not None else importlib.import_module("torch_mlu")
        self.ns = getattr(self.ext, "mlu", None) or getattr(torch, "mlu")
        self.device = device
        self.capabilities = capabilities(self.ext, self.ns)
        self._no_snapshot_logged = False
        self.ns.set_device(device)

    def torch_device(self) -> Any:
        return self.torch.device("mlu", self.device)

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

    def create_pool(self, alloc: AllocFn | None, free: FreeFn | None) -> MluPool:
        if alloc is None or free is None:
            return MluPool(id=self.ns.graph_pool_handle())
        if "custom_pool" not in self.capabilities:
            raise UnsupportedError("torch_mlu has no public MemPool: pools over allocator callbacks are "
                                   "not possible; use a shared pool", backend=NAME, call="create_pool")
        callbacks = allocator_callbacks(alloc, free)
        allocator = self.ext._MLUC._mlu_customAllocator(*map(address_of, callbacks))
        mempool = self.ns.MemPool(allocator)
        return MluPool(id=mempool.id, mempool=mempool, callbacks=callbacks)

    def pool_active_blocks(self, pool: MluPool) -> list[tuple[int, int]]:
        if pool.mempool is not None and hasattr(pool.mempool, "snapshot"):
            return active_blocks(pool.mempool.snapshot())
        if hasattr(self.ns, "memory_snapshot"):
            want = tuple(pool.id)
            return active_blocks([s for s in self.ns.memory_snapshot()
                                  if tuple(s.get("segment_pool_id", ())) == want])
        if not self._no_snapshot_logged:
            log.info("%s: this torch_mlu has no memory snapshot API; pool_active_blocks reports nothing", NAME)
            self._no_snapshot_logged = True
        return []

    def release_pool(self, pool: MluPool) -> None:
        pool.mempool = None  # torch frees the segments once no graph holds the pool
        pool.released = True

    def create_graph(self) -> Any:
        return self.ns.MLUGraph()

    @contextlib.contextmanager
    def capture(self, graph: Any, pool: MluPool | None, stream: Any,
                capture_error_mode: str | None) -> Iterator[Any]:
        """``torch.mlu.graph`` with GC off (hazard: Python in the allocator callbacks) and
        CNDrv's capture errors turned into :class:`hal.CaptureError`."""
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            with self.ns.graph(graph, pool=None if pool is None else pool.id, stream=stream,
                               capture_error_mode=capture_error_mode or DEFAULT_CAPTURE_MODE):
                yield graph
        except Exception as exc:
            translated = capture_failure(exc)
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
