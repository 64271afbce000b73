"""The hal contract: the hooks every backend implements.

A backend is a pluggy plugin: a class whose methods are marked with
``@hal.hookimpl`` and named after the hooks below. One instance serves one
device; it is built as ``cls(device=..., **options)``. The facade
(:class:`hal.Backend`) owns a ``PluginManager`` with exactly one backend
registered, so every hook is ``firstresult``: the backend's answer is *the*
answer. The other plugins on that manager are wrappers (accounting, fault
injection, tracing) that see every call and never answer one themselves.

Conventions for every hook:

* sizes and addresses are plain ``int`` bytes; addresses are device virtual
  addresses (host addresses on ``fake``);
* a physical handle is an opaque hashable object owned by the backend;
* arguments have already been checked by the facade (sizes are positive
  multiples of the granularity, maps are whole handles into reserved
  ranges...), so a backend only checks what its driver checks;
* failures raise :mod:`hal.errors`: ``DeviceOutOfMemoryError`` when memory
  runs out, ``DriverError`` (with the native code) for any other native
  failure, ``InvalidArgumentError`` when the driver refuses an argument.

**Results.** A hook listed in :data:`RESULT_HOOKS` returns its value and
never ``None``; the facade treats a ``None`` from one of them as a broken
plugin (:class:`hal.PluginValidationError`). Every other hook performs an
action and returns ``None``; the facade ignores whatever it returns.

**"Not implemented" has one meaning**: the call raises
:class:`hal.UnsupportedError` naming the backend and the call. A backend
gets there in one of two ways, never by returning ``None``:

* it leaves the hook out, and the facade raises the error (naming the
  capability that would provide the hook, where one does);
* when it knows only at run time whether it can (its torch extension is
  missing, the framework allocator is configured without pools), it
  implements the hook, leaves the capability out of :func:`capabilities`,
  and the hook raises ``UnsupportedError`` with the reason.

**Capabilities** (:data:`CAPABILITIES`) group the optional hooks; a backend
declares them from :func:`capabilities`. A declared capability counts only
when every hook :data:`CAPABILITY_HOOKS` lists for it is implemented (the
facade drops it otherwise, with a warning). Where one hook serves with and
without a capability, the facade refuses the capability's use before the
backend sees it: :func:`create_pool` with callbacks without
``"custom_pool"``, :func:`use_pool` without ``"use_pool"``,
:func:`route_captures` without ``"capture_routing"``. Six hooks sit
outside every capability: :func:`tensor_at` (``UnsupportedError`` when
absent), :func:`default_capture_stream` (the current stream when absent),
:func:`prepare_capture_stream` and :func:`stream_state_sizes` (nothing to
prepare when absent), :func:`deferred_access` (each map accessible at once
when absent) and :func:`shutdown` (nothing to do when absent).

Startup: the facade adds these specs, registers the backend instance and
calls ``check_pending()``, so a plugin that implements a hook not listed
here fails at load, naming the plugin and the hook.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Hashable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING

import pluggy

from hal.types import Graph, GraphAddresses, MemInfo, Pool, Stream

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from hal.types import CaptureRouter

hookspec = pluggy.HookspecMarker("hal")
hookimpl = pluggy.HookimplMarker("hal")

#: Allocation callback handed to :func:`create_pool`: ``alloc(nbytes) -> address``.
#: When it cannot allocate it raises (a :class:`hal.DeviceOutOfMemoryError` with
#: the reason) or returns 0; a backend never lets that reach native code and turns
#: it into the framework's out-of-memory error, keeping the reason.
AllocFn = Callable[[int], int]
#: Release callback handed to :func:`create_pool`: ``free(address, nbytes)``.
#: It must not raise; a backend calls it once per segment ``alloc`` returned.
FreeFn = Callable[[int, int], None]

# ---------------------------------------------------------------------------
# Device queries (required)
# ---------------------------------------------------------------------------


@hookspec(firstresult=True)
def device_count() -> int:
    """Return the number of devices this backend sees (``>= 1`` when it is available).

    Must not raise once the backend was constructed.
    """


@hookspec(firstresult=True)
def granularity(recommended: bool) -> int:
    """Return the physical allocation granularity of the device, in bytes.

    :param recommended: ``False`` for the minimum granularity (every size
        passed to the vmm hooks is a multiple of it), ``True`` for the
        granularity the driver recommends for performance (a multiple of the
        minimum; the minimum itself when the driver has no preference).
    """


@hookspec(firstresult=True)
def mem_info() -> MemInfo:
    """Return the device's free and total memory in bytes, as the driver sees it.

    ``0 <= free <= total`` and ``total > 0``. ``total - free`` is what
    graphkit measures graph memory by, so every byte the backend hands out
    counts in it: chunks, and the segments of pools drawn from the device's
    own allocator (for :class:`hal.host.HostGraphs`, what its ``alloc``
    returned). A device that is really host memory reports the capacity it
    enforces as ``total`` (the host's RAM where it enforces none).
    """


# ---------------------------------------------------------------------------
# Virtual memory management, the vmm_api (required)
# ---------------------------------------------------------------------------


@hookspec(firstresult=True)
def create_vir_ptr(size: int) -> int:
    """Reserve ``size`` bytes of virtual address space; return its start address.

    :param size: a positive multiple of the minimum granularity.
    :returns: a non-zero address aligned to the minimum granularity. Nothing
        is accessible there until a handle is mapped.
    :raises DeviceOutOfMemoryError: no address space left.
    """


@hookspec(firstresult=True)
def release_vir_ptr(ptr: int, size: int) -> None:
    """Free a whole range returned by :func:`create_vir_ptr`; nothing is mapped in it any more.

    :param ptr: the start address returned by ``create_vir_ptr``.
    :param size: the size that was reserved.
    :raises DriverError: the driver refused.
    """


@hookspec(firstresult=True)
def create_phy_mem_handle(size: int) -> Hashable:
    """Allocate one physical chunk of ``size`` bytes; return its handle.

    :param size: a positive multiple of the minimum granularity.
    :returns: an opaque, hashable handle that no other live chunk has.
    :raises DeviceOutOfMemoryError: the device has not that much free memory.
    """


@hookspec(firstresult=True)
def release_phy_mem_handle(handle: Hashable) -> None:
    """Free a physical chunk; it is mapped nowhere any more.

    :raises DriverError: the driver refused.
    """


@hookspec(firstresult=True)
def map(ptr: int, size: int, handle: Hashable) -> None:
    """Map a whole chunk at ``ptr`` and make it readable and writable by the device.

    :param ptr: inside a reserved range, aligned to the minimum granularity.
    :param size: exactly the size of the chunk (maps are whole handles, offset 0).
    :param handle: a live handle from :func:`create_phy_mem_handle`.
    :raises DriverError: the driver refused; nothing stays mapped then.

    After it returns, bytes written through this mapping are visible through
    every other mapping of the same handle.
    """


@hookspec(firstresult=True)
def unmap(ptr: int, size: int) -> None:
    """Undo exactly one earlier :func:`map` of ``size`` bytes at ``ptr``.

    The range stays reserved; the chunk stays allocated. Work queued on the
    device before the call may still use the range: a backend whose unmap
    waits for that work itself declares ``"unmap_waits"``; otherwise callers
    wait first (``Backend.unmap(..., wait=True)`` synchronizes the device for
    them). A backend that knows the range is still in use raises
    :class:`hal.UseAfterUnmapError` and unmaps nothing.

    :raises DriverError: the driver refused.
    """


@hookspec(firstresult=True)
def deferred_access() -> AbstractContextManager[None]:
    """Return a context manager inside which :func:`map` on this thread may leave what it maps inaccessible.

    When the block ends -- also through an exception -- every mapping made
    inside it and still mapped is made read-write, with one call per
    contiguous run of mappings where the driver allows it (one
    ``cuMemSetAccess`` for many chunks side by side, instead of one per
    chunk). Memory mapped inside must not be touched before the block
    ends. A block inside another on the same thread joins the outer one.
    Optional, outside every capability: without it each :func:`map` makes
    its memory accessible at once, and the facade's block changes nothing.
    """


@hookspec(firstresult=True)
def capabilities() -> frozenset[str]:
    """Return the names from :data:`CAPABILITIES` this backend supports now.

    ``"graphs"`` (streams, pools and the graph hooks work), ``"custom_pool"``
    (:func:`create_pool` accepts allocator callbacks), ``"capture_routing"``
    (:func:`route_captures` works), ``"use_pool"`` (:func:`use_pool` works),
    ``"graph_addresses"`` (:func:`graph_addresses` answers), ``"lazy_graphs"``
    (:func:`create_graph` takes ``lazy=True``), ``"graph_update"``
    (:func:`update_graph` works), ``"memory_sharing"``
    (:func:`export_phy_mem_handle` and :func:`import_phy_mem_handle` work: another
    process can map this backend's chunks), ``"unmap_waits"`` (:func:`unmap`
    returns only once the device work queued before it is done, as ROCm's
    ``hipMemUnmap`` does: ``Backend.unmap(..., wait=True)`` and ``close()`` then
    skip their own ``synchronize``; no built-in backend declares it). A backend
    that lacks ``"custom_pool"`` still supports pools drawn from its own
    allocator. Optional: a backend without it has no capabilities.
    An override in a subclass is a hook only when it is marked
    ``@hal.hookimpl`` again (an unmarked one is refused at load). Anything
    but a hal error raised here is reported as
    :class:`hal.PluginValidationError`, and selection passes the backend over.
    """


@hookspec(firstresult=True)
def torch_device() -> torch.device:
    """Return the ``torch.device`` whose tensors live on this backend's device.

    Part of ``"graphs"``; a vmm-only backend leaves it out.
    """


@hookspec(firstresult=True)
def tensor_at(ptr: int, nbytes: int, owner: object) -> torch.Tensor:
    """Return a ``torch.uint8`` tensor of ``nbytes`` over device memory at ``ptr`` (no copy).

    The tensor (and every view of it) keeps ``owner`` alive, when given; it
    does not own the memory, which must stay mapped where the tensor is
    read or written. Used to copy mapped memory to and from the host, and
    for framework views of graphkit's buffers. Optional, outside every
    capability: leave it out when the framework cannot wrap a raw address.
    """


# ---------------------------------------------------------------------------
# Streams ("graphs")
# ---------------------------------------------------------------------------


@hookspec(firstresult=True)
def create_stream() -> Stream:
    """Return a new stream (queue) on the device, for capture or for work."""


@hookspec(firstresult=True)
def current_stream() -> Stream:
    """Return the stream that work is submitted to now, on this thread."""


@hookspec(firstresult=True)
def use_stream(stream: Stream) -> AbstractContextManager[Stream]:
    """Return a context manager inside which work is submitted to ``stream``.

    A device whose work runs when it is issued (``fake``) may return a
    context manager that changes nothing.
    """


@hookspec(firstresult=True)
def synchronize(stream: Stream | None) -> None:
    """Return once all work on ``stream`` (the whole device when ``None``) is done."""


@hookspec(firstresult=True)
def default_capture_stream() -> Stream:
    """Return the stream the framework's own capture API captures on when given none.

    Warm-up for captures that the framework starts (``torch.cuda.graph``
    without ``stream=``) runs there, so state born lazily on first use
    (cuBLAS workspaces) is born outside the capture. Optional: the facade
    uses :func:`current_stream` when it is absent.
    """


@hookspec(firstresult=True)
def prepare_capture_stream(stream: Stream) -> None:
    """Make, outside any capture, the state the framework's libraries create at their first use of ``stream``.

    Some libraries allocate per-stream state lazily, through the framework's
    allocator, the first time they run on a stream (cuBLAS and cuBLASLt keep a
    workspace per library handle and stream). Made inside a capture, that state
    lands in the capture's pool -- memory other graphs overwrite when pools share
    physical memory. hal calls this before every capture it starts or routes, on
    the capture's stream and thread, and never while that stream captures. It
    must be cheap when nothing is left to make. Optional: a backend without it
    has nothing to prepare.
    """


@hookspec(firstresult=True)
def stream_state_sizes() -> dict[int, str]:
    """Return ``{bytes: what}`` for the per-stream state :func:`prepare_capture_stream` makes (measured).

    graphkit names such a block when a graph uses one that another capture
    allocated ("the size of cuBLAS's workspace"). Optional: ``{}`` when absent.
    """


@hookspec(firstresult=True)
def stream_state_bytes() -> int:
    """Return the bytes of per-stream state :func:`prepare_capture_stream` made so far on this device, over every
    stream and thread it prepared (measured as the framework's allocator grew).

    Reports count it as the capture streams' workspaces: memory every graph of those streams uses, made once
    per stream. Optional: 0 when absent.
    """


# ---------------------------------------------------------------------------
# Memory pools ("graphs"; callbacks need "custom_pool", use_pool needs "use_pool")
# ---------------------------------------------------------------------------


@hookspec(firstresult=True)
def create_pool(alloc: AllocFn | None, free: FreeFn | None) -> Pool:
    """Return a memory pool that graph captures can draw from.

    :param alloc: with ``free``, the pool takes its segments from these
        callbacks (only called when ``"custom_pool"`` is declared; the
        facade refuses the call otherwise); ``None`` for a pool drawn from
        the device's own allocator, which several captures may share.
    :returns: an opaque pool object, passed to :func:`capture`.
    :raises UnsupportedError: callbacks given but the framework cannot use
        them (for a reason only known at run time).
    """


@hookspec(firstresult=True)
def use_pool(pool: Pool) -> AbstractContextManager[None]:
    """Return a context manager inside which the framework's allocations on this thread come from ``pool``.

    Outside any capture: ``torch.randn(...)`` made inside the block lives in
    the pool's segments (``torch.cuda.use_mem_pool`` on CUDA). Needs the
    ``"use_pool"`` capability.
    """


@hookspec(firstresult=True)
def pool_active_blocks(pool: Pool) -> list[tuple[int, int]]:
    """Return ``(address, nbytes)`` of every block of ``pool`` still in use (``[]`` when none).

    Used after a capture to find memory that outlived it other than the
    outputs (a cache or workspace created inside a capture). A framework
    that cannot enumerate a pool's blocks returns ``[]`` and logs that once.
    """


@hookspec(firstresult=True)
def release_pool(pool: Pool) -> None:
    """Drop a pool; its segments go back to the allocator they came from.

    Segments still holding live tensors go back when those tensors die;
    with callbacks, every segment ``alloc`` gave is handed to ``free`` once.
    A graph captured into the pool can no longer be replayed: the facade
    refuses it with :class:`hal.InvalidStateError`.
    """


# ---------------------------------------------------------------------------
# Graphs ("graphs"; route_captures needs "capture_routing")
# ---------------------------------------------------------------------------


@hookspec(firstresult=True)
def create_graph(lazy: bool) -> Graph:
    """Return a new, empty graph object.

    :param lazy: with ``"lazy_graphs"``: make the graph's executable form
        (the driver's memory of an instantiated graph) at its first replay
        instead of at the end of its capture, so that a graph never replayed
        keeps none; that first replay pays the instantiation. Replays give
        the same results either way. A backend without the capability never
        sees ``True``, and its implementation may leave the parameter out.
    """


@hookspec(firstresult=True)
def capture(graph: Graph, pool: Pool | None, stream: Stream,
            capture_error_mode: str | None, inspect: bool) -> AbstractContextManager[Graph]:
    """Return a context manager that captures the work inside it into ``graph``.

    :param pool: a pool from :func:`create_pool`, or ``None`` for a pool
        private to this graph.
    :param stream: the capture stream (from :func:`create_stream`).
    :param capture_error_mode: ``"global"``, ``"thread_local"`` or
        ``"relaxed"``, as in ``torch.cuda.graph``; ``None`` for the backend's
        default (``"global"`` on CUDA and Ascend, ``"relaxed"`` on MLU).
    :param inspect: with ``"graph_addresses"``: record, before the capture
        ends, what :func:`graph_addresses` will report for this graph (a
        backend that records it anyway may ignore the flag; one without the
        capability never sees ``True``). A plugin may leave the parameter out
        of its implementation.
    :raises CaptureError: when the captured work cannot be captured (a host
        synchronisation, an exhausted resource), with advice where there is
        some; the graph is then empty and the backend still usable.
    :raises InvalidStateError: ``graph`` was captured or released before.
    """


@hookspec(firstresult=True)
def replay(graph: Graph) -> None:
    """Launch a captured graph on the stream it was captured on, without running Python again.

    Never called (the facade raises :class:`hal.InvalidStateError` first) for
    a graph that was released, or whose pool was released or is paused.
    """


@hookspec(firstresult=True)
def release_graph(graph: Graph) -> None:
    """Destroy a graph; the memory of its pool is not freed by this. Its replays are refused from then on."""


@hookspec(firstresult=True)
def update_graph(graph: Graph, source: Graph) -> None:
    """Make ``graph``'s replays run ``source``'s work from now on (``"graph_update"``).

    ``graph``'s executable form is updated in place with the nodes' arguments
    of ``source`` (the driver's ``cuGraphExecUpdate`` on CUDA), so that one
    executable graph serves every capture of one topology -- sizes whose
    kernels are the same, with other arguments -- instead of one each.
    ``source`` was created with ``lazy=True`` and captured; it is not
    instantiated by this. ``graph`` (lazy or not) was captured; it is
    instantiated first where it was not yet. ``source`` may be ``graph``
    itself (a lazy one): that instantiates it, or gives it its own work back.
    Replays already queued run the work they were launched with.

    :raises InvalidArgumentError: ``source`` was not created lazily, or its
        topology differs from ``graph``'s (the text says how); ``graph`` is
        then left as it was.
    :raises InvalidStateError: either graph is not captured, or was released.
    """


@hookspec(firstresult=True)
def graph_addresses(graph: Graph) -> GraphAddresses:
    """Return the device memory a captured graph's replay reads or writes (``"graph_addresses"``).

    Read from the graph itself -- a recording's tensors, or the argument
    words of a device graph's nodes -- so that graphkit can prove that
    graphs sharing physical memory never read each other's bytes.

    :param graph: captured by :func:`capture` with ``inspect=True``, or by the
        framework inside :func:`route_captures` with a route whose
        ``inspect`` is set.
    :returns: a :class:`hal.types.GraphAddresses`; its ``spans`` may be
        single addresses (``nbytes == 1``) where only pointers are known.
    :raises InvalidStateError: nothing was recorded for ``graph`` (not
        captured, released, or captured without ``inspect``).
    """


@hookspec(firstresult=True)
def route_captures(router: CaptureRouter) -> AbstractContextManager[None]:
    """Return a context manager inside which every capture on this device asks ``router`` for its pool.

    Every capture that *starts* inside the block counts: through the
    framework's own API (``torch.cuda.graph``, ``torch.npu.graph``,
    ``CUDAGraph.capture_begin``), from any thread, whatever pool the caller
    passed, and through :func:`capture`. For each one the backend calls
    ``router(graph, requested_pool)`` before the capture begins, uses the
    returned :class:`hal.types.Route`'s pool instead of the requested one, and
    calls the route's ``on_end`` and ``on_release`` as that class describes
    (for graphs reset or collected after the block ended too); with
    ``"graph_addresses"`` and a route whose ``inspect`` is set, it records
    the graph's addresses before calling ``on_end(True)``. Leaving the
    block restores the framework exactly; blocks nest (the innermost router
    wins). Needs the ``"capture_routing"`` capability.
    """


# ---------------------------------------------------------------------------
# Sharing chunks with another process ("memory_sharing")
# ---------------------------------------------------------------------------


@hookspec(firstresult=True)
def export_phy_mem_handle(handle: Hashable) -> int:
    """Return a new file descriptor through which another process can import the chunk ``handle``.

    The caller owns the descriptor: it sends it (``socket.send_fds`` over a Unix
    socket gives the receiver a descriptor of its own) and closes it. A chunk
    lives while any process holds it: releasing it here leaves an importer's
    copy of the handle, and its mappings, intact. CUDA: ``cuMemExportToShareableHandle``
    (a POSIX file descriptor), which works only for chunks created with that handle
    type requested.

    :param handle: a live handle from :func:`create_phy_mem_handle`.
    :raises UnsupportedError: this backend's chunks cannot be exported (known only at
        run time: the device cannot, or the option that requests it is off), with why.
    """


@hookspec(firstresult=True)
def import_phy_mem_handle(fd: int, size: int) -> Hashable:
    """Return a handle to the chunk of ``size`` bytes that a process exported as ``fd``.

    The handle maps (onto this backend's device, with access for it), unmaps and
    releases like one from :func:`create_phy_mem_handle`; ``fd`` stays the caller's
    to close. Bytes written through any mapping of the chunk, in any process, are
    visible through every other one.

    :param fd: a descriptor made by :func:`export_phy_mem_handle` (here or in another process).
    :param size: the chunk's size, a positive multiple of the minimum granularity.
    :raises InvalidArgumentError: ``fd`` is no exported chunk, or not of ``size`` bytes
        (where the backend can tell).
    """


# ---------------------------------------------------------------------------
# Lifecycle
# ---------------------------------------------------------------------------


@hookspec(firstresult=True)
def shutdown() -> None:
    """Release whatever the backend itself holds (contexts, libraries).

    Called once by ``Backend.close()`` after every graph, pool, mapping,
    range and handle has been released. Optional. Anything but a hal error
    raised here leaves ``close()`` as :class:`hal.PluginValidationError`
    (the backend is closed all the same).
    """


# ---------------------------------------------------------------------------
# The contract as data: what the registry and the facade check
# ---------------------------------------------------------------------------


def _spec_names() -> tuple[str, ...]:
    """Every hookspec of this module, in the order of definition (through pluggy's public parser)."""
    parser = pluggy.PluginManager("hal")
    module = sys.modules[__name__]
    return tuple(name for name in list(vars(module))
                 if callable(getattr(module, name)) and parser.parse_hookspec_opts(module, name) is not None)


#: Every hook name of the contract.
ALL_HOOKS: tuple[str, ...] = _spec_names()

#: Hooks of the vmm half, in the order a mapping's life calls them.
VMM_HOOKS = (
    "create_vir_ptr",
    "release_vir_ptr",
    "create_phy_mem_handle",
    "release_phy_mem_handle",
    "map",
    "unmap",
)

#: Hooks every backend implements (the plugin is refused at load without them).
REQUIRED_HOOKS = ("device_count", "granularity", "mem_info", *VMM_HOOKS)

#: Hooks whose result is their point: they never return ``None``.
RESULT_HOOKS = frozenset({
    "device_count", "granularity", "mem_info", "create_vir_ptr", "create_phy_mem_handle", "capabilities",
    "torch_device", "tensor_at", "create_stream", "current_stream", "use_stream", "default_capture_stream",
    "create_pool", "use_pool", "pool_active_blocks", "create_graph", "capture", "route_captures",
    "graph_addresses", "stream_state_sizes", "stream_state_bytes", "export_phy_mem_handle", "import_phy_mem_handle",
    "deferred_access",
})

#: The hooks of the ``"graphs"`` capability.
GRAPH_HOOKS = (
    "torch_device", "create_stream", "current_stream", "use_stream", "synchronize",
    "create_pool", "pool_active_blocks", "release_pool", "create_graph", "capture", "replay", "release_graph",
)

#: The hooks of the ``"memory_sharing"`` capability.
SHARING_HOOKS = ("export_phy_mem_handle", "import_phy_mem_handle")

#: Capability name -> the hooks it needs implemented. Every capability but ``"memory_sharing"`` and
#: ``"unmap_waits"`` (parts of the vmm half) builds on ``"graphs"``.
CAPABILITY_HOOKS: dict[str, tuple[str, ...]] = {
    "graphs": GRAPH_HOOKS,
    "custom_pool": GRAPH_HOOKS,  # and create_pool accepts alloc/free callbacks
    "capture_routing": (*GRAPH_HOOKS, "route_captures"),
    "use_pool": (*GRAPH_HOOKS, "use_pool"),
    "graph_addresses": (*GRAPH_HOOKS, "graph_addresses"),
    "lazy_graphs": GRAPH_HOOKS,  # and create_graph accepts lazy=True
    "graph_update": (*GRAPH_HOOKS, "update_graph"),
    "memory_sharing": SHARING_HOOKS,
    "unmap_waits": (),  # a promise about the required unmap hook: no hook of its own
}

#: The capability names hal knows (``hal.get_backend(requires=...)`` accepts these).
CAPABILITIES: frozenset[str] = frozenset(CAPABILITY_HOOKS)

#: Optional hook -> the capability it belongs to, for the error when it is missing.
HOOK_CAPABILITY: dict[str, str] = {
    **{hook: "graphs" for hook in GRAPH_HOOKS},
    "route_captures": "capture_routing",
    "use_pool": "use_pool",
    "graph_addresses": "graph_addresses",
    "update_graph": "graph_update",
    **{hook: "memory_sharing" for hook in SHARING_HOOKS},
}
