"""The hal contract: the hooks every backend implements.

A backend is a pluggy plugin: a class whose methods are marked with
``@hal.hookimpl`` and named after the hooks below. One instance serves one
device. The facade (:class:`hal.Backend`) owns a ``PluginManager`` with
exactly one backend registered, so every ``firstresult`` hook below has a
single answer; the other plugins on that manager are wrappers (accounting,
fault injection) that see every call.

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

Startup: the facade adds these specs, registers the backend instance and
calls ``check_pending()``, so a plugin that implements a hook not listed
here fails at load, naming the plugin and the hook.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, ContextManager

import pluggy

if TYPE_CHECKING:  # pragma: no cover
    from hal.types import CaptureRouter, MemInfo

hookspec = pluggy.HookspecMarker("hal")
hookimpl = pluggy.HookimplMarker("hal")

#: Allocation callback handed to :func:`create_pool`: ``alloc(nbytes) -> address``.
#: When it cannot allocate it raises (a :class:`hal.DeviceOutOfMemoryError` with
#: the reason) or returns 0; a backend never lets that reach native code and turns
#: it into the framework's out-of-memory error, keeping the reason.
AllocFn = Callable[[int], int]
#: Release callback handed to :func:`create_pool`: ``free(address, nbytes)``.
FreeFn = Callable[[int, int], None]

# ---------------------------------------------------------------------------
# Device queries
# ---------------------------------------------------------------------------


@hookspec(firstresult=True)
def device_count() -> int:
    """Return the number of devices this backend sees (``>= 1`` when available).

    Stops at the first non-None result.
    """


@hookspec(firstresult=True)
def granularity(recommended: bool) -> int:
    """Return the physical allocation granularity of the device, in bytes.

    :param recommended: ``False`` for the minimum granularity (every size
        passed to the vmm hooks is a multiple of it), ``True`` for the
        granularity the driver recommends for performance (a multiple of the
        minimum).

    Stops at the first non-None result.
    """


@hookspec(firstresult=True)
def mem_info() -> MemInfo:
    """Return the device's free and total memory in bytes, as the driver sees it.

    Stops at the first non-None result.
    """


# ---------------------------------------------------------------------------
# Virtual memory management (vmm_api)
# ---------------------------------------------------------------------------


@hookspec(firstresult=True)
def create_vir_ptr(size: int) -> int:
    """Reserve ``size`` bytes of virtual address space; return its start address.

    :param size: a positive multiple of the minimum granularity.
    :returns: an address aligned to the minimum granularity. Nothing is
        accessible there until a handle is mapped.
    :raises DeviceOutOfMemoryError: no address space left.

    Stops at the first non-None result.
    """


@hookspec(firstresult=True)
def release_vir_ptr(ptr: int, size: int) -> None:
    """Free a whole range returned by :func:`create_vir_ptr` (nothing mapped in it).

    :param ptr: the start address returned by ``create_vir_ptr``.
    :param size: the size that was reserved.
    """


@hookspec(firstresult=True)
def create_phy_mem_handle(size: int) -> Any:
    """Allocate one physical chunk of ``size`` bytes; return its handle.

    :param size: a positive multiple of the minimum granularity.
    :returns: an opaque, hashable handle.
    :raises DeviceOutOfMemoryError: the device has not that much free memory.

    Stops at the first non-None result.
    """


@hookspec(firstresult=True)
def release_phy_mem_handle(handle: Any) -> None:
    """Free a physical chunk (it is mapped nowhere any more)."""


@hookspec(firstresult=True)
def map(ptr: int, size: int, handle: Any) -> None:
    """Map a whole chunk at ``ptr`` and make it readable and writable by the device.

    :param ptr: inside a reserved range, aligned to the minimum granularity.
    :param size: exactly the size of the chunk (maps are whole handles, offset 0).
    :param handle: a live handle from :func:`create_phy_mem_handle`.

    After it returns, bytes written through this mapping are visible through
    every other mapping of the same handle.
    """


@hookspec(firstresult=True)
def unmap(ptr: int, size: int) -> None:
    """Undo exactly one earlier :func:`map` of ``size`` bytes at ``ptr``.

    The range stays reserved; the chunk stays allocated.
    """


# ---------------------------------------------------------------------------
# Graphs, streams and memory pools (the half that keeps graphkit neutral)
# ---------------------------------------------------------------------------


@hookspec(firstresult=True)
def capabilities() -> frozenset[str]:
    """Return what this backend can do beyond the vmm hooks.

    Known names: ``"graphs"`` (the graph hooks below work), ``"custom_pool"``
    (:func:`create_pool` accepts allocator callbacks), ``"capture_routing"``
    (:func:`route_captures` works), ``"use_pool"`` (:func:`use_pool` works).
    A backend that lacks ``"custom_pool"`` still supports pools drawn from
    its own allocator.
    """


@hookspec(firstresult=True)
def torch_device() -> Any:
    """Return the ``torch.device`` whose tensors live on this backend's device."""


@hookspec(firstresult=True)
def create_stream() -> Any:
    """Return a new stream (queue) on the device, for capture or for work."""


@hookspec(firstresult=True)
def current_stream() -> Any:
    """Return the stream that work is submitted to now."""


@hookspec(firstresult=True)
def use_stream(stream: Any) -> ContextManager[Any]:
    """Return a context manager inside which ``stream`` is the current stream."""


@hookspec(firstresult=True)
def synchronize(stream: Any) -> None:
    """Wait until all work on ``stream`` (the whole device when ``None``) is done.

    Returns ``None``; every implementation must still return after waiting.
    """


@hookspec(firstresult=True)
def create_pool(alloc: AllocFn | None, free: FreeFn | None) -> Any:
    """Return a memory pool that graph captures can draw from.

    :param alloc: with ``free``, the pool takes its segments from these
        callbacks (needs the ``"custom_pool"`` capability); ``None`` for a
        pool drawn from the device's own allocator, which several captures
        may share.
    :returns: an opaque pool object, passed to :func:`capture`.
    """


@hookspec(firstresult=True)
def use_pool(pool: Any) -> ContextManager[None]:
    """Return a context manager inside which the framework's allocations on this thread come from ``pool``.

    Outside any capture: ``torch.randn(...)`` made inside the block lives in
    the pool's segments (``torch.cuda.use_mem_pool`` on CUDA). Needs the
    ``"use_pool"`` capability.
    """


@hookspec(firstresult=True)
def tensor_at(ptr: int, nbytes: int, owner: Any) -> Any:
    """Return a ``torch.uint8`` tensor of ``nbytes`` over device memory at ``ptr`` (no copy).

    The tensor (and every view of it) keeps ``owner`` alive, when given; it
    does not own the memory, which must stay mapped where the tensor is
    read or written. Used to copy mapped memory to and from the host, and
    for framework views of graphkit's buffers.
    """


@hookspec(firstresult=True)
def pool_active_blocks(pool: Any) -> list[tuple[int, int]]:
    """Return ``(address, nbytes)`` of every block of ``pool`` still in use.

    Used after a capture to find memory that outlived it other than the
    outputs (a cache or workspace created inside a capture).
    """


@hookspec(firstresult=True)
def release_pool(pool: Any) -> None:
    """Drop a pool; its segments go back to the allocator they came from."""


@hookspec(firstresult=True)
def create_graph() -> Any:
    """Return a new, empty graph object."""


@hookspec(firstresult=True)
def capture(graph: Any, pool: Any, stream: Any, capture_error_mode: str | None) -> ContextManager[Any]:
    """Return a context manager that captures the work inside it into ``graph``.

    :param pool: a pool from :func:`create_pool`, or ``None`` for a pool
        private to this graph.
    :param stream: the capture stream (from :func:`create_stream`).
    :param capture_error_mode: ``"global"``, ``"thread_local"`` or
        ``"relaxed"``, as in ``torch.cuda.graph``; ``None`` for the backend's
        default (``"global"`` on CUDA and Ascend, ``"relaxed"`` on MLU).
    :raises CaptureError: when the captured work cannot be captured (a host
        synchronisation, an exhausted resource), with advice where there is
        some.
    """


@hookspec(firstresult=True)
def route_captures(router: CaptureRouter) -> ContextManager[None]:
    """Return a context manager inside which every capture on this device asks ``router`` for its pool.

    Every capture that *starts* inside the block counts: through the
    framework's own API (``torch.cuda.graph``, ``torch.npu.graph``,
    ``CUDAGraph.capture_begin``), from any thread, whatever pool the caller
    passed, and through :func:`capture`. For each one the backend calls
    ``router(graph, requested_pool)`` before the capture begins, uses the
    returned :class:`hal.types.Route`'s pool instead of the requested one, and
    calls the route's ``on_end`` and ``on_release`` as that class describes
    (for graphs reset or collected after the block ended too). Leaving the
    block restores the framework exactly; blocks nest (the innermost router
    wins). Needs the ``"capture_routing"`` capability.
    """


@hookspec(firstresult=True)
def default_capture_stream() -> Any:
    """Return the stream the framework's own capture API captures on when given none.

    Warm-up for captures that the framework starts (``torch.cuda.graph``
    without ``stream=``) runs there, so state born lazily on first use
    (cuBLAS workspaces) is born outside the capture.
    """


@hookspec(firstresult=True)
def replay(graph: Any) -> None:
    """Launch a captured graph on the stream it was captured on."""


@hookspec(firstresult=True)
def release_graph(graph: Any) -> None:
    """Destroy a graph; the memory of its pool is not freed by this."""


# ---------------------------------------------------------------------------
# Lifecycle
# ---------------------------------------------------------------------------


@hookspec(firstresult=True)
def shutdown() -> None:
    """Release whatever the backend itself holds (contexts, libraries).

    Called once by ``Backend.close()`` after every handle, mapping and range
    has been released.
    """


#: Hooks of the vmm half, in the order of the design card.
VMM_HOOKS = (
    "create_vir_ptr",
    "release_vir_ptr",
    "create_phy_mem_handle",
    "release_phy_mem_handle",
    "map",
    "unmap",
)

#: Every hook name of the contract.
ALL_HOOKS = tuple(
    name for name, obj in list(globals().items()) if callable(obj) and hasattr(obj, "hal_spec")
)
