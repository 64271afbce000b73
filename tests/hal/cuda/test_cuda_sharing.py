"""The cuda backend's exportable chunks, on a CPU: against a stand-in for ``cuda.bindings.driver``.

Chunks are created with a POSIX file descriptor handle type where the device
supports one (and ``shareable`` is left on); export and import go through the
driver's calls for it; anything else is a clear ``UnsupportedError``. What the
GPU does with them is in ``tests/graphkit/graphs/test_collectives_cuda.py``.
"""

from __future__ import annotations

import enum
import sys
import types
from typing import Any

import pytest

import hal
from hal.backends.cuda import CudaBackend

G = 2 << 20


class HandleType(enum.IntEnum):
    CU_MEM_HANDLE_TYPE_NONE = 0
    CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1


class Attribute(enum.IntEnum):
    CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED = 103


class Location:
    def __init__(self) -> None:
        self.type, self.id = 0, 0


class Prop:
    """``CUmemAllocationProp``: its handle types are 0 (none) until set."""

    def __init__(self) -> None:
        self.type, self.location, self.requestedHandleTypes = 0, Location(), 0


class AccessDesc:
    def __init__(self) -> None:
        self.location, self.flags = Location(), 0


class StandInDriver(types.ModuleType):
    """The driver calls of the cuda backend's vmm half, over counters; it records what chunks were asked for."""

    CUmemAllocationProp, CUmemAccessDesc = Prop, AccessDesc
    CUmemAllocationHandleType, CUdevice_attribute = HandleType, Attribute
    CUmemAllocationType = types.SimpleNamespace(CU_MEM_ALLOCATION_TYPE_PINNED=1)
    CUmemLocationType = types.SimpleNamespace(CU_MEM_LOCATION_TYPE_DEVICE=1)
    CUmemAccess_flags = types.SimpleNamespace(CU_MEM_ACCESS_FLAGS_PROT_READWRITE=3)
    CUmemAllocationGranularity_flags = types.SimpleNamespace(CU_MEM_ALLOC_GRANULARITY_MINIMUM=0,
                                                            CU_MEM_ALLOC_GRANULARITY_RECOMMENDED=1)

    def __init__(self, posix_fd_supported: int = 1) -> None:
        super().__init__("cuda.bindings.driver")
        self.posix_fd_supported = posix_fd_supported
        self.attributes_read: list[Any] = []
        self.created: list[int] = []  # requestedHandleTypes of each cuMemCreate
        self.exported: list[tuple[int, Any]] = []
        self.imported: list[tuple[int, Any]] = []
        self.next_handle = 100

    def cuInit(self, flags: int) -> tuple:
        return (0,)

    def cuDeviceGetCount(self) -> tuple:
        return 0, 2

    def cuDeviceGet(self, index: int) -> tuple:
        return 0, index

    def cuDevicePrimaryCtxRetain(self, device: int) -> tuple:
        return 0, 7

    def cuDevicePrimaryCtxRelease(self, device: int) -> tuple:
        return (0,)

    def cuCtxGetCurrent(self) -> tuple:
        return 0, 7

    def cuCtxSetCurrent(self, ctx: int) -> tuple:
        return (0,)

    def cuDeviceGetAttribute(self, attribute: Any, device: int) -> tuple:
        self.attributes_read.append(attribute)
        return 0, self.posix_fd_supported

    def cuMemGetAllocationGranularity(self, prop: Prop, option: int) -> tuple:
        return 0, G

    def cuMemCreate(self, size: int, prop: Prop, flags: int) -> tuple:
        self.created.append(int(prop.requestedHandleTypes))
        self.next_handle += 1
        return 0, self.next_handle

    def cuMemRelease(self, handle: Any) -> tuple:
        return (0,)

    def cuMemExportToShareableHandle(self, handle: Any, kind: Any, flags: int) -> tuple:
        self.exported.append((handle, kind))
        return 0, 40 + len(self.exported)

    def cuMemImportFromShareableHandle(self, fd: int, kind: Any) -> tuple:
        self.imported.append((fd, kind))
        self.next_handle += 1
        return 0, self.next_handle


@pytest.fixture
def driver(monkeypatch: pytest.MonkeyPatch) -> StandInDriver:
    """A stand-in installed as ``cuda.bindings.driver`` for the test."""
    stand_in = StandInDriver()
    bindings = types.ModuleType("cuda.bindings")
    bindings.driver = stand_in  # type: ignore[attr-defined]
    cuda = types.ModuleType("cuda")
    cuda.bindings = bindings  # type: ignore[attr-defined]
    for name, module in (("cuda", cuda), ("cuda.bindings", bindings), ("cuda.bindings.driver", stand_in)):
        monkeypatch.setitem(sys.modules, name, module)
    return stand_in


def facade(**options: Any) -> hal.Backend:
    return hal.Backend("cuda", CudaBackend(0, **options))


def test_chunks_are_created_exportable_where_asked_and_the_device_supports_it(driver: StandInDriver) -> None:
    be = facade(shareable=True)
    handle = be.create_phy_mem_handle(G)
    assert driver.created == [HandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR]
    assert driver.attributes_read == [Attribute.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED]
    fd = be.export_phy_mem_handle(handle)
    assert fd == 41 and driver.exported[0][1] == HandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    imported = be.import_phy_mem_handle(fd, G)
    assert driver.imported == [(41, HandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)]
    assert be.live.chunks == 2  # an imported chunk is held, counted and released like a created one
    be.release_phy_mem_handle(imported)
    be.release_phy_mem_handle(handle)
    assert be.live.zero
    be.close()


@pytest.mark.parametrize("why, options, supported", [
    ("the backend was made without shareable=True (hal.get_backend('cuda', shareable=True))", {}, 1),
    ("the backend was made without shareable=True (hal.get_backend('cuda', shareable=True))", {"shareable": False}, 1),
    (("device 0 does not support POSIX file descriptor handles "
      "(CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED is 0)"), {"shareable": True}, 0),
])
def test_chunks_that_cannot_be_shared_are_created_as_before_and_refuse_export(
        driver: StandInDriver, why: str, options: dict, supported: int) -> None:
    driver.posix_fd_supported = supported
    be = facade(**options)
    handle = be.create_phy_mem_handle(G)
    assert driver.created == [HandleType.CU_MEM_HANDLE_TYPE_NONE]
    assert driver.attributes_read == ([Attribute.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED]
                                      if options.get("shareable") else [])
    with pytest.raises(hal.UnsupportedError) as info:
        be.export_phy_mem_handle(handle)
    assert info.value.backend == "cuda" and info.value.call == "export_phy_mem_handle"
    assert str(info.value) == f"cuda.export_phy_mem_handle: chunks of this backend cannot be exported: {why}"
    assert driver.exported == []
    be.close()


def test_memory_sharing_is_a_capability_only_where_chunks_are_exportable(driver: StandInDriver,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    glue = types.SimpleNamespace(capabilities=frozenset({"graphs"}), inspector=None)
    monkeypatch.setattr(CudaBackend, "_current_glue", lambda self: glue)
    assert facade(shareable=True).capabilities == {"graphs", "memory_sharing"}
    assert facade().capabilities == {"graphs"}


def test_the_option_takes_a_bool(driver: StandInDriver) -> None:
    with pytest.raises(hal.InvalidArgumentError, match=r"cuda.get_backend: shareable='no' must be True or False"):
        CudaBackend(0, shareable="no")  # type: ignore[arg-type]
