"""The cuda backend's vmm half through the facade, on a real GPU.

Data written through one mapping is read back through another mapping of
the same chunk, once with the driver's copies and once with torch kernels.
"""

from __future__ import annotations

import os

import pytest

import hal

pytestmark = pytest.mark.cuda


class _DeviceBytes:
    """Exposes ``nbytes`` at a device address to torch (``__cuda_array_interface__``)."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3, "strides": None,
        }


def tensor_at(ptr: int, nbytes: int, device: int):
    import torch

    t = torch.as_tensor(_DeviceBytes(ptr, nbytes), device=torch.device("cuda", device))
    assert t.data_ptr() == ptr, "torch copied instead of viewing the mapping"
    return t


@pytest.fixture
def be():
    backend = hal.get_backend("cuda", device=int(os.environ.get("HAL_TEST_CUDA_DEVICE", "0")))
    yield backend
    backend.close()
    assert backend.live.zero


def test_queries(be: hal.Backend) -> None:
    g = be.granularity
    assert g > 0 and g % 4096 == 0
    assert be.recommended_granularity % g == 0
    info = be.mem_info()
    assert 0 < info.free <= info.total
    assert be.device_count() >= 1
    assert be.capabilities >= {"graphs"}
    assert str(be.torch_device()) == f"cuda:{be.device}"


def test_alias_through_driver_copies(be: hal.Backend) -> None:
    g = be.granularity
    a, b = be.create_vir_ptr(2 * g), be.create_vir_ptr(g)
    h = be.create_phy_mem_handle(g)
    be.map(a + g, g, h)
    be.map(b, g, h)
    pattern = bytes(range(256)) * (g // 256)
    dev = be.plugin.dev
    dev.copy_to_device(a + g, pattern)
    assert dev.copy_from_device(b, g) == pattern
    dev.copy_to_device(b + 100, b"hal!")
    assert dev.copy_from_device(a + g + 100, 4) == b"hal!"
    be.unmap(a + g, g)
    be.unmap(b, g)
    be.release_phy_mem_handle(h)
    be.release_vir_ptr(a, 2 * g)
    be.release_vir_ptr(b, g)


def test_alias_through_torch(be: hal.Backend) -> None:
    import torch

    g = be.granularity
    a, b = be.create_vir_ptr(g), be.create_vir_ptr(g)
    h = be.create_phy_mem_handle(g)
    be.map(a, g, h)
    be.map(b, g, h)
    ta, tb = tensor_at(a, g, be.device), tensor_at(b, g, be.device)
    ta.view(torch.int32).copy_(torch.arange(g // 4, dtype=torch.int32, device=ta.device))
    torch.cuda.synchronize(be.device)
    assert torch.equal(tb.view(torch.int32).cpu(), torch.arange(g // 4, dtype=torch.int32))
    tb.fill_(7)
    torch.cuda.synchronize(be.device)
    assert int(ta.sum()) == 7 * g
    del ta, tb
    be.unmap(a, g)
    be.unmap(b, g)
    be.release_phy_mem_handle(h)
    be.release_vir_ptr(a, g)
    be.release_vir_ptr(b, g)


def test_unmap_then_map_another_chunk(be: hal.Backend) -> None:
    g = be.granularity
    dev = be.plugin.dev
    va, other = be.create_vir_ptr(g), be.create_vir_ptr(g)
    h1, h2 = be.create_phy_mem_handle(g), be.create_phy_mem_handle(g)
    be.map(va, g, h1)
    dev.copy_to_device(va, b"one" * 10)
    be.map(other, g, h2)
    dev.copy_to_device(other, b"two" * 10)
    be.unmap(va, g)
    be.map(va, g, h2)
    assert dev.copy_from_device(va, 30) == b"two" * 10
    be.unmap(va, g)
    be.map(va, g, h1)
    assert dev.copy_from_device(va, 30) == b"one" * 10
    for ptr in (va, other):
        be.unmap(ptr, g)
        be.release_vir_ptr(ptr, g)
    be.release_phy_mem_handle(h1)
    be.release_phy_mem_handle(h2)


def test_contiguous_maps_with_deferred_access(be: hal.Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    g, n = be.granularity, 4
    va = be.create_vir_ptr(n * g)
    handles = [be.create_phy_mem_handle(g) for _ in range(n)]
    calls: list[tuple[int, int]] = []
    real = be.plugin.dev.set_access
    monkeypatch.setattr(be.plugin.dev, "set_access", lambda ptr, size, hook="map": (calls.append((ptr, size)),
                                                                                   real(ptr, size, hook)))
    with be.plugin.deferred_access():
        for i, h in enumerate(handles):
            be.map(va + i * g, g, h)
        assert calls == []
    assert calls == [(va, n * g)], "one cuMemSetAccess for the contiguous run"
    t = tensor_at(va, n * g, be.device)
    t.fill_(3)
    torch.cuda.synchronize(be.device)
    assert int(t.sum()) == 3 * n * g
    del t
    for i in range(n):
        be.unmap(va + i * g, g)
    for h in handles:
        be.release_phy_mem_handle(h)
    be.release_vir_ptr(va, n * g)


def test_out_of_memory_maps_to_hal_error(be: hal.Backend) -> None:
    g = be.granularity
    too_big = -(-be.mem_info().total * 2 // g) * g
    with pytest.raises(hal.DeviceOutOfMemoryError) as info:
        be.create_phy_mem_handle(too_big)
    err = info.value
    assert isinstance(err, hal.DriverError)
    assert (err.backend, err.call, err.code, err.code_name) == ("cuda", "create_phy_mem_handle", 2,
                                                                "CUDA_ERROR_OUT_OF_MEMORY")
    assert "cuMemCreate" in str(err) and "CUDA_ERROR_OUT_OF_MEMORY" in str(err)
    assert be.live.chunks == 0


def test_invalid_value_and_other_codes(be: hal.Backend) -> None:
    from hal.backends.cuda.errors import error_for

    with pytest.raises(hal.InvalidArgumentError) as info:
        be.plugin.dev.create(4096 + 1)  # not a multiple of the granularity: the driver refuses it
    assert (info.value.code, info.value.code_name) == (1, "CUDA_ERROR_INVALID_VALUE")
    assert info.value.native_call == "cuMemCreate"
    err = error_for(999, "cuMemMap", "map", "ptr=0x0")
    assert type(err).__name__ == "CudaDriverError" and isinstance(err, hal.DriverError)
    assert not isinstance(err, (hal.InvalidArgumentError, hal.DeviceOutOfMemoryError))
    assert (err.backend, err.call, err.code, err.code_name) == ("cuda", "map", 999, "CUDA_ERROR_UNKNOWN")
    assert str(err).startswith("cuda.map: cuMemMap (ptr=0x0) failed")


def test_facade_checks_before_the_driver(be: hal.Backend) -> None:
    g = be.granularity
    with pytest.raises(hal.InvalidArgumentError):
        be.create_vir_ptr(g + 1)
    va = be.create_vir_ptr(2 * g)
    h = be.create_phy_mem_handle(2 * g)
    with pytest.raises(hal.InvalidArgumentError):
        be.map(va, g, h)  # partial map: whole handles only
    be.map(va, 2 * g, h)
    with pytest.raises(hal.InvalidStateError):
        be.release_phy_mem_handle(h)
    be.unmap(va, 2 * g)
    be.release_phy_mem_handle(h)
    be.release_vir_ptr(va, 2 * g)
    with pytest.raises(hal.InvalidStateError):
        be.release_vir_ptr(va, 2 * g)


def test_device_out_of_range() -> None:
    from hal.backends.cuda import driver

    with pytest.raises(hal.InvalidArgumentError, match="out of range"):
        hal.get_backend("cuda", device=driver.device_count())


def test_uses_the_primary_context_torch_uses(be: hal.Backend) -> None:
    import torch
    from cuda.bindings import driver

    torch.zeros(1, device=be.torch_device())
    with torch.cuda.device(be.device):
        torch.cuda.synchronize()
        err, current = driver.cuCtxGetCurrent()
    assert int(err) == 0 and int(current) == int(be.plugin.dev.context)


def test_close_gives_memory_back() -> None:
    be = hal.get_backend("cuda")
    g = be.granularity
    before = be.mem_info().used
    va = be.create_vir_ptr(64 * g)
    handles = [be.create_phy_mem_handle(g) for _ in range(64)]
    for i, h in enumerate(handles):
        be.map(va + i * g, g, h)
    assert be.mem_info().used - before >= 60 * g
    be.close()  # releases what is still live
    assert be.live.zero
    after = hal.get_backend("cuda")
    try:
        assert after.mem_info().used - before <= g
    finally:
        after.close()
