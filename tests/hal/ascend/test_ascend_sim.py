"""The ascend backend over the ACL simulator: VMM through the facade, bindings, the runtime's rules."""

from __future__ import annotations

import contextlib
import ctypes
import shutil
import subprocess
import threading

import pytest

import hal
from hal.backends.ascend import lib
from tests.conftest import G
from tests.sim import built, compiler_reason, simulated_backend, simulator

pytestmark = pytest.mark.skipif(compiler_reason() is not None, reason=str(compiler_reason()))

INVALID = 107000  # ACL_ERROR_RT_PARAM_INVALID


@pytest.fixture
def be():
    backend = simulated_backend("ascend", capacity=64 * G, granularity=G)
    sim = simulator(backend)
    yield backend
    backend.close()
    assert [sim.count(k) for k in ("ranges", "chunks", "mappings", "used")] == [0, 0, 0, 0]


class _SwappedLocation(ctypes.Structure):
    """CNDrv's order, {type, id}: the binding mistake the simulator must catch."""

    _fields_ = [("type", ctypes.c_int32), ("id", ctypes.c_uint32)]


class _PropWithSwappedLocation(ctypes.Structure):
    _fields_ = [("handleType", ctypes.c_int32), ("allocationType", ctypes.c_int32), ("memAttr", ctypes.c_int32),
                ("location", _SwappedLocation), ("reserve", ctypes.c_uint64)]


def test_struct_layouts_follow_acl_rt_h() -> None:
    assert ctypes.sizeof(lib.AclrtPhysicalMemProp) == 32
    assert ctypes.sizeof(lib.AclrtMemAccessDesc) == 24
    assert (lib.AclrtMemLocation.id.offset, lib.AclrtMemLocation.type.offset) == (0, 4)
    assert lib.AclrtPhysicalMemProp.location.offset == 12
    assert lib.AclrtPhysicalMemProp.reserve.offset == 24
    prop = lib.physical_prop(3)
    assert (prop.handleType, prop.allocationType, prop.memAttr) == (0, 0, 4)
    assert (prop.location.id, prop.location.type, prop.reserve) == (3, 1, 0)
    desc = lib.access_desc(3)
    assert (desc.flags, desc.location.id, desc.location.type, bytes(desc.rsv)) == (3, 3, 1, bytes(12))


def exports(path: object) -> set[str]:
    """The dynamic symbols a shared library defines."""
    out = subprocess.run(["nm", "-D", "--defined-only", str(path)], capture_output=True, text=True, check=True)
    return {line.split()[-1] for line in out.stdout.splitlines() if line.strip()}


@pytest.mark.skipif(shutil.which("nm") is None, reason="nm (binutils) is not installed")
def test_the_simulator_exports_the_acl_symbols_the_backend_binds_and_nothing_else() -> None:
    controls = {"acl_sim_configure", "acl_sim_count", "acl_sim_set_cann_version"}
    assert exports(built("ascend")) == {*lib.PROTOTYPES, *lib.OPTIONAL, "aclGetRecentErrMsg", *controls}
    assert exports(built("ascend", set_access=False)) == exports(built("ascend")) - {"aclrtMemSetAccess"}


def test_queries_come_from_the_runtime(be: hal.Backend) -> None:
    assert be.granularity == be.recommended_granularity == G
    assert be.mem_info() == hal.MemInfo(free=64 * G, total=64 * G)
    assert be.device_count() == 1
    assert be.capabilities == frozenset()  # no torch_npu: VMM only


def test_two_mappings_of_one_handle_alias(be: hal.Backend) -> None:
    a, b = be.create_vir_ptr(4 * G), be.create_vir_ptr(4 * G)
    h = be.create_phy_mem_handle(2 * G)
    be.map(a, 2 * G, h)
    be.map(b + 2 * G, 2 * G, h)
    ctypes.memmove(a + G + 5, b"through a", 9)
    assert ctypes.string_at(b + 3 * G + 5, 9) == b"through a"
    assert be.mem_info().free == 62 * G
    for ptr in (a, b + 2 * G):
        be.unmap(ptr, 2 * G)
    be.release_phy_mem_handle(h)
    be.release_vir_ptr(a, 4 * G)
    be.release_vir_ptr(b, 4 * G)


def test_unmap_is_one_call_per_mapping_and_leaves_neighbours_mapped(be: hal.Backend) -> None:
    va = be.create_vir_ptr(2 * G)
    h1, h2 = be.create_phy_mem_handle(G), be.create_phy_mem_handle(G)
    be.map(va, G, h1)
    be.map(va + G, G, h2)
    ctypes.memmove(va + G, b"kept", 4)
    be.unmap(va, G)
    assert simulator(be).count("mappings") == 1
    assert ctypes.string_at(va + G, 4) == b"kept"
    be.map(va, G, h2)  # the chunk's bytes survive and show up at the new place
    assert ctypes.string_at(va, 4) == b"kept"


def test_out_of_memory_is_a_device_out_of_memory_error_with_the_acl_code(be: hal.Backend) -> None:
    with pytest.raises(hal.DeviceOutOfMemoryError) as info:
        be.create_phy_mem_handle(be.mem_info().total + G)
    err = info.value
    assert (err.backend, err.call, err.code) == ("ascend", "create_phy_mem_handle", 207001)
    assert "aclrtMallocPhysical" in str(err) and "ACL_ERROR_RT_MEMORY_ALLOCATION" in str(err)
    assert be.live.chunks == 0
    be.release_phy_mem_handle(be.create_phy_mem_handle(G))  # still usable


def test_a_map_is_usable_at_once_and_never_sets_access_for_the_owning_device(be: hal.Backend) -> None:
    assert be.plugin.library.has("aclrtMemSetAccess")  # exported, and meant for other devices
    va, h = be.create_vir_ptr(G), be.create_phy_mem_handle(G)
    be.map(va, G, h)
    ctypes.memmove(va, b"mapped", 6)
    assert ctypes.string_at(va, 6) == b"mapped"
    assert simulator(be).count("set_access") == 0


@pytest.mark.parametrize("cann, flags", [("7.0.0", 1), ("8.0.RC2", 1), ("8.3.RC1", 1), ("9.0.0", 0), ("", 1)])
def test_huge_page_reserve_flags_follow_the_cann_version(cann: str, flags: int) -> None:
    with simulated_backend("ascend", capacity=8 * G, granularity=G, cann_version=cann) as be:
        assert be.plugin.cann_version == (cann or None) and be.plugin.reserve_flags == flags
        va = be.create_vir_ptr(G)
        assert simulator(be).count("reserve_flags") == flags
        be.release_vir_ptr(va, G)


def test_the_simulator_takes_reserve_flags_as_its_cann_version_documents() -> None:
    for cann, takes, refuses in (("8.3.RC1", (0, 1), (2,)), ("9.0.0", (0,), (1,))):
        with simulated_backend("ascend", capacity=8 * G, granularity=G, cann_version=cann) as be:
            acl = be.plugin.library
            for flags in takes:
                va = ctypes.c_void_p()
                acl.call("t", "aclrtReserveMemAddress", ctypes.byref(va), G, 0, None, flags)
                acl.call("t", "aclrtReleaseMemAddress", va.value)
            for flags in refuses:
                with pytest.raises(hal.InvalidArgumentError, match=f"flags={flags}; CANN {cann}"):
                    acl.call("t", "aclrtReserveMemAddress", ctypes.byref(ctypes.c_void_p()), G, 0, None, flags)


@pytest.mark.parametrize("how", ["option", "variable"])
def test_the_reserve_flags_can_be_overridden(monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    options = {"reserve_flags": 0} if how == "option" else {}
    if how == "variable":
        monkeypatch.setenv("HAL_ASCEND_RESERVE_FLAGS", "0")
    with simulated_backend("ascend", capacity=8 * G, granularity=G, cann_version="8.3.RC1", **options) as be:
        assert be.plugin.reserve_flags == 0
        assert be.plugin.reserve_flags_from == ("the reserve_flags option" if how == "option"
                                                else "$HAL_ASCEND_RESERVE_FLAGS")
        be.release_vir_ptr(be.create_vir_ptr(G), G)
        assert simulator(be).count("reserve_flags") == 0


def test_a_bad_reserve_flags_override_is_refused_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HAL_ASCEND_RESERVE_FLAGS", "huge")
    with pytest.raises(hal.InvalidArgumentError, match=r"reserve_flags: \$HAL_ASCEND_RESERVE_FLAGS is 'huge'"):
        simulated_backend("ascend", capacity=8 * G, granularity=G)


@pytest.mark.parametrize("code, name", [(207001, "ACL_ERROR_RT_MEMORY_ALLOCATION"), (207018, "ACL_ERROR_RT_DEVICE_OOM"),
                                        (200000, "ACL_ERROR_BAD_ALLOC")])
def test_every_out_of_memory_code_is_a_device_out_of_memory_error(code: int, name: str) -> None:
    err = lib.error_for(code, "create_phy_mem_handle", "aclrtMallocPhysical")
    assert isinstance(err, hal.DeviceOutOfMemoryError) and name in str(err)


def test_runtimes_without_aclrtMemSetAccess_still_map() -> None:
    with simulated_backend("ascend", capacity=8 * G, granularity=G, set_access=False) as be:
        assert not be.plugin.library.has("aclrtMemSetAccess")
        a, b, h = be.create_vir_ptr(G), be.create_vir_ptr(G), be.create_phy_mem_handle(G)
        be.map(a, G, h)
        be.map(b, G, h)
        ctypes.memmove(a, b"no set access", 13)
        assert ctypes.string_at(b, 13) == b"no set access"


def test_the_runtime_is_initialised_and_the_device_set(be: hal.Backend) -> None:
    sim = simulator(be)
    assert sim.count("init") == 1
    device = ctypes.c_int32(-1)
    be.plugin.library.call("test", "aclrtGetDevice", ctypes.byref(device))
    assert device.value == 0


def test_every_thread_sets_the_device_before_its_first_call(be: hal.Backend) -> None:
    seen: dict = {}

    def work() -> None:
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        try:  # the runtime alone, on a thread that never called aclrtSetDevice
            be.plugin.library.call("t", "aclrtGetMemInfo", lib.ACL_HBM_MEM, ctypes.byref(free), ctypes.byref(total))
        except hal.DriverError as exc:
            seen["raw"] = (exc.code, isinstance(exc, hal.InvalidArgumentError))
        handle = be.create_phy_mem_handle(G)  # the backend sets the device on this thread first
        be.release_phy_mem_handle(handle)
        seen["backend"] = "ok"

    worker = threading.Thread(target=work)
    worker.start()
    worker.join()
    assert seen == {"raw": (107002, False), "backend": "ok"}


# -- a wrong binding is caught by the simulator and mapped onto hal's errors -------------------


def test_a_location_in_cndrv_order_is_rejected_as_invalid_argument(be: hal.Backend) -> None:
    swapped = _PropWithSwappedLocation(0, 0, lib.ACL_HBM_MEM_HUGE, _SwappedLocation(type=1, id=0), 0)
    be.plugin._prop = ctypes.cast(ctypes.pointer(swapped), ctypes.POINTER(lib.AclrtPhysicalMemProp)).contents
    with pytest.raises(hal.InvalidArgumentError) as info:
        be.create_phy_mem_handle(G)
    err = info.value
    assert isinstance(err, hal.DriverError)
    assert (err.backend, err.call, err.code, err.code_name) == (
        "ascend", "create_phy_mem_handle", INVALID, "ACL_ERROR_RT_PARAM_INVALID")
    assert "location.type=0" in str(err)  # the simulator's reason, read back through aclGetRecentErrMsg
    assert be.live.chunks == 0


@pytest.mark.parametrize("field, value", [("allocationType", 1), ("handleType", 1), ("memAttr", 1)])
def test_wrong_prop_fields_are_rejected(be: hal.Backend, field: str, value: int) -> None:
    setattr(be.plugin._prop, field, value)
    with pytest.raises(hal.InvalidArgumentError, match=field):
        be.create_phy_mem_handle(G)


def test_set_access_covers_exactly_one_mapping_with_acl_flags() -> None:
    with simulated_backend("ascend", capacity=8 * G, granularity=G, devices=2) as be:
        acl, va = be.plugin.library, be.create_vir_ptr(2 * G)
        h1, h2 = be.create_phy_mem_handle(G), be.create_phy_mem_handle(G)
        be.map(va, G, h1)
        be.map(va + G, G, h2)
        peer = lib.access_desc(1)  # access for the other device
        with pytest.raises(hal.InvalidArgumentError, match="not exactly one mapping"):
            acl.call("t", "aclrtMemSetAccess", va, 2 * G, ctypes.byref(peer), 1)  # two mappings at once
        peer.flags = 0  # CNDrv's read-write value; ACL's is 3
        with pytest.raises(hal.InvalidArgumentError, match="READWRITE"):
            acl.call("t", "aclrtMemSetAccess", va, G, ctypes.byref(peer), 1)
        peer.flags = lib.ACL_RT_MEM_ACCESS_FLAGS_READWRITE
        acl.call("t", "aclrtMemSetAccess", va + G, G, ctypes.byref(peer), 1)
        assert simulator(be).count("set_access") == 1


@pytest.mark.parametrize("cann, attr, ok", [("8.3.RC1", 5, True), ("8.3.RC1", 13, False), ("9.0.0", 13, True),
                                            ("9.0.0", 5, False), ("9.0.0", lib.ACL_HBM_MEM_HUGE, True)])
def test_memory_types_follow_the_cann_version(cann: str, attr: int, ok: bool) -> None:
    with simulated_backend("ascend", capacity=8 * G, granularity=G, cann_version=cann) as be:
        be.plugin._prop.memAttr = attr
        if ok:
            be.release_phy_mem_handle(be.create_phy_mem_handle(G))
        else:
            with pytest.raises(hal.InvalidArgumentError, match=f"memAttr={attr}"):
                be.create_phy_mem_handle(G)


def test_reserve_alignment_must_be_zero_and_prop_reserve_is_free(be: hal.Backend) -> None:
    with pytest.raises(hal.InvalidArgumentError, match="alignment"):
        be.plugin.library.call("t", "aclrtReserveMemAddress", ctypes.byref(ctypes.c_void_p()), G, G, None, 1)
    be.plugin._prop.reserve = 7  # "reserved", not required to be 0
    be.release_phy_mem_handle(be.create_phy_mem_handle(G))


# -- the simulator enforces the documented rules ---------------------------------------------


@pytest.fixture
def raw(be: hal.Backend):
    """(library, va of 4 granules, handle of 2 granules) straight on the runtime, no facade checks."""
    acl = be.plugin.library
    va, h = ctypes.c_void_p(), ctypes.c_void_p()
    acl.call("t", "aclrtReserveMemAddress", ctypes.byref(va), 4 * G, 0, None, be.plugin.reserve_flags)
    acl.call("t", "aclrtMallocPhysical", ctypes.byref(h), 2 * G, ctypes.byref(be.plugin._prop), 0)
    yield acl, va.value, h.value
    for ptr in (va.value, va.value + 2 * G):
        with contextlib.suppress(hal.HalError):
            acl.call("t", "aclrtUnmapMem", ptr)
    acl.call("t", "aclrtFreePhysical", h.value)
    acl.call("t", "aclrtReleaseMemAddress", va.value)


@pytest.mark.parametrize("args, why", [
    (lambda va, h: (va, 2 * G, G, h, 0), "offset"),
    (lambda va, h: (va, G, 0, h, 0), "physical size"),
    (lambda va, h: (va + 3 * G, 2 * G, 0, h, 0), "reservation"),
    (lambda va, h: (va + 1, 2 * G, 0, h, 0), "aligned"),
    (lambda va, h: (va, 2 * G, 0, h, 1), "flags"),
])
def test_maps_must_be_whole_handles_at_offset_zero(raw, args, why: str) -> None:
    acl, va, h = raw
    with pytest.raises(hal.InvalidArgumentError, match=why) as info:
        acl.call("map", "aclrtMapMem", *args(va, h))
    assert info.value.code == INVALID


def test_unmap_takes_the_start_of_a_mapping_only(raw) -> None:
    acl, va, h = raw
    acl.call("map", "aclrtMapMem", va, 2 * G, 0, h, 0)
    with pytest.raises(hal.InvalidArgumentError, match="does not start a mapping"):
        acl.call("unmap", "aclrtUnmapMem", va + G)  # a partial unmap
    with pytest.raises(hal.InvalidArgumentError, match="still mapped"):
        acl.call("release_phy_mem_handle", "aclrtFreePhysical", h)
    with pytest.raises(hal.InvalidArgumentError, match="still has mappings"):
        acl.call("release_vir_ptr", "aclrtReleaseMemAddress", va)
    acl.call("unmap", "aclrtUnmapMem", va)
