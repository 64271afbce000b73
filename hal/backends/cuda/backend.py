"""The ``cuda`` backend plugin: driver VMM through cuda-python, graphs and pools through torch.cuda."""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, ClassVar

from hal.api import hookimpl
from hal.backends._native.hooks import TorchHooks
from hal.backends._native.vmm import map_with_access
from hal.backends.cuda.driver import driver_module
from hal.backends.cuda.errors import CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE, NAME, check
from hal.backends.cuda.probe import probe_reason
from hal.errors import InvalidArgumentError, UnsupportedError
from hal.types import GraphAddresses, MemInfo

if TYPE_CHECKING:
    from hal.backends.cuda.torch_glue import CudaGlue

log = logging.getLogger("hal.cuda")


class CudaBackend(TorchHooks):
    """One NVIDIA GPU: its primary context, the driver's VMM calls, torch graphs and pools.

    ``device`` is the CUDA device index (as torch numbers them, so mind
    ``CUDA_VISIBLE_DEVICES``). Allocations, pools and graphs of this instance
    land on that device whatever device is current.

    Mapping cost: ``map`` makes every chunk read-write as it maps it (one
    ``cuMemSetAccess`` per chunk). Inside :meth:`deferred_access`, maps on
    this thread skip it and the block's end makes each contiguous run of new
    mappings accessible with one call.

    Sharing: with ``shareable=True``, chunks are created with a POSIX file descriptor
    handle type (where the device supports one), so that
    :meth:`hal.Backend.export_phy_mem_handle` can hand them to another process
    (``"memory_sharing"``). It is off by default because it changes what NCCL does
    with graph memory: with ``NCCL_CUMEM_ENABLE=1`` (NCCL's default) and
    ``NCCL_GRAPH_REGISTER=1``, NCCL exports the chunks behind a collective's
    buffers captured in a graph to its peers, and keeps them by virtual address
    (see ``docs/engines.md``, tensor parallelism); chunks without a handle type
    make it decline and copy through its own buffers.
    """

    #: for :mod:`hal.testing`: mapped memory is device memory, reached through torch tensors
    hal_requirements: ClassVar[dict[str, Any]] = {"host_accessible": False}
    backend_name = NAME
    torch_extension = "torch"
    torch_device_type = "cuda"

    def __init__(self, device: int = 0, *, shareable: bool = False) -> None:
        from hal.backends.cuda.driver import CudaDevice

        if not isinstance(shareable, bool):
            raise InvalidArgumentError(f"shareable={shareable!r} must be True or False", backend=NAME,
                                       call="get_backend")
        self.device = device
        self.dev = CudaDevice(device, shareable=shareable)
        self._handles: dict[int, Any] = {}  # hal handle -> CUmemGenericAllocationHandle
        self._handle_ids = itertools.count(1)
        self._tls = threading.local()
        self.glue: CudaGlue | None = None  # made on first use: see _current_glue
        self._glue_lock = threading.Lock()
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
    def export_phy_mem_handle(self, handle: int) -> int:
        why = self.dev.unshareable_reason
        if why is not None:
            raise UnsupportedError(f"chunks of this backend cannot be exported: {why}", backend=NAME,
                                   call="export_phy_mem_handle")
        return self.dev.export(self._handles[handle])

    @hookimpl
    def import_phy_mem_handle(self, fd: int, size: int) -> int:
        native = self.dev.import_fd(fd)
        handle = next(self._handle_ids)
        self._handles[handle] = native
        return handle

    @hookimpl
    def map(self, ptr: int, size: int, handle: int) -> None:
        pending = getattr(self._tls, "pending", None)  # inside deferred_access: access comes at its end
        native = self._handles[handle]
        map_with_access(lambda: self.dev.map(ptr, size, native),
                        None if pending is not None else lambda: self.dev.set_access(ptr, size),
                        lambda: self.dev.unmap(ptr, size), backend=NAME, ptr=ptr, access_call="cuMemSetAccess")
        if pending is not None:
            pending.append((ptr, size))

    @hookimpl
    def unmap(self, ptr: int, size: int) -> None:
        pending = getattr(self._tls, "pending", None)
        if pending is not None and (ptr, size) in pending:
            pending.remove((ptr, size))
        self.dev.unmap(ptr, size)

    @hookimpl
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
        except BaseException:  # not an undo: notes the failure, so that the access setting below does not hide it
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
        runs: list[list[int]] = []  # [start, end] of each contiguous run
        for ptr, size in sorted(ranges):
            if runs and ptr == runs[-1][1]:
                runs[-1][1] += size
            else:
                runs.append([ptr, ptr + size])
        for start, end in runs:
            self.dev.set_access(start, end - start)
        return len(runs)

    # -- graphs, streams, pools: the shared hooks of TorchHooks over CudaGlue, plus two of cuda's own

    def _current_glue(self) -> CudaGlue:
        """The torch glue, made on first use (so that the VMM hooks alone never import torch)."""
        glue = self.glue
        if glue is not None:
            return glue
        with self._glue_lock:
            if self.glue is None:
                from hal.backends.cuda.torch_glue import CudaGlue

                glue = CudaGlue(self.device)
                if self._can_read_graphs(glue):
                    from hal.backends.cuda import introspect

                    glue.use_inspector(lambda stream: introspect.addresses_of(int(stream.cuda_stream)))
                self.glue = glue
            return self.glue

    @staticmethod
    def _can_read_graphs(glue: CudaGlue) -> bool:
        """Whether graphs under construction can be read here (the driver calls exist; logged once if not)."""
        if "graphs" not in glue.capabilities:
            return False
        from hal.backends.cuda.introspect import unavailable_reason

        return unavailable_reason() is None

    @hookimpl
    def capabilities(self) -> frozenset[str]:
        """The glue's (``"graph_update"`` where cuda-python has ``cuGraphExecUpdate`` too), plus
        ``"graph_addresses"`` where graphs under construction can be read and ``"memory_sharing"`` where chunks
        are created exportable."""
        glue = self._current_glue()
        caps = glue.capabilities | ({"graph_addresses"} if glue.inspector is not None else set())
        if "graph_update" in caps and not hasattr(driver_module(), "cuGraphExecUpdate"):
            caps -= {"graph_update"}  # torch hands the graphs out, but this cuda-python cannot update them
        return caps | ({"memory_sharing"} if self.dev.unshareable_reason is None else set())

    @hookimpl
    def capture(self, graph: Any, pool: Any, stream: Any, capture_error_mode: str | None,  # type: ignore[override]
                inspect: bool) -> AbstractContextManager[Any]:
        # ``inspect`` has no default: pluggy passes only the arguments an implementation names without one
        return self._current_glue().capture(graph, pool, stream, capture_error_mode, inspect=inspect)

    @hookimpl
    def update_graph(self, graph: Any, source: Any) -> None:
        self._current_glue().update_graph(graph, source, self._exec_update)

    def _exec_update(self, graph_exec: int, source_graph: int, stream: int) -> None:
        """``cuGraphExecUpdate``, then ``cuGraphUpload`` on ``stream`` (the updated executable is put on the device
        before its next launch, as a fresh one is); a refusal for the graphs' topologies is an invalid argument,
        saying why."""
        d = driver_module()
        with self.dev.current():
            err, info = d.cuGraphExecUpdate(d.CUgraphExec(graph_exec), d.CUgraph(source_graph))
            if int(err) == CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE:
                why = getattr(getattr(info, "result", None), "name", None) or repr(getattr(info, "result", info))
                raise InvalidArgumentError(f"source's topology differs from graph's: the driver refused the update "
                                           f"({why}); capture it into a graph of its own", backend=NAME,
                                           call="update_graph")
            check((err,), "cuGraphExecUpdate", "update_graph")
            check((d.cuGraphUpload(d.CUgraphExec(graph_exec), d.CUstream(stream))[0],), "cuGraphUpload",
                  "update_graph")

    @hookimpl
    def graph_addresses(self, graph: Any) -> GraphAddresses:
        return self._current_glue().graph_addresses(graph)

    @hookimpl
    def use_pool(self, pool: Any) -> AbstractContextManager[None]:
        return self._current_glue().use_pool(pool)

    @hookimpl
    def tensor_at(self, ptr: int, nbytes: int, owner: Any) -> Any:
        return self._current_glue().tensor_at(ptr, nbytes, owner)

    # -- lifecycle -------------------------------------------------------------------

    @hookimpl
    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._handles:
            log.warning("cuda: shutdown with %d chunk(s) still live", len(self._handles))
        self.dev.release_context()
