"""The ascend backend's torch_npu glue: on a CPU against a stub torch_npu, on an NPU for real."""

from __future__ import annotations

import gc
import logging
import sys
import types

import pytest

import hal
from hal.backends._native.callbacks import ALLOC_FN, FREE_FN, KEEP_ALIVE
from hal.backends.ascend import locate, torch_glue
from tests.sim import compiler_reason, home, simulated_backend
from tests.sim.torch_stub import extension_stub

needs_gcc = pytest.mark.skipif(compiler_reason() is not None, reason=str(compiler_reason()))
G = 1 << 16


@pytest.fixture
def stub(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    module = extension_stub("torch_npu")
    monkeypatch.setitem(sys.modules, "torch_npu", module)
    return module


@pytest.fixture
def glue(stub: types.ModuleType) -> torch_glue.NpuGlue:
    return torch_glue.NpuGlue(0, ext=stub)


def test_capabilities_follow_the_installed_torch_npu() -> None:
    full, old = extension_stub("torch_npu"), extension_stub("torch_npu", mempool=False)
    capabilities = torch_glue.EXTENSION.capabilities
    assert capabilities(full, full.npu) == {"graphs", "custom_pool"}
    assert capabilities(old, old.npu) == {"graphs"}
    assert capabilities(types.SimpleNamespace(), types.SimpleNamespace()) == frozenset()


@needs_gcc
def test_the_backend_uses_torch_npu_when_it_is_installed(stub: types.ModuleType) -> None:
    with simulated_backend("ascend", capacity=8 * G, granularity=G, use_torch=None) as be:
        assert be.capabilities == {"graphs", "custom_pool"}
        assert ("set_device", 0) in stub.calls
        va, h = be.create_vir_ptr(G), be.create_phy_mem_handle(G)  # the VMM half is unchanged
        be.map(va, G, h)


@needs_gcc
def test_old_torch_npu_builds_report_no_custom_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch_npu", extension_stub("torch_npu", mempool=False))
    with simulated_backend("ascend", capacity=8 * G, granularity=G, use_torch=True) as be:
        assert be.capabilities == {"graphs"}
        with pytest.raises(hal.UnsupportedError, match="custom_pool"):
            be.create_pool(lambda n: 0, lambda p, n: None)
        assert be.create_pool() is not None  # pools from torch_npu's own allocator still work



@needs_gcc
def test_a_torch_extension_that_does_not_import_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(locate, "extension_installed", lambda: True)  # found, but broken:
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # importing it raises ImportError
    with pytest.raises(hal.BackendUnavailableError, match="torch_npu is installed but does not import"):
        simulated_backend("ascend", capacity=8 * G, granularity=G, use_torch=None)

@needs_gcc
def test_without_torch_npu_the_graph_hooks_say_why() -> None:
    with simulated_backend("ascend", capacity=8 * G, granularity=G) as be:
        with pytest.raises(hal.UnsupportedError, match="torch_npu"):
            be.create_graph()


def test_a_custom_pool_hands_torch_npu_working_c_callbacks(glue: torch_glue.NpuGlue) -> None:
    seen: list = []
    pool = glue.create_pool(lambda n: seen.append(n) or 0x10000, lambda p, n: seen.append((p, n)))
    kind, alloc_ptr, free_ptr = pool.mempool.allocator
    assert kind == "allocator" and pool.id == pool.mempool.id
    assert ALLOC_FN(alloc_ptr)(4096, 0, None) == 0x10000  # called as C calls it
    FREE_FN(free_ptr)(0x10000, 4096, 0, None)
    assert seen == [4096, (0x10000, 4096)]
    assert pool.callbacks in KEEP_ALIVE
    glue.release_pool(pool)
    assert pool.released and pool.callbacks in KEEP_ALIVE  # torch may still call them


def test_the_callbacks_never_let_an_exception_out(glue: torch_glue.NpuGlue,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    def boom(*args: object) -> int:
        raise RuntimeError("boom")

    _, alloc_ptr, free_ptr = glue.create_pool(boom, boom).mempool.allocator
    with caplog.at_level(logging.ERROR, logger="hal.ascend"):
        assert ALLOC_FN(alloc_ptr)(64, 0, None) is None  # NULL
        FREE_FN(free_ptr)(0x40, 64, 0, None)
    assert "allocator callback failed" in caplog.text and "free callback failed" in caplog.text
    _, alloc_ptr, _ = glue.create_pool(lambda n: "not an address", lambda p, n: None).mempool.allocator
    assert ALLOC_FN(alloc_ptr)(64, 0, None) is None


def test_a_pool_without_callbacks_is_a_graph_pool_handle(glue: torch_glue.NpuGlue) -> None:
    pool = glue.create_pool(None, None)
    assert pool.mempool is None and pool.id[0] == "handle"


def test_capture_passes_pool_stream_and_mode_with_gc_off(glue: torch_glue.NpuGlue,
                                                           stub: types.ModuleType) -> None:
    pool, graph = glue.create_pool(None, None), glue.create_graph()
    with glue.capture(graph, pool, "stream-1", "thread_local") as got:
        assert got is graph and not gc.isenabled()
    assert gc.isenabled()
    _, g, kwargs, gc_on = next(c for c in stub.calls if c[0] == "graph")
    assert g is graph and not gc_on
    assert kwargs == {"pool": pool.id, "stream": "stream-1", "capture_error_mode": "thread_local"}
    glue.replay(graph)
    glue.release_graph(graph)
    assert ("replay", graph) in stub.calls and ("reset", graph) in stub.calls


def test_exhausted_streams_become_a_capture_error_with_advice(glue: torch_glue.NpuGlue,
                                                              stub: types.ModuleType) -> None:
    stub.fail_capture = RuntimeError("NPU function error: capture_begin, error code is 207008")
    with pytest.raises(hal.CaptureError) as info:
        with glue.capture(glue.create_graph(), None, None, "global"):
            pass
    err = info.value
    assert err.backend == "ascend" and err.call == "capture" and err.__cause__ is stub.fail_capture
    assert "fewer sizes" in str(err) and "full graphs instead of piecewise" in str(err)
    assert gc.isenabled()


@pytest.mark.parametrize("message", ["error code is 207008", "EE9999: stream resources are insufficient",
                                     "ACL_ERROR_RT_NO_STREAM_RESOURCE"])
def test_stream_exhaustion_is_recognised(message: str) -> None:
    assert isinstance(torch_glue.stream_exhaustion(RuntimeError(message)), hal.CaptureError)


def test_other_capture_failures_pass_through_unchanged(glue: torch_glue.NpuGlue, stub: types.ModuleType) -> None:
    assert torch_glue.stream_exhaustion(RuntimeError("out of memory: 2070080 bytes")) is None
    stub.fail_capture = RuntimeError("operator not supported in capture")
    with pytest.raises(RuntimeError, match="operator not supported"):
        with glue.capture(glue.create_graph(), None, None, "global"):
            pass


def test_pool_active_blocks_reads_torch_npus_snapshot(glue: torch_glue.NpuGlue, stub: types.ModuleType) -> None:
    custom = glue.create_pool(lambda n: 0, lambda p, n: None)
    shared = glue.create_pool(None, None)
    blocks = [{"size": 512, "state": "active_allocated"}, {"size": 1024, "state": "inactive"},
              {"size": 256, "state": "active_allocated"}]
    stub.segments[:] = [{"address": 0x1000, "segment_pool_id": custom.id, "blocks": blocks},
                        {"address": 0x9000, "segment_pool_id": shared.id, "blocks": blocks[:1]}]
    assert glue.pool_active_blocks(custom) == [(0x1000, 512), (0x1600, 256)]
    assert glue.pool_active_blocks(shared) == [(0x9000, 512)]


def test_pool_active_blocks_without_a_snapshot_api_is_empty_and_says_so(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    old = extension_stub("torch_npu", snapshot=False)
    glue = torch_glue.NpuGlue(0, ext=old)
    with caplog.at_level(logging.INFO, logger="hal.ascend"):
        assert glue.pool_active_blocks(glue.create_pool(None, None)) == []
    assert "no memory snapshot API" in caplog.text


@needs_gcc
def test_the_default_location_with_torch_npu_is_available(stub: types.ModuleType,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(locate.ENV_LIBRARY, raising=False)
    monkeypatch.setenv(locate.ENV_HOME, str(home("ascend")))
    assert locate.probe_reason() is None


# -- on an NPU ------------------------------------------------------------------------------


@pytest.fixture
def npu():
    be = hal.get_backend("ascend")
    if "graphs" not in be.capabilities:
        be.close()
        pytest.skip("the ascend backend runs without torch_npu here (VMM only)")
    yield be
    be.close()


@pytest.mark.ascend
def test_capture_and_replay_on_an_npu(npu: hal.Backend) -> None:
    import torch

    x = torch.ones(8, device=npu.torch_device())
    stream, graph = npu.create_stream(), npu.create_graph()
    with npu.use_stream(stream):
        (x * 2 + 1).sum()  # warm up on the capture stream
    npu.synchronize(stream)
    with npu.capture(graph, None, stream):
        y = x * 2 + 1
    x.fill_(3)
    npu.replay(graph)
    npu.synchronize()
    assert y.cpu().tolist() == [7.0] * 8
    npu.release_graph(graph)


@pytest.mark.ascend
def test_capture_into_a_pool_of_vmm_chunks_on_an_npu(npu: hal.Backend) -> None:
    import torch

    if not npu.supports("custom_pool"):
        pytest.skip("this torch_npu has no MemPool")
    g, segments = npu.granularity, {}

    def alloc(n: int) -> int:
        size = -(-n // g) * g
        va, h = npu.create_vir_ptr(size), npu.create_phy_mem_handle(size)
        npu.map(va, size, h)
        segments[va] = (size, h)
        return va

    def free(ptr: int, n: int) -> None:
        size, h = segments.pop(ptr)
        npu.unmap(ptr, size)
        npu.release_phy_mem_handle(h)
        npu.release_vir_ptr(ptr, size)

    x = torch.ones(1024, device=npu.torch_device())
    stream, graph, pool = npu.create_stream(), npu.create_graph(), npu.create_pool(alloc, free)
    with npu.use_stream(stream):
        (x * 2 + 1).sum()
    npu.synchronize(stream)
    with npu.capture(graph, pool, stream):
        y = x * 2 + 1
    npu.replay(graph)
    npu.synchronize()
    assert y.sum().item() == 3 * 1024
    assert any(va <= y.data_ptr() < va + size for va, (size, _) in segments.items())
    blocks = npu.pool_active_blocks(pool)  # [] where torch_npu has no snapshot API
    if blocks:
        assert y.data_ptr() in [addr for addr, _ in blocks]
    del y
    npu.release_graph(graph)
    npu.release_pool(pool)
