"""ctypes bindings to libcndrv's VMM calls, and the one place their return codes are checked.

Prototypes, struct layouts and enum values follow ``cn_api.h`` (CNDrv 2.15.5).
``cnMemGetInfo`` and the VMM calls need a current context on the calling
thread; ``cnInit`` must not run in a process that forks afterwards.
They differ from ACL's and CUDA's (read-write access is 0, the granularity
output comes first, access must be set after every map): nothing here is
shared with another vendor.
"""

from __future__ import annotations

import ctypes
import threading
from ctypes import POINTER, c_int, c_int32, c_uint, c_uint8, c_uint32, c_uint64, c_void_p
from typing import Any

from hal.backends._native.library import LibraryCache, NativeLibrary, native_error
from hal.errors import HalError

NAME = "mlu"

# -- return codes (CNresult) -----------------------------------------------------------

CN_SUCCESS = 0
CN_MEMORY_ERROR_OUT_OF_MEMORY = 100100

CODE_NAMES = {
    1: "CN_ERROR_NOT_READY",
    100002: "CN_ERROR_NOT_INITIALIZED",
    100003: "CN_ERROR_DEINITIALIZED",
    100004: "CN_ERROR_NO_DEVICE",
    100005: "CN_ERROR_INVALID_DEVICE",
    100006: "CN_ERROR_INVALID_VALUE",
    100014: "CN_ERROR_INVALID_HANDLE",
    100015: "CN_ERROR_ILLEGAL_STATE",
    100050: "CN_OPS_ERROR_NOT_SUPPORTED",
    100051: "CN_OPS_ERROR_NOT_PERMITTED",
    100053: "CN_OPS_ERROR_OUT_OF_RESOURCES",
    100061: "CN_QUEUE_ERROR_OUT_OF_RESOURCES",
    100100: "CN_MEMORY_ERROR_OUT_OF_MEMORY",
    100101: "CN_MEMORY_ERROR_OUT_OF_PROCESS_MAX_MEMORY",
    100102: "CN_MEMORY_ERROR_INVALID_ADDRESS",
    100201: "CN_CONTEXT_ERROR_INVALID",
    100360: "CN_ERROR_QUEUE_CAPTURE_UNSUPPORTED",
    100361: "CN_ERROR_QUEUE_CAPTURE_INVALIDATED",
    100362: "CN_ERROR_QUEUE_CAPTURE_WRONG_THREAD",
    100363: "CN_ERROR_QUEUE_CAPTURE_MERGED",
    100364: "CN_ERROR_QUEUE_CAPTURE_UNJOINED",
    100365: "CN_ERROR_QUEUE_CAPTURE_ISOLATION",
    100366: "CN_ERROR_QUEUE_CAPTURE_UNMATCHED",
}
CN_MEMORY_ERROR_INVALID_ADDRESS = 100102
CN_CONTEXT_ERROR_INVALID = 100201
INVALID_ARGUMENT_CODES = frozenset({100006, CN_MEMORY_ERROR_INVALID_ADDRESS})
#: 100053 is CNDrv's "insufficient MLU memory"
OUT_OF_MEMORY_CODES = frozenset({CN_MEMORY_ERROR_OUT_OF_MEMORY, 100101, 100053})
CAPTURE_CODES = frozenset(range(100360, 100367))
#: CNRT's names for the same queue-capture codes (torch_mlu raises CNRT's errors)
CNRT_CAPTURE_NAMES = {
    100360: "cnrtErrorQueueCaptureUnsupported",
    100361: "cnrtErrorQueueCaptureInvalidated",
    100362: "cnrtErrorQueueCaptureWrongThread",
    100363: "cnrtErrorQueueCaptureMerged",
    100364: "cnrtErrorQueueCaptureUnjoined",
    100365: "cnrtErrorQueueCaptureIsolation",
    100366: "cnrtErrorQueueCaptureUnmatched",
}

# -- enums ---------------------------------------------------------------------------------

CN_MEM_LOCATION_TYPE_DEVICE = 1
CN_MEM_ALLOCATION_TYPE_DEFAULT = 1
CN_MEM_HANDLE_TYPE_NONE = 0
CN_MEM_ACCESS_FLAGS_PROT_READWRITE = 0
CN_MEM_ALLOC_GRANULARITY_MINIMUM = 0
CN_MEM_ALLOC_GRANULARITY_RECOMMENDED = 1

# -- structs -------------------------------------------------------------------------------


class CNmemLocation(ctypes.Structure):
    """``{int32_t type; uint32_t id;}`` -- type first (ACL puts id first)."""

    _fields_ = [("type", c_int32), ("id", c_uint32)]


class CNmemAllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", c_uint8), ("securityType", c_uint8)]


class CNmemAllocationProp(ctypes.Structure):
    """``CNmemAllocationProp``: 20 bytes, location at offset 8."""

    _fields_ = [
        ("type", c_int32),
        ("requestedHandleTypes", c_int32),
        ("location", CNmemLocation),
        ("allocFlags", CNmemAllocFlags),
    ]


class CNmemAccessDesc(ctypes.Structure):
    """``CNmemAccessDesc``: 20 bytes."""

    _fields_ = [("location", CNmemLocation), ("accessFlags", c_int32), ("cacheType", c_int32),
                ("pinnedType", c_int32)]


def allocation_prop(device: int) -> CNmemAllocationProp:
    """``{DEFAULT, NONE, {DEVICE, device}, {0, 0}}``, every other byte zero."""
    return CNmemAllocationProp(CN_MEM_ALLOCATION_TYPE_DEFAULT, CN_MEM_HANDLE_TYPE_NONE,
                               CNmemLocation(CN_MEM_LOCATION_TYPE_DEVICE, device))


def access_desc(device: int) -> CNmemAccessDesc:
    """Read-write access (flag 0) for ``device``."""
    return CNmemAccessDesc(CNmemLocation(CN_MEM_LOCATION_TYPE_DEVICE, device), CN_MEM_ACCESS_FLAGS_PROT_READWRITE)


# -- prototypes ------------------------------------------------------------------------------

_P = POINTER
PROTOTYPES: dict[str, list[Any]] = {
    "cnInit": [c_uint],
    "cnDeviceGetCount": [_P(c_int)],
    "cnDeviceGet": [_P(c_uint64), c_int],  # CNdev is a uint64
    "cnCtxGetCurrent": [_P(c_void_p)],  # CNcontext is a pointer
    "cnCtxCreate": [_P(c_void_p), c_uint, c_uint64],
    "cnCtxSetCurrent": [c_void_p],
    "cnMemGetInfo": [_P(c_uint64), _P(c_uint64)],
    "cnMemGetAllocationGranularity": [_P(c_uint64), _P(CNmemAllocationProp), c_int32],
    "cnMemAddressReserve": [_P(c_uint64), c_uint64, c_uint64, c_uint64, c_uint64],
    "cnMemAddressFree": [c_uint64, c_uint64],
    "cnMemCreate": [_P(c_uint64), c_uint64, _P(CNmemAllocationProp), c_uint64],
    "cnMemRelease": [c_uint64],
    "cnMemMap": [c_uint64, c_uint64, c_uint64, c_uint64, c_uint64],
    "cnMemSetAccess": [c_uint64, c_uint64, _P(CNmemAccessDesc), c_uint64],
    "cnMemUnmap": [c_uint64, c_uint64],
}


def error_for(code: int, call: str, native: str) -> HalError:
    """The hal error for a failed ``native`` call made on behalf of hook ``call``."""
    return native_error(code, call, native, backend=NAME, code_name=CODE_NAMES.get(code),
                        out_of_memory=code in OUT_OF_MEMORY_CODES, invalid_argument=code in INVALID_ARGUMENT_CODES)


class CndrvLibrary(NativeLibrary):
    """One loaded libcndrv: typed functions and :meth:`call`, which checks every return code."""

    backend = NAME
    prototypes = PROTOTYPES
    success = CN_SUCCESS
    requirement = "a CNDrv with the VMM API"

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self._contexts: dict[int, int] = {}
        self._contexts_lock = threading.Lock()

    def error_for(self, code: int, call: str, native: str) -> HalError:
        return error_for(code, call, native)

    def initialize(self) -> None:
        """``cnInit(0)``. A process that calls it must not ``fork()`` afterwards (``cn_api.h``)."""
        self.call("init", "cnInit", 0)

    def current_context(self, call: str) -> int:
        """The context bound to the calling thread (``cnCtxGetCurrent``), 0 when none is."""
        ctx = c_void_p()
        self.call(call, "cnCtxGetCurrent", ctypes.byref(ctx))
        return int(ctx.value or 0)

    def own_context(self, device: int, call: str) -> int:
        """The context this library made for ``device`` (``cnDeviceGet`` + ``cnCtxCreate``, once per process).

        It lives as long as the process, like a runtime's primary context:
        graphs and tensors may hold memory mapped under it until the end.
        """
        with self._contexts_lock:
            ctx = self._contexts.get(device)
            if ctx is None:
                dev, handle = c_uint64(0), c_void_p()
                self.call(call, "cnDeviceGet", ctypes.byref(dev), device)
                self.call(call, "cnCtxCreate", ctypes.byref(handle), 0, dev.value)
                ctx = self._contexts[device] = int(handle.value or 0)
            return ctx


#: the :class:`CndrvLibrary` at a path, loaded once per process
load = LibraryCache(CndrvLibrary).load
