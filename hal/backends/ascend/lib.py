"""ctypes bindings to libascendcl's VMM calls, and the one place their return codes are checked.

Prototypes, struct layouts and enum values follow ``acl_rt.h`` (CANN 1.15-1.17).
They differ from CNDrv's and CUDA's (location is ``{id, type}``, pinned is 0,
read-write is 3): nothing here is shared with another vendor.
"""

from __future__ import annotations

import ctypes
import threading
from ctypes import POINTER, c_char_p, c_int, c_int32, c_size_t, c_uint8, c_uint32, c_uint64, c_void_p
from typing import Any

from hal.errors import BackendUnavailableError, DeviceOutOfMemoryError, DriverError, HalError, InvalidArgumentError

NAME = "ascend"

# -- return codes (aclError = int) -------------------------------------------------------

ACL_SUCCESS = 0
ACL_ERROR_REPEAT_INITIALIZE = 100002
ACL_ERROR_RT_MEMORY_ALLOCATION = 207001
ACL_ERROR_RT_NO_STREAM_RESOURCE = 207008

CODE_NAMES = {
    100000: "ACL_ERROR_INVALID_PARAM",
    100001: "ACL_ERROR_UNINITIALIZE",
    100002: "ACL_ERROR_REPEAT_INITIALIZE",
    107000: "ACL_ERROR_RT_PARAM_INVALID",
    107001: "ACL_ERROR_RT_INVALID_DEVICEID",
    107002: "ACL_ERROR_RT_CONTEXT_NULL",
    207000: "ACL_ERROR_RT_FEATURE_NOT_SUPPORT",
    207001: "ACL_ERROR_RT_MEMORY_ALLOCATION",
    207002: "ACL_ERROR_RT_MEMORY_FREE",
    207004: "ACL_ERROR_RT_NO_DEVICE",
    207005: "ACL_ERROR_RT_RESOURCE_ALLOC_FAIL",
    207008: "ACL_ERROR_RT_NO_STREAM_RESOURCE",
    507000: "ACL_ERROR_RT_INTERNAL_ERROR",
    507899: "ACL_ERROR_RT_DRV_INTERNAL_ERROR",
}
INVALID_ARGUMENT_CODES = frozenset({100000, 107000})
OUT_OF_MEMORY_CODES = frozenset({ACL_ERROR_RT_MEMORY_ALLOCATION})

# -- enums ---------------------------------------------------------------------------------

ACL_MEM_LOCATION_TYPE_DEVICE = 1
ACL_MEM_HANDLE_TYPE_NONE = 0
ACL_MEM_ALLOCATION_TYPE_PINNED = 0
ACL_HBM_MEM_HUGE = 4
ACL_RT_MEM_ALLOC_GRANULARITY_MINIMUM = 0
ACL_RT_MEM_ALLOC_GRANULARITY_RECOMMENDED = 1
ACL_HBM_MEM = 1  # aclrtMemAttr for aclrtGetMemInfo
ACL_RT_MEM_ACCESS_FLAGS_READWRITE = 3

# -- structs -------------------------------------------------------------------------------


class AclrtMemLocation(ctypes.Structure):
    """``{uint32_t id; int32_t type;}`` -- id first (CNDrv and CUDA put type first)."""

    _fields_ = [("id", c_uint32), ("type", c_int32)]


class AclrtPhysicalMemProp(ctypes.Structure):
    """``aclrtPhysicalMemProp``: 32 bytes, location at offset 12, reserve at 24."""

    _fields_ = [
        ("handleType", c_int32),
        ("allocationType", c_int32),
        ("memAttr", c_int32),
        ("location", AclrtMemLocation),
        ("reserve", c_uint64),
    ]


class AclrtMemAccessDesc(ctypes.Structure):
    """``aclrtMemAccessDesc``: 24 bytes."""

    _fields_ = [("flags", c_int32), ("location", AclrtMemLocation), ("rsv", c_uint8 * 12)]


def physical_prop(device: int) -> AclrtPhysicalMemProp:
    """The prop of vLLM-Ascend's allocator: ``{NONE, PINNED, HBM_MEM_HUGE, {device, DEVICE}, 0}``."""
    return AclrtPhysicalMemProp(
        ACL_MEM_HANDLE_TYPE_NONE, ACL_MEM_ALLOCATION_TYPE_PINNED, ACL_HBM_MEM_HUGE,
        AclrtMemLocation(device, ACL_MEM_LOCATION_TYPE_DEVICE), 0,
    )


def access_desc(device: int) -> AclrtMemAccessDesc:
    """Read-write access for ``device``."""
    return AclrtMemAccessDesc(ACL_RT_MEM_ACCESS_FLAGS_READWRITE,
                              AclrtMemLocation(device, ACL_MEM_LOCATION_TYPE_DEVICE))


# -- prototypes ------------------------------------------------------------------------------

_P = POINTER
PROTOTYPES: dict[str, list[Any]] = {
    "aclInit": [c_char_p],
    "aclrtSetDevice": [c_int32],
    "aclrtGetDevice": [_P(c_int32)],
    "aclrtGetDeviceCount": [_P(c_uint32)],
    "aclrtGetMemInfo": [c_int, _P(c_size_t), _P(c_size_t)],
    "aclrtMemGetAllocationGranularity": [_P(AclrtPhysicalMemProp), c_int, _P(c_size_t)],
    "aclrtReserveMemAddress": [_P(c_void_p), c_size_t, c_size_t, c_void_p, c_uint64],
    "aclrtReleaseMemAddress": [c_void_p],
    "aclrtMallocPhysical": [_P(c_void_p), c_size_t, _P(AclrtPhysicalMemProp), c_uint64],
    "aclrtFreePhysical": [c_void_p],
    "aclrtMapMem": [c_void_p, c_size_t, c_size_t, c_void_p, c_uint64],
    "aclrtUnmapMem": [c_void_p],
}
#: looked up with hasattr: aclrtMemSetAccess appears in ACL 1.17; aclGetRecentErrMsg adds detail
OPTIONAL: dict[str, list[Any]] = {
    "aclrtMemSetAccess": [c_void_p, c_size_t, _P(AclrtMemAccessDesc), c_size_t],
}


class AclInvalidArgumentError(DriverError, InvalidArgumentError):
    """The runtime refused an argument: an :class:`hal.InvalidArgumentError` that keeps the native code."""


def error_for(code: int, call: str, native: str, detail: str = "") -> HalError:
    """The hal error for a failed ``native`` call made on behalf of hook ``call``."""
    name = CODE_NAMES.get(code)
    message = f"{native} failed" + (f": {detail}" if detail else "")
    if code in OUT_OF_MEMORY_CODES:
        err: HalError = DeviceOutOfMemoryError(f"{message} [{name} = {code}]", backend=NAME, call=call)
        err.code, err.code_name = code, name  # type: ignore[attr-defined]
        return err
    cls = AclInvalidArgumentError if code in INVALID_ARGUMENT_CODES else DriverError
    return cls(message, backend=NAME, call=call, code=code, code_name=name)


class AclLibrary:
    """One loaded libascendcl: typed functions and :meth:`call`, which checks every return code."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.cdll = ctypes.CDLL(path)
        self._fns: dict[str, Any] = {}
        missing = [n for n in PROTOTYPES if not hasattr(self.cdll, n)]
        if missing:
            raise BackendUnavailableError(
                f"{path} lacks {', '.join(missing)} (a CANN runtime with the VMM API is needed)", backend=NAME)
        for name, argtypes in {**PROTOTYPES, **OPTIONAL}.items():
            if hasattr(self.cdll, name):
                fn = getattr(self.cdll, name)
                fn.argtypes, fn.restype = argtypes, c_int
                self._fns[name] = fn
        self._recent = getattr(self.cdll, "aclGetRecentErrMsg", None)
        if self._recent is not None:
            self._recent.argtypes, self._recent.restype = [], c_char_p
        self._init_lock = threading.Lock()
        self._initialized = False

    def has(self, name: str) -> bool:
        """Whether the library exports the (optional) function ``name``."""
        return name in self._fns

    def call(self, call: str, native: str, *args: Any, allow: tuple[int, ...] = ()) -> int:
        """Call ``native(*args)`` for hook ``call``; raise the hal error unless it succeeded.

        :param allow: further codes that count as success (returned to the caller).
        """
        code = self._fns[native](*args)
        if code == ACL_SUCCESS or code in allow:
            return code
        raise error_for(code, call, native, self._recent_message())

    def _recent_message(self) -> str:
        if self._recent is None:
            return ""
        raw = self._recent()
        return raw.decode(errors="replace").strip() if raw else ""

    def init_once(self) -> None:
        """``aclInit(NULL)`` once per library; an earlier initialisation (torch_npu's) is fine."""
        with self._init_lock:
            if not self._initialized:
                self.call("init", "aclInit", None, allow=(ACL_ERROR_REPEAT_INITIALIZE,))
                self._initialized = True


_libraries: dict[str, AclLibrary] = {}
_lock = threading.Lock()


def load(path: str) -> AclLibrary:
    """The :class:`AclLibrary` at ``path``, loaded once per process.

    :raises OSError: the library cannot be loaded.
    :raises BackendUnavailableError: it lacks the VMM functions.
    """
    with _lock:
        lib = _libraries.get(path)
        if lib is None:
            lib = _libraries[path] = AclLibrary(path)
        return lib
