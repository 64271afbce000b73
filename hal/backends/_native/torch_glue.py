"""A torch device extension (torch_npu, torch_mlu) behind the graph, stream and pool hooks.

The extensions mirror ``torch.cuda`` under another device type: ``Stream``,
``graph``, ``graph_pool_handle``, a graph class, and -- in some builds -- a
``MemPool`` over a custom allocator. A vendor subclass of :class:`TorchGlue`
names them (:class:`TorchExtension`), picks the default capture mode and
recognises its own capture failures. torch and the extension are imported
only when a glue is created.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
from dataclasses import dataclass
from typing import Any, ClassVar, ContextManager, Iterator

from hal.api import AllocFn, FreeFn
from hal.backends._native.callbacks import address_of, allocator_callbacks
from hal.backends._native.routing import GraphClassRouting, routable, routing_for
from hal.gcguard import gc_disabled
from hal.errors import CaptureError, UnsupportedError


@dataclass(frozen=True)
class TorchExtension:
    """The names a torch device extension uses."""

    #: module to import, e.g. ``torch_npu``
    module: str
    #: device type and namespace (``torch.<device_type>``), e.g. ``npu``
    device_type: str
    #: graph class in that namespace, e.g. ``NPUGraph``
    graph_class: str
    #: the extension's compiled module, e.g. ``_C``
    internals: str
    #: the custom-allocator entry point in it, e.g. ``_npu_customAllocator``
    custom_allocator: str

    def capabilities(self, ext: Any, ns: Any) -> frozenset[str]:
        """``"graphs"``; ``"custom_pool"`` where both MemPool and the custom allocator exist;
        ``"capture_routing"`` where the graph class has ``capture_begin``/``capture_end``."""
        caps = set()
        if all(hasattr(ns, a) for a in (self.graph_class, "graph", "graph_pool_handle")):
            caps.add("graphs")
            if routable(getattr(ns, self.graph_class)):
                caps.add("capture_routing")
        if hasattr(ns, "MemPool") and hasattr(getattr(ext, self.internals, None), self.custom_allocator):
            caps.add("custom_pool")
        return frozenset(caps)


@dataclass(eq=False)
class TorchPool:
    """A pool for captures: ``id`` is what ``torch.<device>.graph(pool=...)`` takes."""

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


class TorchGlue:
    """The torch side of one device of a vendor backend."""

    #: the backend's name, as errors and log records carry it
    backend: ClassVar[str]
    extension: ClassVar[TorchExtension]
    #: the capture mode used when the caller asks for none
    default_capture_mode: ClassVar[str]
    #: why ``create_pool`` with callbacks is refused when ``"custom_pool"`` is absent
    no_custom_pool: ClassVar[str]

    def __init__(self, device: int, ext: Any = None) -> None:
        import torch

        names = self.extension
        self.torch = torch
        self.ext = ext if ext is not None else importlib.import_module(names.module)
        self.ns = getattr(self.ext, names.device_type, None) or getattr(torch, names.device_type)
        self.device = device
        self.capabilities = names.capabilities(self.ext, self.ns)
        self._no_snapshot_logged = False
        self.ns.set_device(device)
        self.routing: GraphClassRouting | None = None
        if "capture_routing" in self.capabilities:
            self.routing = routing_for(getattr(self.ns, names.graph_class), self.ns.current_device,
                                       lambda pool: pool.id)

    def capture_error(self, exc: BaseException) -> CaptureError | None:
        """The :class:`hal.CaptureError` that ``exc`` from a capture stands for, or None."""
        return None

    def torch_device(self) -> Any:
        return self.torch.device(self.extension.device_type, self.device)

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

    def create_pool(self, alloc: AllocFn | None, free: FreeFn | None) -> TorchPool:
        if alloc is None or free is None:
            return TorchPool(id=self.ns.graph_pool_handle())
        if "custom_pool" not in self.capabilities:
            raise UnsupportedError(self.no_custom_pool, backend=self.backend, call="create_pool")
        callbacks = allocator_callbacks(alloc, free, backend=self.backend)
        custom_allocator = getattr(getattr(self.ext, self.extension.internals), self.extension.custom_allocator)
        mempool = self.ns.MemPool(custom_allocator(*map(address_of, callbacks)))
        return TorchPool(id=mempool.id, mempool=mempool, callbacks=callbacks)

    def pool_active_blocks(self, pool: TorchPool) -> list[tuple[int, int]]:
        if pool.mempool is not None and hasattr(pool.mempool, "snapshot"):
            return active_blocks(pool.mempool.snapshot())
        if hasattr(self.ns, "memory_snapshot"):
            want = tuple(pool.id)
            return active_blocks([s for s in self.ns.memory_snapshot()
                                  if tuple(s.get("segment_pool_id", ())) == want])
        if not self._no_snapshot_logged:
            logging.getLogger(f"hal.{self.backend}").info(
                "%s: this %s has no memory snapshot API; pool_active_blocks reports nothing",
                self.backend, self.extension.module)
            self._no_snapshot_logged = True
        return []

    def release_pool(self, pool: TorchPool) -> None:
        pool.mempool = None  # torch frees the segments once no graph holds the pool
        pool.released = True

    def create_graph(self) -> Any:
        return getattr(self.ns, self.extension.graph_class)()

    def route_captures(self, router: Any) -> ContextManager[None]:
        if self.routing is None:
            raise UnsupportedError(f"{self.extension.module}'s {self.extension.graph_class} has no "
                                   "capture_begin/capture_end to route", backend=self.backend, call="route_captures")
        return self.routing.activate(self.device, router)

    def default_capture_stream(self) -> Any:
        """The side stream ``torch.<device>.graph`` captures on when given none (made as torch would)."""
        graph_cm = self.ns.graph
        if getattr(graph_cm, "default_capture_stream", None) is None:
            try:
                graph_cm.default_capture_stream = self.create_stream()
            except (AttributeError, TypeError):  # not a class: captures run on the current stream
                return self.current_stream()
        return graph_cm.default_capture_stream

    @contextlib.contextmanager
    def capture(self, graph: Any, pool: TorchPool | None, stream: Any,
                capture_error_mode: str | None) -> Iterator[Any]:
        """``torch.<device>.graph`` with GC off (hazard: Python in the allocator callbacks) and
        the failures :meth:`capture_error` recognises turned into :class:`hal.CaptureError`."""
        if self.routing is not None:  # inside route_captures the router chooses the pool
            pool = self.routing.begin(graph, pool, self.device) or pool
        try:
            with gc_disabled(), self.ns.graph(graph, pool=None if pool is None else pool.id, stream=stream,
                                              capture_error_mode=capture_error_mode or self.default_capture_mode):
                yield graph
        except Exception as exc:
            translated = self.capture_error(exc)
            if translated is None:
                raise
            raise translated from exc

    def replay(self, graph: Any) -> None:
        graph.replay()

    def release_graph(self, graph: Any) -> None:
        graph.reset()
