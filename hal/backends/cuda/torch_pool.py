"""Torch memory pools whose segments come from Python callbacks, with no compiled code.

torch (>= 2.8) lets a ``torch.cuda.MemPool`` take its segments from a
"pluggable" allocator: two C function pointers with the signatures

    void* alloc(size_t size, int device, cudaStream_t stream)
    void  free(void* ptr, size_t size, int device, cudaStream_t stream)

handed to ``torch._C._cuda_customAllocator``. Here they are ``ctypes``
callbacks around the hal-level ``alloc(nbytes) -> address`` and
``free(address, nbytes)``. The rules (DESIGN §6.3):

* the callbacks run while torch's allocator holds its lock: the garbage
  collector is off inside them, and they never let an exception escape
  (``alloc`` returns 0, torch raises its own out-of-memory error, and the
  reason is logged and kept for the capture to attach to that error);
* torch keeps raw pointers to them and to the allocator object, and may call
  ``free`` long after the pool was dropped (when the last tensor of a segment
  dies): every callback pair stays alive for the life of the process, in a
  module-level registry. Once its pool was released and every segment came
  back, a pair forgets the Python callables it wrapped so they can be
  collected.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

from hal.backends._native.callbacks import ALLOC_FN, FREE_FN  # torch's allocator signatures
from hal.errors import InvalidStateError, UnsupportedError
from hal.gcguard import gc_disabled
from hal.types import fmt_bytes

log = logging.getLogger("hal.cuda")

NAME = "cuda"
MIN_TORCH = (2, 8)



class CallbackPair:
    """The C callbacks of one custom pool and the state they share."""

    def __init__(self, alloc: Callable[[int], int], free: Callable[[int, int], None],
                 device: int, label: str) -> None:
        self.alloc: Callable[[int], int] | None = alloc
        self.free: Callable[[int, int], None] | None = free
        self.device = device
        self.label = label
        self.live: dict[int, int] = {}  # segments handed to torch: address -> bytes
        self.pool_released = False
        self.last_error: str | None = None
        self.c_alloc = ALLOC_FN(self._alloc)
        self.c_free = FREE_FN(self._free)
        self.torch_allocator: Any = None  # torch._C._cuda_CUDAAllocator, kept alive here

    @property
    def addresses(self) -> tuple[int, int]:
        """Addresses of the C alloc and free functions."""
        alloc = ctypes.cast(self.c_alloc, ctypes.c_void_p).value
        free = ctypes.cast(self.c_free, ctypes.c_void_p).value
        assert alloc and free
        return alloc, free

    def _alloc(self, size: int, device: int, stream: Any) -> int:
        with gc_disabled():
            return self._alloc_body(size, device)

    def _alloc_body(self, size: int, device: int) -> int:
        try:
            fn = self.alloc
            if fn is None:
                self._fail(size, "the pool was released")
                return 0
            if device != self.device:
                self._fail(size, f"torch asked on device {device}, the pool belongs to device {self.device}")
                return 0
            ptr = int(fn(size) or 0)
            if not ptr:
                self._fail(size, "the allocator callback returned no memory (see its own log)")
                return 0
            self.live[ptr] = size
            return ptr
        except BaseException as exc:  # nothing may escape into torch's C++
            self._fail(size, f"{type(exc).__name__}: {exc}")
            return 0

    def _free(self, ptr: int | None, size: int, device: int, stream: Any) -> None:
        with gc_disabled():
            self._free_body(ptr, size)

    def _free_body(self, ptr: int | None, size: int) -> None:
        try:
            if not ptr:
                return
            self.live.pop(ptr, None)
            fn = self.free
            if fn is not None:
                fn(ptr, size)
            if self.pool_released and not self.live:
                self.forget()
        except BaseException as exc:  # nothing may escape into torch's C++
            log.error("%s: free of %s at %#x failed: %s: %s", self.label, fmt_bytes(size), ptr or 0,
                      type(exc).__name__, exc)

    def _fail(self, size: int, why: str) -> None:
        self.last_error = f"{self.label}: no segment of {fmt_bytes(size)} ({size} bytes): {why}"
        log.error("%s", self.last_error)

    def forget(self) -> None:
        """Drop the Python callables (the C callbacks stay valid and refuse from now on)."""
        self.alloc = None
        self.free = None


#: every callback pair ever made; torch may call them until the process ends
_REGISTRY: list[CallbackPair] = []
_registry_lock = threading.Lock()


def live_callback_pairs() -> int:
    """How many callback pairs still wrap Python callables (diagnostics)."""
    with _registry_lock:
        return sum(p.alloc is not None for p in _REGISTRY)


@dataclass(eq=False)
class CudaPool:
    """A pool that captures draw from: a torch pool id and what keeps it alive."""

    id: tuple[int, int]
    device: int
    mempool: Any = None  # torch.cuda.MemPool (custom pools)
    callbacks: CallbackPair | None = None
    released: bool = False
    graphs: int = field(default=0)  # graphs captured into it and not yet released

    @property
    def custom(self) -> bool:
        return self.callbacks is not None

    def __repr__(self) -> str:
        kind = "custom" if self.custom else "device"
        state = " released" if self.released else ""
        return f"<cuda pool {self.id} {kind} device={self.device}{state}>"


def torch_version() -> tuple[int, int]:
    import torch

    major, minor = (int("".join(c for c in p if c.isdigit()) or 0) for p in torch.__version__.split(".")[:2])
    return major, minor


def custom_pool_unavailable_reason() -> str | None:
    """Why pools over Python allocator callbacks cannot work with this torch (None when they can)."""
    import torch

    if torch_version() < MIN_TORCH:
        return (f"torch {torch.__version__} is older than 2.8: its graph pools do not route "
                "segment allocations to a custom allocator")
    if not hasattr(torch.cuda, "MemPool") or not hasattr(torch._C, "_cuda_customAllocator"):
        return f"torch {torch.__version__} has no torch.cuda.MemPool over a custom allocator"
    backend = torch.cuda.get_allocator_backend()
    if backend != "native":
        return (f"torch's CUDA allocator backend is {backend!r} (PYTORCH_CUDA_ALLOC_CONF); its pools "
                "cannot take segments from a custom allocator: use the native backend")
    return None


def create_custom_pool(alloc: Callable[[int], int], free: Callable[[int, int], None], device: int) -> CudaPool:
    """A ``torch.cuda.MemPool`` on ``device`` whose segments come from ``alloc``/``free``."""
    import torch

    reason = custom_pool_unavailable_reason()
    if reason is not None:
        raise UnsupportedError(reason, backend=NAME, call="create_pool")
    with _registry_lock:
        pair = CallbackPair(alloc, free, device, label=f"cuda pool #{len(_REGISTRY) + 1} (device {device})")
        _REGISTRY.append(pair)
    pair.torch_allocator = torch._C._cuda_customAllocator(*pair.addresses)
    with torch.cuda.device(device):
        mempool = torch.cuda.MemPool(pair.torch_allocator)
    return CudaPool(id=tuple(mempool.id), device=device, mempool=mempool, callbacks=pair)


def create_device_pool(device: int) -> CudaPool:
    """A pool id drawn from torch's own allocator, shareable by several captures."""
    import torch

    with torch.cuda.device(device):
        return CudaPool(id=tuple(torch.cuda.graph_pool_handle()), device=device)


def _snapshot(pool_id: tuple[int, int]) -> list[dict]:
    import torch

    snapshot = torch.cuda.memory.memory_snapshot
    for kwargs in ({"mempool_id": pool_id, "include_traces": False}, {"mempool_id": pool_id}, {}):
        try:
            return list(snapshot(**kwargs))
        except TypeError:
            continue
    return list(torch.cuda.memory_snapshot())


def active_blocks(pool: CudaPool) -> list[tuple[int, int]]:
    """``(address, bytes)`` of the blocks of ``pool`` still allocated, from torch's snapshot."""
    if pool.released:
        raise InvalidStateError(f"{pool!r} was released", backend=NAME, call="pool_active_blocks")
    found = []
    for segment in _snapshot(pool.id):
        if tuple(segment.get("segment_pool_id", ())) != pool.id or segment.get("device", pool.device) != pool.device:
            continue
        address = int(segment["address"])
        for block in segment.get("blocks", ()):
            size = int(block["size"])
            if block.get("state") == "active_allocated":
                found.append((int(block.get("address", address)), size))
            address += size
    return sorted(found)


def release(pool: CudaPool) -> None:
    """Drop a pool: torch frees its segments (through ``free`` for a custom pool).

    Segments still holding live tensors go back when those tensors die.
    """
    import torch

    if pool.released:
        return
    pool.released = True
    if pool.graphs:
        log.warning("%r released while %d graph(s) of it are alive: its memory goes back only "
                    "after they are released", pool, pool.graphs)
    with torch.cuda.device(pool.device):
        if pool.callbacks is not None:
            pair = pool.callbacks
            pair.pool_released = True
            pool.mempool = None  # MemPool's destructor releases the pool and empties its cache
            if pair.live:
                log.warning("%s released while %d segment(s), %s, still hold live tensors: they go back "
                            "through free() when those tensors die. Keep the memory under them mapped and "
                            "reserved until then: a new range at the same addresses would confuse torch's "
                            "allocator when the old tensors are freed", pair.label, len(pair.live),
                            fmt_bytes(sum(pair.live.values())))
            else:
                pair.forget()
        else:
            torch.cuda.empty_cache()  # a handle-only pool's segments are freed with the device's cache
