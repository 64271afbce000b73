"""C allocator callbacks for a torch extension's custom allocator.

torch_npu (``_npu_customAllocator``) and torch_mlu (``_mlu_customAllocator``)
take the same two C function pointers as torch itself:

    void* alloc(size_t size, int device, <stream> stream)
    void  free(void* ptr, size_t size, int device, <stream> stream)

where the stream is an opaque pointer (``aclrtStream``, ``cnrtQueue_t``).
The rules (DESIGN §6.3): never let an exception cross into C, and keep every
pair alive for the lifetime of the process.
"""

from __future__ import annotations

import ctypes
import logging
from typing import Any

from hal.api import AllocFn, FreeFn

#: ``void* alloc(size_t size, int device, void* stream)``
ALLOC_FN = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)
#: ``void free(void* ptr, size_t size, int device, void* stream)``
FREE_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)

#: every callback pair ever handed to a torch extension: it may call them until the process ends
KEEP_ALIVE: list[tuple[Any, Any]] = []


def allocator_callbacks(alloc: AllocFn, free: FreeFn, *, backend: str) -> tuple[Any, Any]:
    """C callbacks with the custom-allocator signatures around ``alloc`` and ``free``.

    They never let an exception out (a failed ``alloc`` returns NULL, so torch
    raises its own out-of-memory error; the exception is logged to
    ``hal.<backend>``) and they stay alive for the lifetime of the process.
    """
    log = logging.getLogger(f"hal.{backend}")

    def c_alloc(size: int, device: int, stream: Any) -> int | None:
        try:
            return int(alloc(size)) or None
        except BaseException:  # noqa: BLE001 - nothing may cross into C
            log.exception("%s: allocator callback failed for %d bytes; returning NULL", backend, size)
            return None

    def c_free(ptr: int | None, size: int, device: int, stream: Any) -> None:
        try:
            free(ptr or 0, size)
        except BaseException:  # noqa: BLE001 - nothing may cross into C
            log.exception("%s: free callback failed for %d bytes at %#x", backend, size, ptr or 0)

    pair = (ALLOC_FN(c_alloc), FREE_FN(c_free))
    KEEP_ALIVE.append(pair)
    return pair


def address_of(callback: Any) -> int:
    """The C function pointer of a ctypes callback, as a ``_customAllocator`` wants it."""
    return ctypes.cast(callback, ctypes.c_void_p).value or 0
