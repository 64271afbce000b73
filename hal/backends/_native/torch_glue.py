"""A torch device namespace (``torch.cuda``, ``torch.npu``, ``torch.mlu``) behind the graph, stream and pool hooks.

torch.cuda and the extensions that mirror it under another device type
(torch_npu, torch_mlu) have the same shape: ``Stream``, ``graph``,
``graph_pool_handle``, a graph class, ``memory_snapshot`` and -- in some
builds -- a ``MemPool`` over a custom allocator. A vendor subclass of
:class:`TorchGlue` names them (:class:`TorchExtension`), picks the default
capture mode and recognises its own capture failures; every vendor captures
through :mod:`hal.backends._native.capture`, overriding only the few methods
it differs in (its graph objects, a capture's pool id, what it records). Private
APIs are looked up through :mod:`hal.backends._native.torch_compat`. torch and
the extension are imported only when a glue is created.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, ClassVar

from hal.api import AllocFn, FreeFn
from hal.backends._native import capture as capturing
from hal.backends._native import torch_compat as compat
from hal.backends._native.callbacks import CallbackPair, keep_forever, new_pair
from hal.backends._native.capture import StreamInspector
from hal.backends._native.stream_state import StreamState, stream_state
from hal.errors import CaptureError, InvalidStateError, UnsupportedError
from hal.routing import GraphClassRouting, routable, routing_for
from hal.types import GraphAddresses, fmt_bytes


@dataclass(frozen=True)
class TorchExtension:
    """The names a torch device namespace uses."""

    #: module to import: ``torch`` itself, or an extension such as ``torch_npu``
    module: str
    #: device type and namespace (``<module>.<device_type>``), e.g. ``cuda``, ``npu``
    device_type: str
    #: graph class in that namespace, e.g. ``CUDAGraph``, ``NPUGraph``
    graph_class: str
    #: True: leave the current device alone and enter the glue's device around each call (torch.cuda,
    #: where one process drives several GPUs); False: make the device current once, when the glue
    #: opens (torch_npu and torch_mlu initialise their runtime for it then)
    scoped: bool = False
    #: ``adopt(framework_graph, device)``: the backend's graph object for a framework graph whose replays a
    #: route serves (:attr:`hal.types.Route.on_replay`); None where the backend cannot serve them
    adopt: Callable[[Any, int], Any] | None = None

    def private(self, api: compat.PrivateApi, ext: Any) -> Any | None:
        """The private API ``api`` of this device type in ``ext`` (the imported ``module``), or None."""
        return compat.lookup(api, self.device_type, {self.module: ext})

    def capabilities(self, ext: Any, ns: Any) -> frozenset[str]:
        """``"graphs"``; ``"custom_pool"`` where both MemPool and the custom allocator exist;
        ``"capture_routing"`` where the graph class has ``capture_begin``/``capture_end``."""
        caps = set()
        if all(hasattr(ns, a) for a in (self.graph_class, "graph", "graph_pool_handle")):
            caps.add("graphs")
            if routable(getattr(ns, self.graph_class)):
                caps.add("capture_routing")
        if all(self.private(api, ext) is not None for api in (compat.MEM_POOL, compat.CUSTOM_ALLOCATOR)):
            caps.add("custom_pool")
        return frozenset(caps)

    def class_routing(self, backend: str) -> GraphClassRouting | None:
        """The routing of this extension's graph class for the process's routers, where the extension's module
        is imported already (None otherwise, or where its graph class cannot be routed). Opens no device."""
        ext = sys.modules.get(self.module)
        torch = sys.modules.get("torch")
        if ext is None or torch is None:
            return None
        ns = getattr(ext, self.device_type, None) or getattr(torch, self.device_type, None)
        graph_class = getattr(ns, self.graph_class, None)
        if ns is None or graph_class is None or not routable(graph_class):
            return None
        return routing_for(graph_class, ns.current_device, lambda pool: pool.id,
                           prepare=stream_state(torch, ns, self.device_type).prepare_current, backend=backend,
                           adopt=self.adopt)


@dataclass(eq=False)
class TorchPool:
    """A pool that captures draw from: ``id`` is what ``torch.<device>.graph(pool=...)`` takes."""

    id: tuple
    device: int
    backend: str
    mempool: Any = None  # the MemPool of a custom pool
    callbacks: CallbackPair | None = None
    released: bool = False
    graphs: int = 0  # graphs captured into it and not yet released (where the glue counts)

    @property
    def custom(self) -> bool:
        return self.callbacks is not None

    def __repr__(self) -> str:
        kind = "custom" if self.custom else "device"
        state = " released" if self.released else ""
        return f"<{self.backend} pool {self.id} {kind} device={self.device}{state}>"


class TorchGlue:
    """The torch side of one device of a backend."""

    #: the backend's name, as errors and log records carry it
    backend: ClassVar[str]
    extension: ClassVar[TorchExtension]
    #: the capture mode used when the caller asks for none
    default_capture_mode: ClassVar[str]
    #: why ``create_pool`` with callbacks is refused when this build lacks MemPool or the custom allocator
    no_custom_pool: ClassVar[str]

    def __init__(self, device: int, ext: Any = None) -> None:
        import torch

        names = self.extension
        self.torch = torch
        self.ext = ext if ext is not None else importlib.import_module(names.module)
        self.ns = getattr(self.ext, names.device_type, None) or getattr(torch, names.device_type)
        self.device = device
        self.modules = {"torch": torch, names.module: self.ext}
        self.log = logging.getLogger(f"hal.{self.backend}")
        self._no_snapshot_logged = False
        if not names.scoped:
            self.ns.set_device(device)
        self.routing: GraphClassRouting | None = None
        self.inspector: StreamInspector | None = None
        self.stream_state: StreamState = stream_state(torch, self.ns, names.device_type)
        if "capture_routing" in names.capabilities(self.ext, self.ns):
            self.routing = routing_for(getattr(self.ns, names.graph_class), self.ns.current_device,
                                       lambda pool: pool.id, prepare=self.stream_state.prepare_current,
                                       backend=self.backend, adopt=names.adopt)

    # -- what this build offers ------------------------------------------------------------

    def private(self, api: compat.PrivateApi) -> Any | None:
        """The private API ``api`` for this device type, or None where this build lacks it."""
        return compat.lookup(api, self.extension.device_type, self.modules)

    def require(self, api: compat.PrivateApi, call: str) -> Any:
        """The private API ``api``; :class:`hal.UnsupportedError` naming it and the versions when it is missing."""
        return compat.require(api, self.extension.device_type, self.modules, backend=self.backend, call=call)

    @functools.cached_property
    def capabilities(self) -> frozenset[str]:
        return self.find_capabilities()

    def find_capabilities(self) -> frozenset[str]:
        """The capabilities of this build (computed once per glue)."""
        caps = set(self.extension.capabilities(self.ext, self.ns))
        if self.custom_pool_problem() is not None:
            caps.discard("custom_pool")
        return frozenset(caps)

    def custom_pool_problem(self) -> str | None:
        """Why pools over allocator callbacks cannot work here (None when they can)."""
        for api in (compat.CUSTOM_ALLOCATOR, compat.MEM_POOL):
            if self.private(api) is None:
                return (f"{self.no_custom_pool} ({api.name(self.extension.device_type)} is missing in "
                        f"{compat.versions(self.modules)})")
        return None

    # -- devices and streams --------------------------------------------------------------

    def on_device(self, device: int | None = None) -> AbstractContextManager[Any]:
        """``device`` (the glue's by default) made current for a block in a scoped namespace; otherwise
        nothing to do."""
        if not self.extension.scoped:
            return contextlib.nullcontext()
        return self.ns.device(self.device if device is None else device)

    def torch_device(self) -> Any:
        return self.torch.device(self.extension.device_type, self.device)

    def create_stream(self) -> Any:
        return self.ns.Stream(device=self.torch_device())

    def current_stream(self) -> Any:
        return self.ns.current_stream(self.torch_device())

    def use_stream(self, stream: Any) -> AbstractContextManager[Any]:
        return self.ns.stream(stream)  # also makes the stream's device current

    def synchronize(self, stream: Any) -> None:
        if stream is None:
            self.ns.synchronize(self.device)  # the index, as torch.cuda.synchronize takes it too
        else:
            stream.synchronize()

    def default_capture_stream(self) -> Any:
        """The side stream ``torch.<device>.graph`` captures on when given none (made as torch would)."""
        return compat.default_capture_stream(self.ns.graph, self.create_stream, self.current_stream)

    def prepare_capture_stream(self, stream: Any) -> None:
        """Make the per-stream state of torch's libraries on ``stream`` ahead of a capture (see
        :mod:`hal.backends._native.stream_state`)."""
        capturing = getattr(self.ns, "is_current_stream_capturing", None)
        if stream is not None and capturing is not None and capturing() and stream == self.ns.current_stream():
            raise InvalidStateError(f"stream={stream!r} is capturing: prepare it before the capture begins",
                                    backend=self.backend, call="prepare_capture_stream")
        with self.on_device():
            self.stream_state.prepare(stream)

    def stream_state_sizes(self) -> dict[int, str]:
        """``{bytes: what}`` preparing a stream of this device made (measured at its first preparation)."""
        return self.stream_state.sizes(self.device)

    # -- pools ------------------------------------------------------------------------------

    def create_pool(self, alloc: AllocFn | None, free: FreeFn | None) -> TorchPool:
        """A pool over ``alloc``/``free`` (a MemPool over a custom allocator), or without them a
        pool id of the framework's own allocator that several captures can share."""
        if alloc is None or free is None:
            with self.on_device():
                return TorchPool(id=tuple(self.ns.graph_pool_handle()), device=self.device, backend=self.backend)
        problem = self.custom_pool_problem()
        if problem is not None:
            raise UnsupportedError(problem, backend=self.backend, call="create_pool")
        pair = new_pair(alloc, free, device=self.device, backend=self.backend)
        pair.torch_allocator = self.require(compat.CUSTOM_ALLOCATOR, "create_pool")(*pair.addresses)
        keep_forever(pair.torch_allocator)  # torch's pools point at it until the process ends
        with self.on_device():
            mempool = self.require(compat.MEM_POOL, "create_pool")(pair.torch_allocator)
        return TorchPool(id=tuple(mempool.id), device=self.device, backend=self.backend, mempool=mempool,
                         callbacks=pair)

    def pool_active_blocks(self, pool: TorchPool) -> list[tuple[int, int]]:
        """``(address, bytes)`` of the blocks of ``pool`` still allocated, from the memory snapshot."""
        if pool.released:
            raise InvalidStateError(f"{pool!r} was released", backend=self.backend, call="pool_active_blocks")
        snapshot = self.private(compat.MEMORY_SNAPSHOT)
        if snapshot is None:
            if not self._no_snapshot_logged:
                self.log.info("%s: this %s has no memory snapshot API; pool_active_blocks reports nothing",
                              self.backend, self.extension.module)
                self._no_snapshot_logged = True
            return []
        return compat.active_blocks(compat.memory_snapshot(snapshot, pool.id), pool.id, pool.device)

    def release_pool(self, pool: TorchPool) -> None:
        """Drop a pool; idempotent. Segments still holding live tensors go back when those tensors die."""
        if pool.released:
            return
        pool.released = True
        if pool.graphs:
            self.log.warning("%r released while %d graph(s) of it are alive: its memory goes back only "
                             "after they are released", pool, pool.graphs)
        with self.on_device(pool.device):
            if pool.callbacks is None:
                self.release_device_pool(pool)
                return
            pool.callbacks.pool_released = True  # from now on, the last free() makes the pair forget
            pool.mempool = None  # MemPool's destructor releases the pool and empties its cache
            self._forget_or_warn(pool.callbacks)

    def release_device_pool(self, pool: TorchPool) -> None:
        """Release a pool id of the framework's own allocator (its segments are freed with the graphs)."""

    def _forget_or_warn(self, pair: CallbackPair) -> None:
        """After its pool was dropped: forget the callables, or warn about segments still in use."""
        if not pair.live:
            pair.forget()
            return
        self.log.warning("%s released while %d segment(s), %s, still hold live tensors: they go back "
                         "through free() when those tensors die. Keep the memory under them mapped and "
                         "reserved until then: a new range at the same addresses would confuse torch's "
                         "allocator when the old tensors are freed", pair.label, len(pair.live),
                         fmt_bytes(sum(pair.live.values())))

    # -- graphs -----------------------------------------------------------------------------

    def create_graph(self, lazy: bool = False) -> Any:
        """A framework graph, instantiated at the end of its capture (``lazy=True`` needs a glue of its own)."""
        if lazy:
            raise UnsupportedError(f"lazy=True: {self.extension.module}'s {self.extension.graph_class} is "
                                   "instantiated at the end of its capture", backend=self.backend,
                                   call="create_graph")
        with self.on_device():
            return getattr(self.ns, self.extension.graph_class)()

    def route_captures(self, router: Any) -> AbstractContextManager[None]:
        if self.routing is None:
            raise UnsupportedError(f"{self.extension.module}'s {self.extension.graph_class} has no "
                                   "capture_begin/capture_end to route", backend=self.backend, call="route_captures")
        return self.routing.activate(self.device, router)

    def explain_out_of_memory(self, exc: BaseException, pool: TorchPool | None) -> None:
        """Attach why ``pool``'s allocator callback gave no memory to torch's out-of-memory error."""
        reason = pool.callbacks.last_error if pool is not None and pool.callbacks is not None else None
        if reason and isinstance(exc, self.torch.OutOfMemoryError) and hasattr(exc, "add_note"):
            exc.add_note(f"hal {self.backend}: {reason}")

    def use_inspector(self, inspector: StreamInspector | None) -> None:
        """Read graphs under construction with ``inspector(stream)``: captures with ``inspect=True``
        and routed captures whose route asks for it (the routing of a graph class is shared by
        every device, and so is its inspector)."""
        self.inspector = inspector
        if self.routing is not None:
            self.routing.set_inspector(None if inspector is None else self._inspect_current)

    def _inspect_current(self, torch_graph: Any) -> GraphAddresses:
        """What the graph being captured on the current stream uses (the framework ends a capture there)."""
        assert self.inspector is not None
        return self.inspector(self.ns.current_stream())

    def capture(self, graph: Any, pool: TorchPool | None, stream: Any, capture_error_mode: str | None,
                inspect: bool = False) -> AbstractContextManager[Any]:
        """The capture of :mod:`hal.backends._native.capture`, in ``capture_error_mode`` (the glue's
        default when None).

        :param inspect: record what the graph uses; needs an inspector (:meth:`use_inspector`).
        """
        if inspect and self.inspector is None:
            raise UnsupportedError("inspect=True: this glue has no way to read a graph under construction",
                                   backend=self.backend, call="capture")
        return capturing.capture(self, graph, pool, stream, capture_error_mode or self.default_capture_mode,
                                 self.inspector if inspect else None)

    # what a vendor's capture differs in (see hal.backends._native.capture.CaptureGlue)

    @property
    def graph_class(self) -> str:
        """The name of the framework's graph class in the device namespace."""
        return self.extension.graph_class

    def check_capture(self, graph: Any, stream: Any) -> None:
        """Refuse a capture of ``graph`` on ``stream`` before it starts (nothing is refused here)."""

    def torch_graph_of(self, graph: Any) -> Any:
        """The framework's graph behind a graph of this backend (here: the same object)."""
        return graph

    def capture_pool_id(self, pool: TorchPool | None) -> Any:
        """What the framework's capture takes as its pool (None: a pool private to the graph)."""
        return None if pool is None else pool.id

    def captured(self, graph: Any, stream: Any, pool: TorchPool | None) -> None:
        """Record a capture that ended well (nothing to record here)."""

    def capture_error(self, exc: BaseException, phase: capturing.Phase) -> CaptureError | None:
        """The :class:`hal.CaptureError` that ``exc``, raised in ``phase`` of a capture, stands for, or None."""
        return None

    def replay(self, graph: Any) -> None:
        graph.replay()

    def release_graph(self, graph: Any) -> None:
        graph.reset()


#: the capabilities that depend on the extension giving a pool's segments to the pool's allocator
ROUTED_CAPABILITIES = ("custom_pool", "use_pool", "capture_routing")


class ExtensionGlue(TorchGlue):
    """The glue of a vendor extension (torch_npu, torch_mlu) whose routing of pool memory depends on its release.

    ``"custom_pool"``, ``"use_pool"`` and ``"capture_routing"`` are reported only
    where :meth:`routing_problem` finds nothing: otherwise a capture into a pool
    over hal's callbacks would silently take the extension's own memory. When it
    finds something, the three are absent, a warning names the version or the
    setting, and graphkit falls back as it does for any backend without them.
    """

    #: the allocator config variables the extension reads, in the order it reads them
    alloc_conf_vars: ClassVar[tuple[str, ...]]
    #: added to the reason a routed capability is on (what is known about that routing)
    routed_note: ClassVar[str] = ""

    def __init__(self, device: int, ext: Any = None) -> None:
        super().__init__(device, ext)
        if "capture_routing" not in self.capabilities and self.routing is not None:
            self.routing.backend = None  # not by the process's routers either
            self.routing = None  # captures are never routed where the pools would not take hal's memory

    @property
    def extension_version(self) -> str:
        """``"torch_npu 2.13.0"``: the extension's name and ``__version__``."""
        return f"{self.extension.module} {getattr(self.ext, '__version__', '(version unknown)')}"

    def expandable_segments(self) -> str | None:
        """The setting (``"VAR=value"``) that turns expandable segments on, or None."""
        return compat.alloc_conf_setting(self.alloc_conf_vars, "expandable_segments")

    def routing_problem(self) -> str | None:
        """Why this build would not give a pool's segments to the pool's allocator, or None.

        Here: expandable segments, which the extension's allocator tries before a
        pool's own allocator (graph pools included). Vendor glues add their version rules.
        """
        setting = self.expandable_segments()
        if setting is not None:
            return (f"expandable segments are on ({setting}): {self.extension.module} serves every pool, "
                    "graph pools included, from expandable segments before the pool's allocator; unset "
                    "expandable_segments to let graphkit's allocator back the pools")
        return None

    def find_capabilities(self) -> frozenset[str]:
        """The shared ones, without the routed ones where :meth:`routing_problem` finds something,
        plus ``"use_pool"`` where ``"custom_pool"`` works and the build has ``use_mem_pool``."""
        caps = set(super().find_capabilities())
        problem = self.routing_problem()
        if problem is not None:
            self.log.warning("%s: no pools over allocator callbacks, no use_pool, no capture routing: %s",
                             self.backend, problem)
            return frozenset(caps - set(ROUTED_CAPABILITIES))
        if "custom_pool" in caps and self.private(compat.USE_MEM_POOL) is not None:
            caps.add("use_pool")
        return frozenset(caps)

    def custom_pool_problem(self) -> str | None:
        """:meth:`routing_problem` first, then what the build lacks."""
        return self.routing_problem() or super().custom_pool_problem()

    def capability_reasons(self) -> dict[str, str]:
        """Why each capability beyond the VMM hooks is on or off here, for ``python -m hal``."""
        caps, names = self.capabilities, self.extension
        problem = self.routing_problem()
        missing = super().custom_pool_problem()
        graph_api = f"{names.module}.{names.device_type}.{names.graph_class}, graph and graph_pool_handle"
        reasons = {"graphs": f"{graph_api} {'are there' if 'graphs' in caps else 'are missing'}"}
        for cap in ROUTED_CAPABILITIES:
            if cap in caps:
                reasons[cap] = f"{self.extension_version} gives a pool's segments to its allocator{self.routed_note}"
            elif problem is not None:
                reasons[cap] = problem
            elif cap == "capture_routing":
                reasons[cap] = f"{names.graph_class} has no capture_begin/capture_end to route"
            elif missing is not None:
                reasons[cap] = missing
            else:
                reasons[cap] = f"{compat.USE_MEM_POOL.name(names.device_type)} is missing"
        return reasons

    def use_pool(self, pool: TorchPool) -> AbstractContextManager[None]:
        """The framework's allocations on this thread inside the block come from ``pool``'s MemPool."""
        if pool.mempool is None:
            raise UnsupportedError(f"{pool!r} is not a {self.extension.module} MemPool", backend=self.backend,
                                   call="use_pool")
        use_mem_pool = self.require(compat.USE_MEM_POOL, "use_pool")
        return use_mem_pool(pool.mempool, device=self.device)

    def pool_active_blocks(self, pool: TorchPool) -> list[tuple[int, int]]:
        """As :meth:`TorchGlue.pool_active_blocks`; where the snapshot has no pool ids, a custom pool's
        segments are recognised by the addresses its allocator handed out."""
        if pool.released:
            raise InvalidStateError(f"{pool!r} was released", backend=self.backend, call="pool_active_blocks")
        snapshot = self.private(compat.MEMORY_SNAPSHOT)
        if snapshot is None:
            return super().pool_active_blocks(pool)
        segments = compat.memory_snapshot(snapshot, pool.id)
        addresses = set(pool.callbacks.live) if pool.callbacks is not None else None
        unattributed = addresses is None and segments and not any("segment_pool_id" in s for s in segments)
        if unattributed and not self._no_snapshot_logged:
            self.log.info("%s: the memory snapshot of %s has no segment_pool_id; pool_active_blocks reports "
                          "nothing for pools of the framework's own allocator", self.backend, self.extension_version)
            self._no_snapshot_logged = True
        return compat.active_blocks(segments, pool.id, pool.device, addresses)
