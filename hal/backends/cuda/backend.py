"""The ``cuda`` backend plugin: driver VMM through cuda-python, graphs and pools through torch.cuda."""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
from typing import Any, ContextManager, Iterator

from hal.api import AllocFn, FreeFn, hookimpl
from hal.backends.cuda.probe import probe_reason
from hal.types import MemInfo

log = logging.getLogger("hal.cuda")

NAME = "cuda"
#: torch.cuda.graph's own default
DEFAULT_CAPTURE_ERROR_MODE = "global"


class CudaBackend:
    """One NVIDIA GPU: its primary context, the driver's VMM calls, torch graphs and pools.

    ``device`` is the CUDA device index (as torch numbers them, so mind
    ``CUDA_VISIBLE_DEVICES``). Allocations, pools and graphs of this instance
    land on that device whatever device is current.

    Mapping cost: ``map`` makes every chunk read-write as it maps it (one
    ``cuMemSetAccess`` per chunk). Inside :meth:`deferred_access`, maps on
    this thread skip it and the block's end makes each contiguous run of new
    mappings accessible with one call.
    """

    #: for :mod:`hal.testing`: mapped memory is device memory, reached through torch tensors
    hal_requirements = {"host_accessible": False}

    def __init__(self, device: int = 0) -> None:
        from hal.backends.cuda.driver import CudaDevice

        self.device = device
        self.dev = CudaDevice(device)
        self._handles: dict[int, Any] = {}  # hal handle -> CUmemGenericAllocationHandle
        self._handle_ids = itertools.count(1)
        self._tls = threading.local()
        self._capture_stream: Any = None
        self._closed = False

    @classmethod
    def probe(cls) -> str | None:
        return probe_reason()

    def __repr__(self) -> str:
        return f"<CudaBackend device={self.device}>"

    # -- queries -----------------------------------------------------------------

    @hookimpl
    def device_count(self) -> int:
        return self.dev.count

    @hookimpl
    def granularity(self, recommended: bool) -> int:
        return self.dev.granularity(recommended)

    @hookimpl
    def mem_info(self) -> MemInfo:
        return self.dev.mem_info()

    # -- vmm -----------------------------------------------------------------------

    @hookimpl
    def create_vir_ptr(self, size: int) -> int:
        return self.dev.reserve(size, self.dev.granularity(False))

    @hookimpl
    def release_vir_ptr(self, ptr: int, size: int) -> None:
        self.dev.address_free(ptr, size)

    @hookimpl
    def create_phy_mem_handle(self, size: int) -> int:
        native = self.dev.create(size)
        handle = next(self._handle_ids)  # small, stable ids; the driver's values vary run to run
        self._handles[handle] = native
        return handle

    @hookimpl
    def release_phy_mem_handle(self, handle: int) -> None:
        self.dev.release(self._handles[handle])
        del self._handles[handle]

    @hookimpl
    def map(self, ptr: int, size: int, handle: int) -> None:
        self.dev.map(ptr, size, self._handles[handle])
        pending = getattr(self._tls, "pending", None)
        if pending is not None:
            pending.append((ptr, size))
            return
        try:
            self.dev.set_access(ptr, size)
        except BaseException:
            self._undo_map(ptr, size)
            raise

    @hookimpl
    def unmap(self, ptr: int, size: int) -> None:
        pending = getattr(self._tls, "pending", None)
        if pending is not None and (ptr, size) in pending:
            pending.remove((ptr, size))
        self.dev.unmap(ptr, size)

    def _undo_map(self, ptr: int, size: int) -> None:
        try:
            self.dev.unmap(ptr, size)
        except Exception as exc:  # the first failure is the one to report
            log.error("cuda: undoing the map at %#x after a failed cuMemSetAccess: %s", ptr, exc)

    @contextlib.contextmanager
    def deferred_access(self) -> Iterator[None]:
        """Batch access-setting: maps inside the block get read-write access at its end.

        Memory mapped inside the block must not be touched before the block
        ends. Contiguous mappings get one ``cuMemSetAccess`` per run.
        Nested blocks join the outermost one.
        """
        if getattr(self._tls, "pending", None) is not None:
            yield
            return
        self._tls.pending = []
        failed = False
        try:
            yield
        except BaseException:
            failed = True
            raise
        finally:
            pending, self._tls.pending = self._tls.pending, None
            try:
                self.set_access_runs(pending)
            except Exception as exc:
                if not failed:
                    raise
                log.error("cuda: setting access after a failed batch of maps: %s", exc)

    def set_access_runs(self, ranges: list[tuple[int, int]]) -> int:
        """Make ``ranges`` read-write, one driver call per contiguous run; return the number of calls."""
        calls = 0
        start = end = None
        for ptr, size in sorted(ranges):
            if start is not None and ptr == end:
                end += size
                continue
            if start is not None:
                self.dev.set_access(start, end - start)
                calls += 1
            start, end = ptr, ptr + size
        if start is not None:
            self.dev.set_access(start, end - start)
            calls += 1
        return calls

    # -- graphs, streams, pools --------------------------------------------------------

    @hookimpl
    def capabilities(self) -> frozenset[str]:
        from hal.backends.cuda.torch_pool import custom_pool_unavailable_reason

        reason = custom_pool_unavailable_reason()
        if reason is not None:
            log.warning("cuda: no pools over allocator callbacks: %s", reason)
            return frozenset({"graphs", "capture_routing"})
        return frozenset({"graphs", "custom_pool", "capture_routing", "use_pool"})

    @hookimpl
    def torch_device(self) -> Any:
        import torch

        return torch.device("cuda", self.device)

    @hookimpl
    def create_stream(self) -> Any:
        import torch

        return torch.cuda.Stream(device=self.device)

    @hookimpl
    def current_stream(self) -> Any:
        import torch

        return torch.cuda.current_stream(self.device)

    @hookimpl
    def use_stream(self, stream: Any) -> ContextManager[Any]:
        import torch

        return torch.cuda.stream(stream)  # also makes the stream's device current

    @hookimpl
    def synchronize(self, stream: Any) -> None:
        import torch

        if stream is None:
            torch.cuda.synchronize(self.device)
        else:
            stream.synchronize()

    @hookimpl
    def create_pool(self, alloc: AllocFn | None, free: FreeFn | None) -> Any:
        from hal.backends.cuda import torch_pool

        if alloc is None or free is None:
            return torch_pool.create_device_pool(self.device)
        return torch_pool.create_custom_pool(alloc, free, self.device)

    @hookimpl
    def use_pool(self, pool: Any) -> ContextManager[None]:
        import torch

        if pool.mempool is None:
            from hal.errors import UnsupportedError

            raise UnsupportedError(f"{pool!r} is not a torch.cuda.MemPool", backend="cuda", call="use_pool")
        return torch.cuda.use_mem_pool(pool.mempool, device=self.device)

    @hookimpl
    def tensor_at(self, ptr: int, nbytes: int, owner: Any) -> Any:
        import torch

        class _Memory:  # what torch.as_tensor reads; the tensor's storage keeps this object (and owner) alive
            __cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                        "version": 3, "strides": None}

        memory = _Memory()
        memory.owner = owner  # type: ignore[attr-defined]
        return torch.as_tensor(memory, device=torch.device("cuda", self.device))

    @hookimpl
    def pool_active_blocks(self, pool: Any) -> list[tuple[int, int]]:
        from hal.backends.cuda import torch_pool

        return torch_pool.active_blocks(pool)

    @hookimpl
    def release_pool(self, pool: Any) -> None:
        from hal.backends.cuda import torch_pool

        torch_pool.release(pool)

    @hookimpl
    def create_graph(self) -> Any:
        from hal.backends.cuda import graph

        return graph.new_graph(self.device)

    @hookimpl
    def capture(self, graph: Any, pool: Any, stream: Any, capture_error_mode: str | None) -> ContextManager[Any]:
        from hal.backends.cuda import graph as graphs

        if stream is None:
            if self._capture_stream is None:
                self._capture_stream = self.create_stream()
            stream = self._capture_stream
        return graphs.capture(graph, pool, stream, capture_error_mode or DEFAULT_CAPTURE_ERROR_MODE)

    @hookimpl
    def route_captures(self, router: Any) -> ContextManager[None]:
        from hal.backends.cuda import graph as graphs

        return graphs.routing().activate(self.device, router)

    @hookimpl
    def default_capture_stream(self) -> Any:
        from hal.backends.cuda import graph as graphs

        return graphs.default_capture_stream(self.device)

    @hookimpl
    def replay(self, graph: Any) -> None:
        from hal.backends.cuda import graph as graphs

        graphs.replay(graph)

    @hookimpl
    def release_graph(self, graph: Any) -> None:
        from hal.backends.cuda import graph as graphs

        graphs.release(graph)

    # -- lifecycle -------------------------------------------------------------------

    @hookimpl
    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._handles:
            log.warning("cuda: shutdown with %d chunk(s) still live", len(self._handles))
        self.dev.release_context()
