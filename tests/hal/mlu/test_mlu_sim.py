"""The mlu backend over the CNDrv simulator: VMM through the facade, bindings, the driver's rules."""

from __future__ import annotations

import contextlib
import ctypes
import shutil
import subprocess
import threading

import pytest

import hal
from hal.backends.mlu import MluBackend, lib
from tests.conftest import G
from tests.sim import built, compiler_reason, private_copy, simulated_backend, simulator

pytestmark = pytest.mark.skipif(compiler_reason() is not None, reason=str(compiler_reason()))

INVALID = 100006  # CN_ERROR_INVALID_VALUE


@pytest.fixture
def be():
    backend = simulated_backend("mlu", capacity=64 * G, granularity=G)
    sim = simulator(backend)
    yield backend
    backend.close()
    assert [sim.count(k) for k in ("ranges", "chunks", "mappings", "used")] == [0, 0, 0, 0]


def protection(address: int) -> str:
    """The ``rwxp`` column of /proc/self/maps for ``address`` (reading PROT_NONE would crash)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            span, perms = line.split()[:2]
            lo, hi = (int(x, 16) for x in span.split("-"))
            if lo <= address < hi:
                return perms
    raise AssertionError(f"{address:#x} is not mapped at all")


class _LocationInAclOrder(ctypes.Structure):
    """ACL's order, {id, type}: the binding mistake the simulator must catch."""

    _fields_ = [("id", ctypes.c_uint32), ("type", ctypes.c_int32)]


class _PropWithAclLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int32), ("requestedHandleTypes", ctypes.c_int32),
                ("location", _LocationInAclOrder), ("allocFlags", ctypes.c_uint8 * 2)]


def test_struct_layouts_follow_cn_api_h() -> None:
    assert ctypes.sizeof(lib.CNmemAllocationProp) == 20
    assert ctypes.sizeof(lib.CNmemAccessDesc) == 20
    assert (lib.CNmemLocation.type.offset, lib.CNmemLocation.id.offset) == (0, 4)
    assert lib.CNmemAllocationProp.location.offset == 8
    assert lib.CNmemAllocationProp.allocFlags.offset == 16
    prop = lib.allocation_prop(2)
    assert (prop.type, prop.requestedHandleTypes, prop.location.type, prop.location.id) == (1, 0, 1, 2)
    desc = lib.access_desc(2)
    assert (desc.location.type, desc.location.id, desc.accessFlags, desc.cacheType, desc.pinnedType) == (1, 2, 0, 0, 0)


@pytest.mark.skipif(shutil.which("nm") is None, reason="nm (binutils) is not installed")
def test_the_simulator_exports_the_cndrv_symbols_the_backend_binds_and_nothing_else() -> None:
    out = subprocess.run(["nm", "-D", "--defined-only", str(built("mlu"))], capture_output=True, text=True,
                         check=True).stdout
    exported = {line.split()[-1] for line in out.splitlines() if line.strip()}
    assert exported == {*lib.PROTOTYPES, "cndrv_sim_configure", "cndrv_sim_count", "cndrv_sim_last_error"}
    assert {"cnCtxGetCurrent", "cnCtxCreate", "cnCtxSetCurrent", "cnDeviceGet"} <= exported


def test_queries_come_from_the_driver(be: hal.Backend) -> None:
    assert be.granularity == be.recommended_granularity == G
    assert be.mem_info() == hal.MemInfo(free=64 * G, total=64 * G)
    assert be.device_count() == 1
    assert be.capabilities == frozenset()  # no torch_mlu: VMM only


def test_two_mappings_of_one_handle_alias(be: hal.Backend) -> None:
    a, b = be.create_vir_ptr(4 * G), be.create_vir_ptr(4 * G)
    h = be.create_phy_mem_handle(2 * G)
    be.map(a + 2 * G, 2 * G, h)
    be.map(b, 2 * G, h)
    ctypes.memmove(b + G + 9, b"through b", 9)
    assert ctypes.string_at(a + 3 * G + 9, 9) == b"through b"
    assert be.mem_info().free == 62 * G


def test_unmap_then_remap_keeps_the_chunk_bytes(be: hal.Backend) -> None:
    va, h = be.create_vir_ptr(2 * G), be.create_phy_mem_handle(G)
    be.map(va, G, h)
    ctypes.memmove(va, b"persist", 7)
    be.unmap(va, G)
    assert protection(va).startswith("---")
    be.map(va + G, G, h)
    assert ctypes.string_at(va + G, 7) == b"persist"


def test_out_of_memory_is_a_device_out_of_memory_error_with_the_cndrv_code(be: hal.Backend) -> None:
    with pytest.raises(hal.DeviceOutOfMemoryError) as info:
        be.create_phy_mem_handle(be.mem_info().total + G)
    err = info.value
    assert (err.backend, err.call, err.code) == ("mlu", "create_phy_mem_handle", 100100)
    assert "cnMemCreate" in str(err) and "CN_MEMORY_ERROR_OUT_OF_MEMORY" in str(err)
    assert be.live.chunks == 0


def test_memory_is_inaccessible_until_set_access(be: hal.Backend) -> None:
    cndrv = be.plugin.library
    va, h = be.create_vir_ptr(G), be.create_phy_mem_handle(G)
    cndrv.call("map", "cnMemMap", va, G, 0, h, 0)  # the driver alone, without the backend's SetAccess
    assert protection(va).startswith("---")
    cndrv.call("map", "cnMemSetAccess", va, G, ctypes.byref(lib.access_desc(0)), 1)
    assert protection(va).startswith("rw")
    cndrv.call("unmap", "cnMemUnmap", va, G)
    be.map(va, G, h)  # the backend does both
    assert protection(va).startswith("rw") and simulator(be).count("set_access") == 2


def test_cninit_runs_once_per_library(be: hal.Backend) -> None:
    again = MluBackend(library=be.plugin.library.path, use_torch=False)
    assert again.library is be.plugin.library
    assert simulator(be).count("init") == 1


def test_memory_calls_need_cninit_then_a_current_context() -> None:
    fresh = lib.CndrvLibrary(str(private_copy("mlu")))
    free, total = ctypes.c_uint64(), ctypes.c_uint64()
    with pytest.raises(hal.DriverError) as info:
        fresh.call("mem_info", "cnMemGetInfo", ctypes.byref(free), ctypes.byref(total))
    assert (info.value.code, info.value.code_name) == (100002, "CN_ERROR_NOT_INITIALIZED")
    assert not isinstance(info.value, hal.InvalidArgumentError)
    fresh.init_once()
    with pytest.raises(hal.DriverError) as info:
        fresh.call("mem_info", "cnMemGetInfo", ctypes.byref(free), ctypes.byref(total))
    assert (info.value.code, info.value.code_name) == (100201, "CN_CONTEXT_ERROR_INVALID")
    assert fresh.current_context("t") == 0
    fresh.call("t", "cnCtxSetCurrent", fresh.own_context(0, "t"))
    fresh.call("mem_info", "cnMemGetInfo", ctypes.byref(free), ctypes.byref(total))
    assert fresh.own_context(0, "t") == fresh.current_context("t") != 0  # made once per device


def test_vmm_only_mode_binds_a_context_of_its_own_on_every_thread(be: hal.Backend) -> None:
    sim, seen = simulator(be), {}
    assert be.plugin.made_context and sim.count("contexts") == 1
    assert be.plugin.library.current_context("t") == be.plugin.library.own_context(0, "t")

    def work() -> None:  # a thread with no context: its calls would fail with CN_CONTEXT_ERROR_INVALID
        handle = be.create_phy_mem_handle(G)
        be.release_phy_mem_handle(handle)
        seen["context"] = be.plugin.library.current_context("t")

    worker = threading.Thread(target=work)
    worker.start()
    worker.join()
    assert seen["context"] == be.plugin.library.own_context(0, "t") and sim.count("contexts") == 1


def test_a_context_already_current_is_kept(be: hal.Backend) -> None:
    cndrv, seen = be.plugin.library, {}

    def work() -> None:
        dev, mine = ctypes.c_uint64(), ctypes.c_void_p()
        cndrv.call("t", "cnDeviceGet", ctypes.byref(dev), 0)
        cndrv.call("t", "cnCtxCreate", ctypes.byref(mine), 0, dev.value)  # binds it, as torch_mlu would
        be.mem_info()
        seen["kept"] = cndrv.current_context("t") == mine.value

    worker = threading.Thread(target=work)
    worker.start()
    worker.join()
    assert seen == {"kept": True} and simulator(be).count("contexts") == 2


def test_releasing_a_mapped_handle_succeeds_and_frees_with_the_last_unmap(be: hal.Backend) -> None:
    cndrv, sim = be.plugin.library, simulator(be)
    va, h = be.create_vir_ptr(4 * G), ctypes.c_uint64()
    cndrv.call("t", "cnMemCreate", ctypes.byref(h), 2 * G, ctypes.byref(be.plugin._prop), 0)
    h = h.value
    cndrv.call("map", "cnMemMap", va, 2 * G, 0, h, 0)
    cndrv.call("map", "cnMemSetAccess", va, 2 * G, ctypes.byref(lib.access_desc(0)), 1)
    cndrv.call("release_phy_mem_handle", "cnMemRelease", h)
    assert sim.count("chunks") == 0 and sim.count("used") == 2 * G  # released, still backing the mapping
    ctypes.memmove(va, b"still here", 10)
    assert ctypes.string_at(va, 10) == b"still here"
    with pytest.raises(hal.InvalidArgumentError):
        cndrv.call("map", "cnMemMap", va + 2 * G, 2 * G, 0, h, 0)  # the handle itself is gone
    cndrv.call("unmap", "cnMemUnmap", va, 2 * G)
    assert sim.count("used") == 0
    be.release_vir_ptr(va, 4 * G)


@pytest.mark.parametrize("field, value, ok", [
    ("cacheType", 1, True), ("cacheType", 3, True), ("pinnedType", 1, True),
    ("cacheType", 4, False), ("pinnedType", 2, False)])
def test_set_access_takes_every_documented_cache_and_pinned_type(be: hal.Backend, raw, field: str, value: int,
                                                                 ok: bool) -> None:
    cndrv, va, h = raw
    cndrv.call("map", "cnMemMap", va, 2 * G, 0, h, 0)
    desc = lib.access_desc(0)
    setattr(desc, field, value)
    if ok:
        cndrv.call("map", "cnMemSetAccess", va, 2 * G, ctypes.byref(desc), 1)
        assert protection(va).startswith("rw")
    else:
        with pytest.raises(hal.InvalidArgumentError):
            cndrv.call("map", "cnMemSetAccess", va, 2 * G, ctypes.byref(desc), 1)
        assert field in simulator(be).last_error()


def test_set_access_takes_one_descriptor_for_the_creating_device() -> None:
    with simulated_backend("mlu", capacity=8 * G, granularity=G, devices=2) as be:
        cndrv = be.plugin.library
        va, h = be.create_vir_ptr(G), be.create_phy_mem_handle(G)  # created on device 0
        cndrv.call("map", "cnMemMap", va, G, 0, h, 0)
        two = (lib.CNmemAccessDesc * 2)(lib.access_desc(0), lib.access_desc(0))
        with pytest.raises(hal.InvalidArgumentError):
            cndrv.call("map", "cnMemSetAccess", va, G, two, 2)
        assert "count=2" in simulator(be).last_error()
        with pytest.raises(hal.InvalidArgumentError):
            cndrv.call("map", "cnMemSetAccess", va, G, ctypes.byref(lib.access_desc(1)), 1)
        assert "created on device 0" in simulator(be).last_error()
        cndrv.call("unmap", "cnMemUnmap", va, G)
        be.map(va, G, h)  # the backend's own descriptor names the creating device
        be.unmap(va, G)


def test_an_address_that_is_not_reserved_is_an_invalid_address(be: hal.Backend) -> None:
    with pytest.raises(hal.InvalidArgumentError) as info:
        be.plugin.library.call("release_vir_ptr", "cnMemAddressFree", 0x1000, G)
    assert (info.value.code, info.value.code_name) == (100102, "CN_MEMORY_ERROR_INVALID_ADDRESS")


def test_out_of_resources_is_out_of_memory() -> None:
    err = lib.error_for(100053, "create_phy_mem_handle", "cnMemCreate")
    assert isinstance(err, hal.DeviceOutOfMemoryError) and "CN_OPS_ERROR_OUT_OF_RESOURCES" in str(err)


# -- a wrong binding is caught by the simulator and mapped onto hal's errors -------------------


def test_a_location_in_acl_order_is_rejected_as_invalid_argument(be: hal.Backend) -> None:
    swapped = _PropWithAclLocation(1, 0, _LocationInAclOrder(id=0, type=1))
    be.plugin._prop = ctypes.cast(ctypes.pointer(swapped), ctypes.POINTER(lib.CNmemAllocationProp)).contents
    with pytest.raises(hal.InvalidArgumentError) as info:
        be.create_phy_mem_handle(G)
    err = info.value
    assert isinstance(err, hal.DriverError)
    assert (err.backend, err.call, err.code, err.code_name) == (
        "mlu", "create_phy_mem_handle", INVALID, "CN_ERROR_INVALID_VALUE")
    assert "location.type=0" in simulator(be).last_error()
    assert be.live.chunks == 0


@pytest.mark.parametrize("field, value", [("type", 0), ("requestedHandleTypes", 1)])
def test_wrong_prop_fields_are_rejected(be: hal.Backend, field: str, value: int) -> None:
    setattr(be.plugin._prop, field, value)
    with pytest.raises(hal.InvalidArgumentError):
        be.create_phy_mem_handle(G)
    assert field in simulator(be).last_error()


def test_an_acl_style_access_flag_is_rejected_and_the_map_rolled_back(be: hal.Backend) -> None:
    be.plugin._access.accessFlags = 3  # ACL's and CUDA's read-write value; CNDrv's is 0
    va, h = be.create_vir_ptr(G), be.create_phy_mem_handle(G)
    with pytest.raises(hal.InvalidArgumentError, match="cnMemSetAccess"):
        be.map(va, G, h)
    assert "accessFlags=3" in simulator(be).last_error()
    assert simulator(be).count("mappings") == 0 and be.live.mappings == 0
    be.plugin._access.accessFlags = lib.CN_MEM_ACCESS_FLAGS_PROT_READWRITE
    be.map(va, G, h)


def test_a_read_only_flag_maps_read_only(be: hal.Backend) -> None:
    be.plugin._access.accessFlags = 1  # PROT_READONLY
    va, h = be.create_vir_ptr(G), be.create_phy_mem_handle(G)
    be.map(va, G, h)
    assert protection(va).startswith("r-")


# -- the simulator enforces the documented rules ---------------------------------------------


@pytest.fixture
def raw(be: hal.Backend):
    """(library, va of 4 granules, handle of 2 granules) straight on the driver, no facade checks."""
    cndrv = be.plugin.library
    va, h = ctypes.c_uint64(), ctypes.c_uint64()
    cndrv.call("t", "cnMemAddressReserve", ctypes.byref(va), 4 * G, 0, 0, 0)
    cndrv.call("t", "cnMemCreate", ctypes.byref(h), 2 * G, ctypes.byref(be.plugin._prop), 0)
    yield cndrv, va.value, h.value
    with contextlib.suppress(hal.HalError):
        cndrv.call("t", "cnMemUnmap", va.value, 2 * G)
    cndrv.call("t", "cnMemRelease", h.value)
    cndrv.call("t", "cnMemAddressFree", va.value, 4 * G)


@pytest.mark.parametrize("args, why", [
    (lambda va, h: (va, 2 * G, G, h, 0), "offset"),
    (lambda va, h: (va, G, 0, h, 0), "physical size"),
    (lambda va, h: (va + 3 * G, 2 * G, 0, h, 0), "reservation"),
    (lambda va, h: (va, 2 * G, 0, h, 1), "flags"),
])
def test_maps_must_be_whole_handles_at_offset_zero(be: hal.Backend, raw, args, why: str) -> None:
    cndrv, va, h = raw
    with pytest.raises(hal.InvalidArgumentError) as info:
        cndrv.call("map", "cnMemMap", *args(va, h))
    invalid_address = 100102  # CN_MEMORY_ERROR_INVALID_ADDRESS: nothing is reserved there
    assert info.value.code == (invalid_address if why == "reservation" else INVALID)
    assert why in simulator(be).last_error()


def test_unmaps_take_whole_mappings_only(be: hal.Backend, raw) -> None:
    cndrv, va, h = raw
    cndrv.call("map", "cnMemMap", va, 2 * G, 0, h, 0)
    for ptr, size in ((va, G), (va + G, G), (va, 4 * G)):
        with pytest.raises(hal.InvalidArgumentError):
            cndrv.call("unmap", "cnMemUnmap", ptr, size)
        assert "whole mappings" in simulator(be).last_error()
    with pytest.raises(hal.InvalidArgumentError):
        cndrv.call("release_vir_ptr", "cnMemAddressFree", va, 4 * G)
    cndrv.call("unmap", "cnMemUnmap", va, 2 * G)
