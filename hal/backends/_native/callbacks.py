"""The C allocator callbacks behind a torch pool, for every backend.

torch's pluggable allocator (``torch._C._cuda_customAllocator``) and its
counterparts in torch_npu (``_npu_customAllocator``) and torch_mlu
(``_mlu_customAllocator``) take the same two C function pointers:

    void* alloc(size_t size, int device, <stream> stream)
    void  free(void* ptr, size_t size, int device, <stream> stream)

where the stream is an opaque pointer (``cudaStream_t``, ``aclrtStream``,
``cnrtQueue_t``). A :class:`CallbackPair` makes them around hal-level
``alloc(nbytes) -> address`` and ``free(address, nbytes)``:

* they run while torch's allocator holds its lock, so the garbage collector
  is off inside them (a collection there could free a tensor and need that
  lock again), and no exception escapes into C: a failed ``alloc`` returns
  NULL, torch raises its own out-of-memory error, and the reason is logged
  and kept in :attr:`CallbackPair.last_error` for the capture to attach;
* torch keeps raw pointers to them and to the allocator object, and may call
  ``free`` long after the pool was dropped (when the last tensor of a segment
  dies): every pair stays in :data:`KEEP_ALIVE` until the process ends. Once
  its pool was released and every segment came back, a pair forgets the
  Python callables it wrapped so that they can be collected.
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import threading
from typing import Any

from hal.api import AllocFn, FreeFn
from hal.gcguard import gc_disabled
from hal.types import fmt_bytes

#: ``void* alloc(size_t size, int device, void* stream)``
ALLOC_FN = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)
#: ``void free(void* ptr, size_t size, int device, void* stream)``
FREE_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)


def address_of(callback: Any) -> int:
    """The C function pointer of a ctypes callback, as a ``_customAllocator`` wants it."""
    return ctypes.cast(callback, ctypes.c_void_p).value or 0


class CallbackPair:
    """The C callbacks of one custom pool and the state they share.

    :param device: the device the pool belongs to; torch asking for another one gets NULL.
    :param backend: the backend's name: errors are logged to ``hal.<backend>``.
    :param label: names the pool in messages, e.g. ``"cuda pool #3 (device 0)"``.
    """

    def __init__(self, alloc: AllocFn, free: FreeFn, *, device: int, backend: str, label: str) -> None:
        self.alloc: AllocFn | None = alloc
        self.free: FreeFn | None = free
        self.device = device
        self.label = label
        self.log = logging.getLogger(f"hal.{backend}")
        self.live: dict[int, int] = {}  # segments handed to torch: address -> bytes
        self.pool_released = False
        self.last_error: str | None = None
        # closures, not bound methods over module globals: torch may call them while the interpreter
        # exits, after this module's globals were cleared
        guard = gc_disabled

        def c_alloc(size: int, device: int, stream: Any) -> int:
            with guard():
                return self._alloc_body(size, device)

        def c_free(ptr: int | None, size: int, device: int, stream: Any) -> None:
            if self.free is None and not self.live:
                return  # forgotten (released, or the process is exiting): nothing to give back
            with guard():
                self._free_body(ptr, size)

        self.c_alloc = ALLOC_FN(c_alloc)
        self.c_free = FREE_FN(c_free)
        self.torch_allocator: Any = None  # what ``_customAllocator`` made of them, kept alive here

    @property
    def addresses(self) -> tuple[int, int]:
        """Addresses of the C alloc and free functions."""
        alloc, free = address_of(self.c_alloc), address_of(self.c_free)
        assert alloc and free
        return alloc, free

    def _alloc_body(self, size: int, device: int) -> int:
        try:
            fn = self.alloc
            if fn is None:
                return self._fail(size, "the pool was released")
            if device != self.device:
                return self._fail(size, f"torch asked on device {device}, the pool belongs to device {self.device}")
            ptr = int(fn(size) or 0)
            if not ptr:
                return self._fail(size, "the allocator callback returned no memory (see its own log)")
            self.live[ptr] = size
            return ptr
        except BaseException as exc:  # not an undo: nothing may escape into torch's C++  # noqa: BLE001
            return self._fail(size, f"{type(exc).__name__}: {exc}")

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
        except BaseException as exc:  # not an undo: nothing may escape into torch's C++  # noqa: BLE001
            self.log.error("%s: free callback failed for %s at %#x: %s: %s", self.label, fmt_bytes(size),
                           ptr or 0, type(exc).__name__, exc)

    def _fail(self, size: int, why: str) -> int:
        """Keep and log why ``size`` bytes could not be given; return NULL."""
        self.last_error = f"{self.label}: no segment of {fmt_bytes(size)} ({size} bytes): {why}"
        self.log.error("allocator callback failed: %s", self.last_error)
        return 0

    def forget(self) -> None:
        """Drop the Python callables (the C callbacks stay valid and refuse from now on)."""
        self.alloc = None
        self.free = None


#: every callback pair ever made: torch may call them until the process ends
KEEP_ALIVE: list[CallbackPair] = []
_keep_alive_lock = threading.Lock()


@atexit.register
def _forget_all() -> None:
    """At exit, before modules are torn down: segments freed from now on go nowhere (the process ends)."""
    with _keep_alive_lock:
        for pair in KEEP_ALIVE:
            pair.forget()
            pair.live.clear()


def keep_forever(obj: object) -> None:
    """Give ``obj`` a reference nobody drops, so it outlives even the interpreter's teardown.

    At exit, CPython clears module globals and then collects what is left in
    reference cycles; framework tensors freed in that last collection still
    call the C callbacks, and a callback whose ctypes object was collected
    first is a jump into freed memory (a segmentation fault instead of the
    exit code). The memory this keeps is a few hundred bytes per pool.
    """
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))


def new_pair(alloc: AllocFn, free: FreeFn, *, device: int, backend: str) -> CallbackPair:
    """A :class:`CallbackPair` for a new pool, kept alive for the lifetime of the process (teardown included)."""
    with _keep_alive_lock:
        pair = CallbackPair(alloc, free, device=device, backend=backend,
                            label=f"{backend} pool #{len(KEEP_ALIVE) + 1} (device {device})")
        KEEP_ALIVE.append(pair)
    for obj in (pair, pair.c_alloc, pair.c_free):
        keep_forever(obj)
    return pair


def live_callback_pairs() -> int:
    """How many callback pairs still wrap Python callables (diagnostics)."""
    with _keep_alive_lock:
        return sum(p.alloc is not None for p in KEEP_ALIVE)
