"""ctypes bindings to libascendcl's VMM calls, and the one place their return codes are checked.

Prototypes, struct layouts and enum values follow ``acl_rt.h`` (ACL 1.15-1.17, and
the header shipped in the torch-npu 2.14.0 wheel).
They differ from CNDrv's and CUDA's (location is ``{id, type}``, pinned is 0,
read-write is 3): nothing here is shared with another vendor.
"""

from __future__ import annotations

import ctypes
from ctypes import POINTER, c_char, c_char_p, c_int, c_int32, c_size_t, c_uint8, c_uint32, c_uint64, c_void_p
from typing import Any

from hal.backends._native.library import LibraryCache, NativeLibrary, native_error
from hal.errors import HalError

NAME = "ascend"

# -- return codes (aclError = int) -------------------------------------------------------

ACL_SUCCESS = 0
ACL_ERROR_REPEAT_INITIALIZE = 100002
ACL_ERROR_RT_MEMORY_ALLOCATION = 207001
ACL_ERROR_RT_RESOURCE_ALLOC_FAIL = 207005
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
    207018: "ACL_ERROR_RT_DEVICE_OOM",
    200000: "ACL_ERROR_BAD_ALLOC",
    507000: "ACL_ERROR_RT_INTERNAL_ERROR",
    507899: "ACL_ERROR_RT_DRV_INTERNAL_ERROR",
}
INVALID_ARGUMENT_CODES = frozenset({100000, 107000})
OUT_OF_MEMORY_CODES = frozenset({ACL_ERROR_RT_MEMORY_ALLOCATION, 207018, 200000})

# -- enums ---------------------------------------------------------------------------------

ACL_MEM_LOCATION_TYPE_DEVICE = 1
ACL_MEM_HANDLE_TYPE_NONE = 0
ACL_MEM_ALLOCATION_TYPE_PINNED = 0
ACL_HBM_MEM_HUGE = 4
#: aclrtReserveMemAddress flags: the page type of the memory to be mapped (CANN 7.0-8.x); reserved on CANN 9
ACL_RESERVE_NORMAL_PAGES = 0
ACL_RESERVE_HUGE_PAGES = 1
ACL_PKG_NAME_CANN = 0  # aclCANNPackageName for aclsysGetCANNVersion
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


class AclCANNPackageVersion(ctypes.Structure):
    """``aclCANNPackageVersion``: strings, 512 bytes."""

    _fields_ = [("version", c_char * 128), ("majorVersion", c_char * 64), ("minorVersion", c_char * 64),
                ("releaseVersion", c_char * 64), ("patchVersion", c_char * 64), ("reserved", c_char * 128)]


def reserve_flags_for(cann: tuple[int, ...] | None) -> int:
    """``aclrtReserveMemAddress`` flags that suit HBM_MEM_HUGE memory on CANN version ``cann``.

    CANN 7.0-8.x documents the flags as the page type, which must match the
    physical memory's (torch_npu passes 1 with huge pages); CANN 9.0 documents
    them as reserved, 0. An unknown version (runtimes without
    ``aclsysGetCANNVersion`` predate CANN 9) gets the page type.
    """
    if cann and cann[0] >= 9:
        return ACL_RESERVE_NORMAL_PAGES
    return ACL_RESERVE_HUGE_PAGES


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
#: bound where the library exports them: aclrtMemSetAccess (ACL 1.17; access for *other* devices, never
#: called for the owning one); aclsysGetCANNVersion (chooses the reserve flags). aclGetRecentErrMsg adds detail.
OPTIONAL: dict[str, list[Any]] = {
    "aclrtMemSetAccess": [c_void_p, c_size_t, _P(AclrtMemAccessDesc), c_size_t],
    "aclsysGetCANNVersion": [c_int, _P(AclCANNPackageVersion)],
}


def error_for(code: int, call: str, native: str, detail: str = "") -> HalError:
    """The hal error for a failed ``native`` call made on behalf of hook ``call``."""
    return native_error(code, call, native, backend=NAME, code_name=CODE_NAMES.get(code),
                        out_of_memory=code in OUT_OF_MEMORY_CODES, invalid_argument=code in INVALID_ARGUMENT_CODES,
                        explanation=detail)


class AclLibrary(NativeLibrary):
    """One loaded libascendcl: typed functions and :meth:`call`, which checks every return code.

    Failures carry ``aclGetRecentErrMsg()`` where the runtime exports it.
    """

    backend = NAME
    prototypes = PROTOTYPES
    optional = OPTIONAL
    success = ACL_SUCCESS
    requirement = "a CANN runtime with the VMM API"

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self._recent = getattr(self.cdll, "aclGetRecentErrMsg", None)
        if self._recent is not None:
            self._recent.argtypes, self._recent.restype = [], c_char_p

    def error_for(self, code: int, call: str, native: str) -> HalError:
        return error_for(code, call, native, self._recent_message())

    def _recent_message(self) -> str:
        if self._recent is None:
            return ""
        raw = self._recent()
        return raw.decode(errors="replace").strip() if raw else ""

    def cann_version(self) -> str | None:
        """The CANN version the runtime reports (``aclsysGetCANNVersion``), None where it cannot say."""
        if not self.has("aclsysGetCANNVersion"):
            return None
        version = AclCANNPackageVersion()
        if self._fns["aclsysGetCANNVersion"](ACL_PKG_NAME_CANN, ctypes.byref(version)) != ACL_SUCCESS:
            self._recent_message()  # consumed: it belongs to this query, not to the next failure
            return None
        return version.version.decode(errors="replace").strip() or None

    def initialize(self) -> None:
        """``aclInit(NULL)``; an earlier initialisation (torch_npu's) is fine."""
        self.call("init", "aclInit", None, allow=(ACL_ERROR_REPEAT_INITIALIZE,))


#: the :class:`AclLibrary` at a path, loaded once per process
load = LibraryCache(AclLibrary).load
