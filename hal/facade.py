"""The typed facade over one backend plugin on one device.

It applies the conventions of :mod:`hal.api`: arguments are checked before
the backend sees them, a missing hook or an absent capability raises
:class:`hal.UnsupportedError` naming the backend, the call and the
capability, and a ``None`` from a hook that must return a value is a broken
plugin (:class:`hal.PluginValidationError`).
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import logging
import os
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import pluggy

from hal import api
from hal.errors import (
    CaptureError,
    HalError,
    InvalidArgumentError,
    InvalidStateError,
    PluginValidationError,
    UnsupportedError,
)
from hal.types import CaptureRouter, GraphAddresses, MappedRange, MemInfo, Route, fmt_bytes
from hal.wrappers import Accounting, FaultInjector, LiveCounts, install_tracing

log = logging.getLogger("hal")

#: sizes and addresses are 64-bit in every driver: larger ones would wrap
ADDRESS_LIMIT = 1 << 64


class Backend:
    """One backend on one device: typed, checked calls into the hal contract.

    Obtain one with :func:`hal.get_backend`. Every vmm call is checked here
    (sizes, alignment, reserved ranges, live handles, double release) before
    the driver sees it, and the facade's bookkeeping changes only when the
    call succeeds. ``close()`` releases whatever is still live; it is
    idempotent, and the object is a context manager.
    """

    def __init__(self, name: str, plugin: Any, *, device: int = 0, origin: str = "built-in") -> None:
        self.name = name
        self.device = device
        self.origin = origin
        self.plugin = plugin
        self._pm = pluggy.PluginManager("hal")
        self._pm.add_hookspecs(api)
        self.accounting = Accounting()
        self.faults = FaultInjector(name)
        self._pm.register(self.accounting, name="hal-accounting")
        self._pm.register(self.faults, name="hal-faults")
        try:
            self._pm.register(plugin, name=name)
            self._pm.check_pending()
        except pluggy.PluginValidationError as exc:
            raise PluginValidationError(f"plugin does not fit the hal contract: {exc}", backend=name) from exc
        self._untrace = install_tracing(self._pm, name) if os.environ.get("HAL_TRACE") else None
        self._hook = self._pm.hook
        self._replay_cache: tuple[int, Callable[[Any], Any] | None] | None = None
        self._implemented = frozenset(
            caller.name for caller in self._pm.get_hookcallers(plugin) or () if caller.name in api.ALL_HOOKS
        )
        self._lock = threading.RLock()
        self._ranges: dict[int, int] = {}
        self._range_starts: list[int] = []
        self._handles: dict[Any, int] = {}
        self._handle_maps: dict[Any, int] = {}
        self._mappings: dict[int, MappedRange] = {}
        self._map_starts: list[int] = []
        self._closed = False
        self._granularity: int | None = None
        self._capabilities: frozenset[str] | None = None
        self._local = threading.local()
        self._pools = _ByIdentity()  # pool -> its _PoolState (paused, released)
        self._graph_pool = _ByIdentity()  # graph -> the _PoolState of the pool it was captured into, or _RELEASED

    # -- helpers ----------------------------------------------------------

    def _err(self, cls: type[HalError], call: str, message: str) -> HalError:
        return cls(message, backend=self.name, call=call)

    def _check_open(self, call: str) -> None:
        if self._closed:
            raise self._err(InvalidStateError, call, "the backend is closed")

    def _check_size(self, call: str, size: Any, arg: str = "size") -> None:
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            raise self._err(InvalidArgumentError, call, f"{arg}={size!r} must be a positive int")
        if size >= ADDRESS_LIMIT:  # would wrap in the driver's size_t
            raise self._err(InvalidArgumentError, call, f"{arg}={size} is not below 2**64")
        g = self.granularity
        if size % g:
            raise self._err(
                InvalidArgumentError, call,
                f"{arg}={size} is not a multiple of the granularity {g} ({fmt_bytes(g)})",
            )

    def _check_ptr(self, call: str, ptr: Any) -> None:
        if not isinstance(ptr, int) or isinstance(ptr, bool) or not 0 <= ptr < ADDRESS_LIMIT:
            raise self._err(InvalidArgumentError, call, f"ptr={ptr!r} must be an int address in [0, 2**64)")

    def _require(self, hook: str) -> None:
        if hook not in self._implemented:
            capability = api.HOOK_CAPABILITY.get(hook)
            needs = f"; it is part of the {capability!r} capability" if capability else ""
            has = ", ".join(sorted(self.capabilities)) or "none"
            raise self._err(UnsupportedError, hook,
                            f"this backend does not implement it{needs} (the backend's capabilities: {has})")

    def _result(self, hook: str, value: Any) -> Any:
        """``value``, unless a hook that must return something returned ``None`` (a broken plugin)."""
        if value is None and hook in api.RESULT_HOOKS:
            raise self._err(PluginValidationError, hook,
                            "the backend returned None; a hook it cannot serve must be left out or raise "
                            "hal.UnsupportedError (see hal.api)")
        return value

    @contextlib.contextmanager
    def _plugin_faults(self, hook: str) -> Iterator[None]:
        """What else than a hal error the plugin's ``hook`` raises leaves as :class:`PluginValidationError`
        (a hook raises hal errors only): callers that pass a broken plugin over catch hal errors."""
        try:
            yield
        except HalError:
            raise
        except Exception as exc:
            raise self._err(PluginValidationError, hook, f"the plugin's {hook}() raised {type(exc).__name__}: "
                                                         f"{exc} (a hook raises hal errors only)") from exc

    def _refuse_without(self, capability: str, call: str, what: str) -> None:
        if capability not in self.capabilities:
            raise self._err(UnsupportedError, call, f"{what} (capability {capability!r} is absent)")

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<hal.Backend {self.name} device={self.device} {state}>"

    def __enter__(self) -> Backend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- queries ----------------------------------------------------------

    @property
    def granularity(self) -> int:
        """Minimum physical granularity in bytes; every vmm size is a multiple of it."""
        if self._granularity is None:
            g = self._result("granularity", self._hook.granularity(recommended=False))
            if not isinstance(g, int) or g <= 0:
                raise self._err(HalError, "granularity", f"backend returned {g!r}")
            self._granularity = g
        return self._granularity

    @property
    def recommended_granularity(self) -> int:
        """The granularity the driver recommends (a multiple of :attr:`granularity`)."""
        return int(self._result("granularity", self._hook.granularity(recommended=True)))

    def device_count(self) -> int:
        """How many devices this backend sees."""
        return int(self._result("device_count", self._hook.device_count()))

    def mem_info(self) -> MemInfo:
        """Free and total device memory, as the driver sees it."""
        return self._result("mem_info", self._hook.mem_info())

    @property
    def live(self) -> LiveCounts:
        """What is live now (ranges, chunks, mappings, pools, graphs), per the accounting wrapper."""
        return self.accounting.snapshot()

    # -- vmm --------------------------------------------------------------

    def create_vir_ptr(self, size: int) -> int:
        """Reserve ``size`` bytes of virtual address space; return the start address."""
        with self._lock:
            self._check_open("create_vir_ptr")
            self._check_size("create_vir_ptr", size)
            ptr = int(self._result("create_vir_ptr", self._hook.create_vir_ptr(size=size)))
            self._ranges[ptr] = size
            bisect.insort(self._range_starts, ptr)
            return ptr

    def release_vir_ptr(self, ptr: int, size: int) -> None:
        """Free a reserved range; nothing may be mapped in it."""
        call = "release_vir_ptr"
        with self._lock:
            self._check_open(call)
            self._check_ptr(call, ptr)
            if ptr not in self._ranges:
                raise self._err(InvalidStateError, call,
                                f"ptr={ptr:#x} is not a live reservation (released twice?)")
            if self._ranges[ptr] != size:
                raise self._err(InvalidArgumentError, call,
                                f"size={size} differs from the reserved size {self._ranges[ptr]}")
            inside = self._mappings_in(ptr, ptr + size)
            if inside:
                raise self._err(InvalidStateError, call,
                                f"{len(inside)} mapping(s) still live in the range at {ptr:#x}; unmap first")
            self._hook.release_vir_ptr(ptr=ptr, size=size)
            del self._ranges[ptr]
            self._range_starts.remove(ptr)

    def create_phy_mem_handle(self, size: int) -> Any:
        """Allocate one physical chunk of ``size`` bytes; return its handle."""
        with self._lock:
            self._check_open("create_phy_mem_handle")
            self._check_size("create_phy_mem_handle", size)
            handle = self._result("create_phy_mem_handle", self._hook.create_phy_mem_handle(size=size))
            self._handles[handle] = size
            self._handle_maps[handle] = 0
            return handle

    def release_phy_mem_handle(self, handle: Any) -> None:
        """Free a chunk; it must be mapped nowhere."""
        call = "release_phy_mem_handle"
        with self._lock:
            self._check_open(call)
            if handle not in self._handles:
                raise self._err(InvalidStateError, call,
                                f"handle={handle!r} is not live (released twice?)")
            if self._handle_maps[handle]:
                raise self._err(InvalidStateError, call,
                                f"handle={handle!r} is still mapped {self._handle_maps[handle]} time(s)")
            self._hook.release_phy_mem_handle(handle=handle)
            del self._handles[handle]
            del self._handle_maps[handle]

    def map(self, ptr: int, size: int, handle: Any) -> None:
        """Map the whole chunk ``handle`` (of ``size`` bytes) at ``ptr``, read-write."""
        call = "map"
        with self._lock:
            self._check_open(call)
            if handle not in self._handles:
                raise self._err(InvalidStateError, call, f"handle={handle!r} is not live")
            if size != self._handles[handle]:
                raise self._err(InvalidArgumentError, call,
                                f"size={size} must equal the chunk's size {self._handles[handle]} "
                                "(maps are whole handles)")
            if not isinstance(ptr, int) or ptr % self.granularity:
                raise self._err(InvalidArgumentError, call,
                                f"ptr={ptr:#x} is not aligned to the granularity {self.granularity}"
                                if isinstance(ptr, int) else f"ptr={ptr!r} must be an int address")
            self._check_in_range(call, ptr, size)
            clash = self._mappings_in(ptr, ptr + size)
            if clash:
                raise self._err(InvalidStateError, call,
                                f"[{ptr:#x}, {ptr + size:#x}) overlaps the mapping at {clash[0].ptr:#x}")
            self._hook.map(ptr=ptr, size=size, handle=handle)
            self._mappings[ptr] = MappedRange(ptr, size, handle)
            bisect.insort(self._map_starts, ptr)
            self._handle_maps[handle] += 1

    def unmap(self, ptr: int, size: int) -> None:
        """Undo exactly one earlier ``map(ptr, size, ...)``."""
        call = "unmap"
        with self._lock:
            self._check_open(call)
            self._check_ptr(call, ptr)
            m = self._mappings.get(ptr)
            if m is None:
                raise self._err(InvalidStateError, call, f"nothing is mapped at ptr={ptr:#x}")
            if m.size != size:
                raise self._err(InvalidArgumentError, call,
                                f"size={size} differs from the mapping's size {m.size} (partial unmap)")
            self._hook.unmap(ptr=ptr, size=size)
            del self._mappings[ptr]
            self._map_starts.remove(ptr)
            self._handle_maps[m.handle] -= 1

    def export_phy_mem_handle(self, handle: Any) -> int:
        """A new file descriptor through which another process imports the chunk ``handle`` (yours to close).

        See :func:`hal.api.export_phy_mem_handle`.

        :raises UnsupportedError: the backend cannot export chunks (the hook is absent, or says why not).
        """
        call = "export_phy_mem_handle"
        with self._lock:
            self._check_open(call)
            self._require(call)
            if handle not in self._handles:
                raise self._err(InvalidStateError, call, f"handle={handle!r} is not live")
            fd = self._result(call, self._hook.export_phy_mem_handle(handle=handle))
            if not isinstance(fd, int) or isinstance(fd, bool) or fd < 0:
                raise self._err(PluginValidationError, call, f"the backend returned {fd!r}, not a file descriptor")
            return fd

    def import_phy_mem_handle(self, fd: int, size: int) -> Any:
        """A handle to the chunk of ``size`` bytes another process exported as ``fd``; map and release it as
        one from :meth:`create_phy_mem_handle` (``fd`` stays yours to close).

        See :func:`hal.api.import_phy_mem_handle`.

        :raises UnsupportedError: the backend cannot import chunks.
        """
        call = "import_phy_mem_handle"
        with self._lock:
            self._check_open(call)
            self._require(call)
            if not isinstance(fd, int) or isinstance(fd, bool) or fd < 0:
                raise self._err(InvalidArgumentError, call, f"fd={fd!r} must be a file descriptor (an int >= 0)")
            self._check_size(call, size)
            handle = self._result(call, self._hook.import_phy_mem_handle(fd=fd, size=size))
            self._handles[handle] = size
            self._handle_maps[handle] = 0
            return handle

    def _check_in_range(self, call: str, ptr: int, size: int) -> None:
        i = bisect.bisect_right(self._range_starts, ptr) - 1
        if i >= 0:
            start = self._range_starts[i]
            if ptr + size <= start + self._ranges[start]:
                return
        raise self._err(InvalidArgumentError, call,
                        f"[{ptr:#x}, {ptr + size:#x}) is not inside a reserved range")

    def _mappings_in(self, lo: int, hi: int) -> list[MappedRange]:
        i = max(bisect.bisect_right(self._map_starts, lo) - 1, 0)
        found = []
        for start in self._map_starts[i:]:
            if start >= hi:
                break
            m = self._mappings[start]
            if m.ptr + m.size > lo:
                found.append(m)
        return found

    # -- graphs, streams, pools -------------------------------------------

    @property
    def capabilities(self) -> frozenset[str]:
        """What the backend can do beyond vmm (names of :data:`hal.api.CAPABILITIES`).

        What the backend declares, less any capability whose hooks it does not
        all implement (logged once: that is a bug in the plugin).
        """
        if self._capabilities is None:
            declared: frozenset[str] = frozenset()
            if "capabilities" in self._implemented:
                with self._plugin_faults("capabilities"):
                    declared = frozenset(self._result("capabilities", self._hook.capabilities()))
            kept = set()
            for capability in declared:
                missing = [h for h in api.CAPABILITY_HOOKS.get(capability, ()) if h not in self._implemented]
                if missing:
                    log.warning("%s: declares capability %r but does not implement %s; ignored", self.name,
                                capability, ", ".join(missing))
                else:
                    kept.add(capability)
            self._capabilities = frozenset(kept)
        return self._capabilities

    def supports(self, capability: str) -> bool:
        """Whether ``capability`` is in :attr:`capabilities`."""
        return capability in self.capabilities

    def implements(self, hook: str) -> bool:
        """Whether the backend implements ``hook`` (a name of :data:`hal.api.ALL_HOOKS`)."""
        if hook not in api.ALL_HOOKS:
            raise self._err(InvalidArgumentError, "implements", f"hook={hook!r} is not a hook of the hal contract")
        return hook in self._implemented

    def _graph_call(self, hook: str, **kwargs: Any) -> Any:
        self._check_open(hook)
        self._require(hook)
        return self._result(hook, getattr(self._hook, hook)(**kwargs))

    def torch_device(self) -> Any:
        """The ``torch.device`` of this backend's device."""
        return self._graph_call("torch_device")

    def create_stream(self) -> Any:
        """A new stream on the device."""
        return self._graph_call("create_stream")

    def current_stream(self) -> Any:
        """The stream work is submitted to now."""
        return self._graph_call("current_stream")

    def use_stream(self, stream: Any) -> AbstractContextManager[Any]:
        """Context manager: ``stream`` is the current stream inside it."""
        return self._graph_call("use_stream", stream=stream)

    def synchronize(self, stream: Any = None) -> None:
        """Wait for ``stream`` (the whole device when ``None``)."""
        self._graph_call("synchronize", stream=stream)

    def create_pool(self, alloc: api.AllocFn | None = None, free: api.FreeFn | None = None, *,
                    paused: Callable[[], bool] | None = None) -> Any:
        """A memory pool for captures; with ``alloc``/``free``, its segments come from them.

        :param paused: with callbacks: tells whether the memory behind them is
            released for now (asleep); :meth:`replay` of a graph captured into
            the pool raises :class:`InvalidStateError` while it says ``True``.
        :raises UnsupportedError: callbacks given but the backend lacks ``"custom_pool"``.
        """
        if (alloc is None) != (free is None):
            raise self._err(InvalidArgumentError, "create_pool", "give both alloc and free, or neither")
        if paused is not None and (alloc is None or not callable(paused)):
            raise self._err(InvalidArgumentError, "create_pool",
                            f"paused={paused!r} must be a callable, given with alloc and free")
        if alloc is not None:
            self._refuse_without("custom_pool", "create_pool",
                                 "no pools over custom allocator callbacks on this backend")
        pool = self._graph_call("create_pool", alloc=alloc, free=free)
        self._pools.put(pool, _PoolState(paused))
        return pool

    def use_pool(self, pool: Any) -> AbstractContextManager[None]:
        """Context manager: the framework's allocations on this thread inside it come from ``pool``.

        :raises UnsupportedError: the backend lacks ``"use_pool"``.
        """
        self._refuse_without("use_pool", "use_pool", "this backend cannot direct the framework's allocations to a pool")
        return self._graph_call("use_pool", pool=backend_pool(pool))

    def tensor_at(self, ptr: int, nbytes: int, owner: Any = None) -> Any:
        """A ``torch.uint8`` tensor over ``nbytes`` of device memory at ``ptr`` (no copy, not owning it).

        The tensor and its views keep ``owner`` alive.
        """
        self._check_ptr("tensor_at", ptr)
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or not 0 <= nbytes < ADDRESS_LIMIT - ptr:
            raise self._err(InvalidArgumentError, "tensor_at",
                            f"nbytes={nbytes!r} must be an int >= 0 that keeps ptr + nbytes below 2**64")
        return self._graph_call("tensor_at", ptr=ptr, nbytes=nbytes, owner=owner)

    def pool_paused(self, pool: Any) -> bool:
        """Whether the memory behind ``pool`` is released for now (see ``create_pool(paused=...)``)."""
        state = self._pools.get(backend_pool(pool))
        return bool(state is not None and state.paused is not None and state.paused())

    def pool_active_blocks(self, pool: Any) -> list[tuple[int, int]]:
        """``(address, nbytes)`` of every block of ``pool`` still in use."""
        return list(self._graph_call("pool_active_blocks", pool=pool))

    def release_pool(self, pool: Any) -> None:
        """Drop a pool; its segments go back where they came from (once their tensors die).

        A graph captured into it can no longer replay (:meth:`replay` raises).
        """
        self._graph_call("release_pool", pool=pool)
        state = self._pools.get(pool)
        if state is not None:
            state.released = True  # the graphs captured into it hold the state
            self._pools.pop(pool)

    def create_graph(self) -> Any:
        """A new, empty graph."""
        return self._graph_call("create_graph")

    def capture(self, graph: Any, pool: Any = None, stream: Any = None,
                capture_error_mode: str | None = None, *, inspect: bool = False) -> AbstractContextManager[Any]:
        """Context manager that captures the work done inside it into ``graph``.

        ``capture_error_mode=None`` uses the backend's default mode.
        ``inspect=True`` records what :meth:`graph_addresses` reports (needs
        ``"graph_addresses"``).
        """
        if capture_error_mode not in (None, "global", "thread_local", "relaxed"):
            raise self._err(InvalidArgumentError, "capture",
                            f"capture_error_mode={capture_error_mode!r} must be global, thread_local or relaxed")
        if inspect:
            self._refuse_without("graph_addresses", "capture",
                                 "inspect=True: this backend cannot tell which addresses a graph uses")
        owner = getattr(pool, "__hal_backend__", None)  # a graphkit pool handle: the backend of its pools
        if owner is not None and (owner.name, owner.device) != (self.name, self.device):
            raise self._err(CaptureError, "capture", f"pool={pool!r} belongs to {owner.name}:{owner.device}, not "
                            f"to this backend ({self.name}:{self.device}): capture through the backend of the pools")
        pool = backend_pool(pool)
        inner = self._graph_call("capture", graph=graph, pool=pool, stream=stream,
                                 capture_error_mode=capture_error_mode, inspect=bool(inspect))
        return self._tracking(graph, pool, inner)

    @contextlib.contextmanager
    def _tracking(self, graph: Any, pool: Any, inner: AbstractContextManager[Any]) -> Iterator[Any]:
        """Run ``inner`` (a capture of ``graph``) and remember the pool it drew from, routed or not."""
        stack = self._capturing()
        stack.append([pool])  # a router that chooses another pool appends it
        try:
            with inner as captured:
                yield captured
        finally:
            chosen = stack.pop()[-1]
        state = None if chosen is None else self._pools.get(chosen)
        if state is not None:
            self._graph_pool.put(graph, state)
        else:
            self._graph_pool.pop(graph)

    def _capturing(self) -> list[list[Any]]:
        stack = getattr(self._local, "capturing", None)
        if stack is None:
            stack = self._local.capturing = []
        return stack

    def route_captures(self, router: CaptureRouter) -> AbstractContextManager[None]:
        """Context manager: every capture started inside it takes the pool ``router`` chooses.

        See :func:`hal.api.route_captures`.

        :raises UnsupportedError: the backend lacks ``"capture_routing"``.
        """
        if not callable(router):
            raise self._err(InvalidArgumentError, "route_captures", f"router={router!r} must be callable")
        self._refuse_without("capture_routing", "route_captures", "this backend cannot route the framework's captures")

        def noted(graph: Any, requested_pool: Any) -> Route | None:
            route = router(graph, requested_pool)
            stack = self._capturing()
            if stack and isinstance(route, Route):  # a capture through this facade: replay checks this pool
                stack[-1].append(route.pool)
            return route

        return self._graph_call("route_captures", router=noted)

    def graph_addresses(self, graph: Any) -> GraphAddresses:
        """The memory ``graph``'s replay reads or writes, read from the graph (see :func:`hal.api.graph_addresses`).

        :raises UnsupportedError: the backend lacks ``"graph_addresses"``.
        """
        self._refuse_without("graph_addresses", "graph_addresses",
                             "this backend cannot tell which addresses a graph uses")
        found = self._graph_call("graph_addresses", graph=graph)
        if not isinstance(found, GraphAddresses):
            raise self._err(PluginValidationError, "graph_addresses",
                            f"the backend returned {type(found).__name__}, not a hal.types.GraphAddresses")
        return found

    def default_capture_stream(self) -> Any:
        """The stream the framework's own capture API uses when it is given none."""
        if "default_capture_stream" not in self._implemented:
            return self.current_stream()
        return self._graph_call("default_capture_stream")

    def current_device(self) -> int:
        """The device the backend's framework calls current in this thread now (captures start there), as
        :func:`hal.get_backend` means it by default; this backend's own device where the plugin cannot tell."""
        ask = getattr(type(self.plugin), "current_device", None)
        if ask is None:
            return self.device
        from hal.registry import current_device

        return current_device(type(self.plugin))

    def prepare_capture_stream(self, stream: Any = None) -> None:
        """Make, outside any capture, the per-stream state the framework's libraries create lazily on ``stream``.

        cuBLAS and cuBLASLt allocate a workspace per stream (and library handle, one per thread) at their
        first GEMM there; inside a capture it would land in the capture's pool. hal does this itself before
        every capture it starts or routes; call it for a capture it never sees. ``stream`` defaults to the
        stream the framework's capture API uses when given none. Idempotent and cheap once done.

        :raises InvalidStateError: ``stream`` is capturing now.
        """
        self._check_open("prepare_capture_stream")
        if "prepare_capture_stream" not in self._implemented:
            return
        stream = stream if stream is not None else self.default_capture_stream()
        self._graph_call("prepare_capture_stream", stream=stream)

    def stream_state_sizes(self) -> dict[int, str]:
        """``{bytes: what}`` of the per-stream state :meth:`prepare_capture_stream` makes (``{}`` where none)."""
        if "stream_state_sizes" not in self._implemented:
            return {}
        return dict(self._graph_call("stream_state_sizes"))

    def replay(self, graph: Any) -> None:
        """Launch a captured graph.

        :raises InvalidStateError: the graph was released, the pool it was
            captured into was released, or that pool's memory is paused (see
            ``create_pool(paused=...)``).
        """
        state = self._graph_pool.get(graph)
        if state is not None and (state.released or (state.paused is not None and state.paused())):
            raise self._err(InvalidStateError, "replay", state.why_not())
        direct = self._direct_replay()
        if direct is not None:
            self._check_open("replay")
            direct(graph)
            return
        self._graph_call("replay", graph=graph)

    def _direct_replay(self) -> Callable[[Any], Any] | None:
        """The plugin's own ``replay`` where nothing else would see the call (replay is a hot path): no fault
        is armed for it, no tracing, and no plugin but the backend and hal's fault injector implements it."""
        if self._untrace is not None or self.faults.armed("replay"):
            return None
        plugins = len(self._pm.get_plugins())  # the answer holds until a plugin is registered or unregistered
        cached = self._replay_cache
        if cached is not None and cached[0] == plugins:
            return cached[1]
        impls = self._hook.replay.get_hookimpls()
        direct = None
        if len(impls) == 2 and {impl.plugin for impl in impls} == {self.plugin, self.faults}:
            direct = next(impl.function for impl in impls if impl.plugin is self.plugin)
        self._replay_cache = (plugins, direct)
        return direct

    def release_graph(self, graph: Any) -> None:
        """Destroy a graph (its pool's memory stays with the pool); a later :meth:`replay` of it raises."""
        self._graph_call("release_graph", graph=graph)
        self._graph_pool.put(graph, _RELEASED, weak_only=True)

    # -- lifecycle --------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Unmap, free ranges and release chunks still live, then shut the backend down.

        Idempotent. Leftovers are logged (they are a leak in the caller).
        """
        with self._lock:
            if self._closed:
                return
            leftovers = (len(self._mappings), len(self._ranges), len(self._handles))
            if any(leftovers):
                log.warning("%s: close() releases %d mapping(s), %d range(s), %d chunk(s) still live",
                            self.name, *leftovers)
            errors: list[BaseException] = []
            graphs, pools = self.accounting.graphs.alive(), self.accounting.pools.alive()
            if graphs or pools:
                log.warning("%s: close() releases %d graph(s) and %d pool(s) still live", self.name, len(graphs),
                            len(pools))
            for graph in graphs:  # graphs first: they hold their pools' memory
                with _collect(errors):
                    self.release_graph(graph)
            for pool in pools:
                with _collect(errors):
                    self.release_pool(pool)
            self.accounting.graphs.clear()  # what was collected unreleased is gone with the backend
            self.accounting.pools.clear()
            for m in list(self._mappings.values()):
                with _collect(errors):
                    self.unmap(m.ptr, m.size)
            for ptr, size in list(self._ranges.items()):
                with _collect(errors):
                    self.release_vir_ptr(ptr, size)
            for handle in list(self._handles):
                with _collect(errors):
                    self.release_phy_mem_handle(handle)
            with _collect(errors), self._plugin_faults("shutdown"):
                if "shutdown" in self._implemented:
                    self._hook.shutdown()
            self._closed = True
            if self._untrace is not None:
                self._untrace()
            if errors:
                raise errors[0]


@dataclass(eq=False)
class _PoolState:
    """What :meth:`Backend.replay` checks of the pool a graph was captured into (shared with the graph)."""

    paused: Callable[[], bool] | None = None
    released: bool = False

    def why_not(self) -> str:
        if self is _RELEASED:
            return "the graph was released (release_graph); capture a new graph to replay this work"
        if self.released:
            return ("the pool the graph was captured into was released (release_pool, or graphkit's "
                    "pools.release(key) / close()), so the memory its replay reads and writes is gone; capture "
                    "the graph again into a live pool (release graphs before their pools)")
        return "the graph's memory is paused (released while asleep): resume it before replaying"


#: the state of a released graph's pool: nothing replays it
_RELEASED = _PoolState(released=True)


class _ByIdentity:
    """A map keyed by object identity that forgets an object when it dies (objects need not be hashable)."""

    def __init__(self) -> None:
        self._items: dict[int, tuple[Callable[[], Any], Any]] = {}
        self._lock = threading.Lock()

    def put(self, obj: Any, value: Any, *, weak_only: bool = False) -> None:
        """Map ``obj`` to ``value``; ``weak_only``: forget ``obj`` instead where it cannot be weakly referred
        to (a mark that must not keep it alive)."""
        key = id(obj)
        items = self._items

        def forget(_: object) -> None:
            items.pop(key, None)

        try:
            ref: Callable[[], Any] = weakref.ref(obj, forget)
        except TypeError:  # not weakly referable: held until popped
            if weak_only:
                self.pop(obj)
                return
            ref = functools.partial(_same, obj)
        with self._lock:
            self._items[key] = (ref, value)

    def get(self, obj: Any) -> Any:
        item = self._items.get(id(obj))
        return item[1] if item is not None and item[0]() is obj else None

    def pop(self, obj: Any) -> None:
        with self._lock:
            item = self._items.get(id(obj))
            if item is not None and item[0]() is obj:
                del self._items[id(obj)]


def _same(obj: Any) -> Any:
    return obj


def backend_pool(pool: Any) -> Any:
    """The backend pool behind ``pool``: objects that stand for one (a graphkit pool handle) say so
    through a ``__hal_pool__`` attribute, which raises a :class:`hal.HalError` once that pool is gone."""
    unwrap = getattr(type(pool), "__hal_pool__", None)
    return pool if unwrap is None else pool.__hal_pool__


@contextlib.contextmanager
def _collect(errors: list[BaseException]) -> Iterator[None]:
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - keep releasing the rest
        log.error("close: %s", str(exc))
        errors.append(exc)
