"""torch.cuda behind the graph, stream and pool hooks of the cuda backend.

The plumbing is shared with torch_npu and torch_mlu
(:mod:`hal.backends._native.torch_glue`): streams, pools over the allocator
callbacks of :mod:`hal.backends._native.callbacks`, memory snapshots, capture
routing. What is cuda's own is here: the names, the ``"global"`` capture
mode, a device entered around every call (one process drives several GPUs,
and a backend must not change the current one), the conditions under which a
``torch.cuda.MemPool`` takes segments from Python callbacks, and the graph
lifecycle of :mod:`hal.backends.cuda.graph`, and -- where the backend gives
it a stream inspector (:meth:`CudaGlue.use_inspector`) -- the addresses of
graphs read at their capture. torch is imported only when a glue is created.
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager
from typing import Any, ClassVar

from hal.backends._native import torch_compat as compat
from hal.backends._native.torch_glue import TorchExtension, TorchGlue, TorchPool
from hal.backends.cuda import graph as graphs
from hal.backends.cuda.errors import NAME
from hal.errors import UnsupportedError
from hal.types import GraphAddresses

log = logging.getLogger("hal.cuda")

EXTENSION = TorchExtension(module="torch", device_type="cuda", graph_class="CUDAGraph", scoped=True)


class CudaGlue(TorchGlue):
    """The torch side of one NVIDIA GPU."""

    backend = NAME
    extension = EXTENSION
    default_capture_mode = "global"  # torch.cuda.graph's own default
    no_custom_pool = "this torch has no torch.cuda.MemPool over a custom allocator"

    def __init__(self, device: int, ext: Any = None) -> None:
        """:param ext: a stand-in for the torch module (tests); torch itself by default."""
        super().__init__(device, ext)
        self._capture_stream: Any = None
        self.inspector: graphs.StreamInspector | None = None

    def use_inspector(self, inspector: graphs.StreamInspector | None) -> None:
        """Read graphs under construction with ``inspector(stream)``: captures with ``inspect=True``
        and routed captures whose route asks for it (the routing of torch's graph class is shared by
        every device, and so is its inspector)."""
        self.inspector = inspector
        if self.routing is not None:
            self.routing.set_inspector(None if inspector is None else self._inspect_current)

    def _inspect_current(self, torch_graph: Any) -> GraphAddresses:
        """What the graph being captured on the current stream uses (torch ends a capture there)."""
        assert self.inspector is not None
        return self.inspector(self.ns.current_stream())

    # -- what this torch offers ---------------------------------------------------------------

    def find_capabilities(self) -> frozenset[str]:
        """The shared ones, plus ``"use_pool"`` wherever ``"custom_pool"`` works."""
        problem = self.custom_pool_problem()
        caps = super().find_capabilities()
        if problem is not None:
            log.warning("cuda: no pools over allocator callbacks: %s", problem)
            return caps
        return caps | {"use_pool"}

    def custom_pool_problem(self) -> str | None:
        """Also: torch before 2.8 does not route a graph pool's segments to a MemPool's allocator, and
        only the native caching allocator (not cudaMallocAsync) takes segments from one."""
        torch = self.torch
        if compat.torch_version(torch) < compat.MIN_TORCH_FOR_CUSTOM_POOL:
            return (f"torch {torch.__version__} is older than 2.8: its graph pools do not route "
                    "segment allocations to a custom allocator")
        missing = super().custom_pool_problem()
        if missing is not None:
            return missing
        backend = self.ns.get_allocator_backend()
        if backend != "native":
            return (f"torch's CUDA allocator backend is {backend!r} (PYTORCH_CUDA_ALLOC_CONF); its pools "
                    "cannot take segments from a custom allocator: use the native backend")
        return None

    # -- pools ---------------------------------------------------------------------------------

    def release_device_pool(self, pool: TorchPool) -> None:
        self.ns.empty_cache()  # a handle-only pool's segments are freed with the device's cache

    def use_pool(self, pool: TorchPool) -> AbstractContextManager[None]:
        """The framework's allocations on this thread inside the block come from ``pool``'s MemPool."""
        if pool.mempool is None:
            raise UnsupportedError(f"{pool!r} is not a torch.cuda.MemPool", backend=NAME, call="use_pool")
        return self.ns.use_mem_pool(pool.mempool, device=self.device)

    def tensor_at(self, ptr: int, nbytes: int, owner: Any) -> Any:
        """A ``torch.uint8`` tensor over ``nbytes`` at ``ptr``; its storage keeps ``owner`` alive."""

        class _Memory:  # what torch.as_tensor reads; the tensor's storage keeps this object (and owner) alive
            __cuda_array_interface__: ClassVar[dict[str, Any]] = {
                "shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3, "strides": None}

        memory = _Memory()
        memory.owner = owner  # type: ignore[attr-defined]
        return self.torch.as_tensor(memory, device=self.torch_device())

    # -- graphs --------------------------------------------------------------------------------

    def create_graph(self) -> graphs.CudaGraph:
        return graphs.CudaGraph(super().create_graph(), self.device)

    def capture(self, graph: graphs.CudaGraph, pool: TorchPool | None, stream: Any,
                capture_error_mode: str | None, inspect: bool = False) -> AbstractContextManager[graphs.CudaGraph]:
        """:func:`hal.backends.cuda.graph.capture`, on a stream of this backend's own when given none.

        :param inspect: record what the graph uses (:meth:`graph_addresses`); needs an inspector.
        """
        if inspect and self.inspector is None:
            raise UnsupportedError("inspect=True: this glue has no way to read a graph under construction",
                                   backend=NAME, call="capture")
        if stream is None:
            if self._capture_stream is None:
                self._capture_stream = self.create_stream()
            stream = self._capture_stream
        return graphs.capture(self, graph, pool, stream, capture_error_mode or self.default_capture_mode,
                              self.inspector if inspect else None)

    def graph_addresses(self, graph: Any) -> GraphAddresses:
        """What ``graph`` (a :class:`~hal.backends.cuda.graph.CudaGraph` or a ``torch.cuda.CUDAGraph``)
        uses, as recorded at its capture."""
        return graphs.addresses(graph)

    def replay(self, graph: graphs.CudaGraph) -> None:
        graphs.replay(self, graph)

    def release_graph(self, graph: graphs.CudaGraph) -> None:
        graphs.release(self, graph)
