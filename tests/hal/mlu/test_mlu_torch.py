"""The mlu backend's torch_mlu glue: on a CPU against stand-ins of each torch_mlu generation, on an MLU for real."""

from __future__ import annotations

import ctypes
import gc
import logging
import sys
import types

import pytest

import hal
from hal.backends._native.callbacks import ALLOC_FN, FREE_FN, KEEP_ALIVE
from hal.backends.mlu import MluBackend, locate, torch_glue
from tests.conftest import G
from tests.sim import compiler_reason, home, private_copy, simulated_backend
from tests.sim.torch_stub import extension_stub, generation

needs_gcc = pytest.mark.skipif(compiler_reason() is not None, reason=str(compiler_reason()))
ROUTED = {"custom_pool", "use_pool", "capture_routing"}


@pytest.fixture(autouse=True)
def no_alloc_conf(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTORCH_MLU_ALLOC_CONF", raising=False)


@pytest.fixture
def stub(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """torch_mlu of the public branches: MLUGraph and _mlu_customAllocator, no MemPool."""
    module = generation("torch_mlu 1.24")
    monkeypatch.setitem(sys.modules, "torch_mlu", module)
    return module


@pytest.fixture
def glue(stub: types.ModuleType) -> torch_glue.MluGlue:
    return torch_glue.MluGlue(0, ext=stub)


def test_the_static_capabilities_have_no_custom_pool_without_mempool() -> None:
    today, future = extension_stub("torch_mlu", mempool=False), extension_stub("torch_mlu", mempool=True)
    capabilities = torch_glue.EXTENSION.capabilities
    assert capabilities(today, today.mlu) == {"graphs"}
    assert capabilities(future, future.mlu) == {"graphs", "custom_pool"}  # torch.mlu.memory.MemPool
    assert capabilities(types.SimpleNamespace(), types.SimpleNamespace()) == frozenset()


@pytest.mark.parametrize("label, expected", [("torch_mlu 1.24", {"graphs", "capture_routing"}),
                                             ("torch_mlu 1.27", {"graphs"} | ROUTED)])
def test_each_generation_gets_the_capabilities_it_supports(label: str, expected: set) -> None:
    glue = torch_glue.MluGlue(0, ext=generation(label, capture_api=True))
    assert glue.capabilities == expected


def test_expandable_segments_turn_the_routed_capabilities_off(monkeypatch: pytest.MonkeyPatch,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("PYTORCH_MLU_ALLOC_CONF", "expandable_segments:True")
    with caplog.at_level(logging.WARNING, logger="hal.mlu"):
        glue = torch_glue.MluGlue(0, ext=generation("torch_mlu 1.27", capture_api=True))
    assert glue.capabilities == {"graphs"} and glue.routing is None
    assert "expandable segments are on (PYTORCH_MLU_ALLOC_CONF=expandable_segments:True)" in caplog.text
    assert "no pools over allocator callbacks" in caplog.text


@needs_gcc
def test_a_build_with_mempool_routes_captures_and_use_pool_to_the_callbacks(monkeypatch: pytest.MonkeyPatch) -> None:
    stub = generation("torch_mlu 1.27", capture_api=True)
    monkeypatch.setitem(sys.modules, "torch_mlu", stub)
    with simulated_backend("mlu", capacity=8 * G, granularity=G, use_torch=True) as be:
        assert be.capabilities == {"graphs"} | ROUTED
        seen: list[int] = []
        pool = be.create_pool(lambda n: seen.append(n) or 0x30000, lambda p, n: None)
        with be.use_pool(pool):
            stub.allocate(256)
        with be.capture(be.create_graph(), pool, None):
            stub.allocate(768)
        assert seen == [256, 768]
        extension, reasons = be.plugin.capability_report()
        assert extension == "torch_mlu 1.27.0+torch2.7.0" and "not confirmed" in reasons["custom_pool"]


@needs_gcc
def test_the_backend_reports_graphs_but_no_custom_pool(stub: types.ModuleType) -> None:
    with simulated_backend("mlu", capacity=8 * G, granularity=G, use_torch=None) as be:
        assert be.capabilities == {"graphs"}
        assert ("set_device", 0) in stub.calls
        with pytest.raises(hal.UnsupportedError, match="custom_pool"):
            be.create_pool(lambda n: 0, lambda p, n: None)
        with pytest.raises(hal.UnsupportedError, match="use_pool"):
            be.use_pool(be.create_pool())
        pool = be.create_pool()  # the shared-pool fallback graphkit uses
        assert pool.id[0] == "handle" and pool.mempool is None
        va, h = be.create_vir_ptr(G), be.create_phy_mem_handle(G)  # the VMM half is unchanged
        be.map(va, G, h)
        assert be.plugin.made_context  # the stand-in binds no CNDrv context: the backend made one
        assert "no MemPool" in be.plugin.capability_report()[1]["custom_pool"]


@needs_gcc
def test_a_torch_extension_that_does_not_import_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(locate, "extension_installed", lambda: True)  # found, but broken:
    monkeypatch.setitem(sys.modules, "torch_mlu", None)  # importing it raises ImportError
    with pytest.raises(hal.BackendUnavailableError, match="torch_mlu is installed but does not import"):
        simulated_backend("mlu", capacity=8 * G, granularity=G, use_torch=None)


@needs_gcc
def test_without_torch_mlu_the_graph_hooks_say_why() -> None:
    with simulated_backend("mlu", capacity=8 * G, granularity=G) as be:
        with pytest.raises(hal.UnsupportedError, match="torch_mlu"):
            be.create_stream()


def test_the_glue_itself_refuses_callback_pools_without_mempool(glue: torch_glue.MluGlue) -> None:
    with pytest.raises(hal.UnsupportedError, match="this torch_mlu has no MemPool"):
        glue.create_pool(lambda n: 0, lambda p, n: None)


def test_a_build_with_mempool_gets_working_c_callbacks(monkeypatch: pytest.MonkeyPatch) -> None:
    glue = torch_glue.MluGlue(0, ext=generation("torch_mlu 1.27"))
    seen: list = []
    pool = glue.create_pool(lambda n: seen.append(n) or 0x20000, lambda p, n: seen.append((p, n)))
    _, alloc_ptr, free_ptr = pool.mempool.allocator
    assert ALLOC_FN(alloc_ptr)(512, 0, None) == 0x20000
    FREE_FN(free_ptr)(0x20000, 512, 0, None)
    assert seen == [512, (0x20000, 512)] and pool.callbacks in KEEP_ALIVE


def test_the_callbacks_never_let_an_exception_out(caplog: pytest.LogCaptureFixture) -> None:
    def boom(*args: object) -> int:
        raise MemoryError("boom")

    glue = torch_glue.MluGlue(0, ext=generation("torch_mlu 1.27"))
    _, alloc_ptr, free_ptr = glue.create_pool(boom, boom).mempool.allocator
    with caplog.at_level(logging.ERROR, logger="hal.mlu"):
        assert ALLOC_FN(alloc_ptr)(64, 0, None) is None
        FREE_FN(free_ptr)(0x40, 64, 0, None)
    assert "allocator callback failed" in caplog.text and "free callback failed" in caplog.text


@pytest.mark.parametrize("asked, passed", [(None, "relaxed"), ("", "relaxed"), ("global", "global"),
                                           ("thread_local", "thread_local")])
def test_capture_mode_defaults_to_relaxed_and_keeps_what_is_asked(
        glue: torch_glue.MluGlue, stub: types.ModuleType, asked: str | None, passed: str) -> None:
    graph = glue.create_graph()
    with glue.capture(graph, None, "queue", asked):
        assert not gc.isenabled()
    assert gc.isenabled()
    _, g, kwargs, gc_on = next(c for c in stub.calls if c[0] == "graph")
    assert g is graph and not gc_on
    assert kwargs == {"pool": None, "stream": "queue", "capture_error_mode": passed}


@needs_gcc
def test_the_facade_passes_its_mode_through(stub: types.ModuleType) -> None:
    with simulated_backend("mlu", capacity=8 * G, granularity=G, use_torch=True) as be:
        graph, pool = be.create_graph(), be.create_pool()
        with be.capture(graph, pool, None, capture_error_mode="relaxed"):
            pass
        be.replay(graph)
        be.release_graph(graph)
        be.release_pool(pool)
    kwargs = next(c for c in stub.calls if c[0] == "graph")[2]
    assert kwargs["capture_error_mode"] == "relaxed" and kwargs["pool"] == pool.id
    assert ("replay", graph) in stub.calls and ("reset", graph) in stub.calls


@pytest.mark.parametrize("message", [
    # torch_mlu's own form: "CNRT error: " + cnrtGetErrorStr(code), a description of the code
    "CNRT error: operation not permitted when the queue is capturing",
    ("CNRT error: the current capture sequence on the queue has been invalidated due to previous error\n"
     "Exception raised from capture_end at torch_mlu/csrc/framework/graphs/MLUGraph.cpp:212"),
    "CNRT error: two independent capture sequences are merged",
    "CNRT error: Capture sequence contains a fork that is not joined to the primary queue",
    # the codes and names, where a message carries them
    "cnrt error 100361", "CN_ERROR_QUEUE_CAPTURE_UNSUPPORTED", "cnrtErrorQueueCaptureIsolation"])
def test_cnrt_capture_errors_become_capture_errors(glue: torch_glue.MluGlue, stub: types.ModuleType,
                                                   message: str) -> None:
    stub.fail_capture = RuntimeError(message)
    with pytest.raises(hal.CaptureError, match="refused the capture") as info:
        with glue.capture(glue.create_graph(), None, None, None):
            pass
    assert info.value.backend == "mlu" and info.value.__cause__ is stub.fail_capture
    assert gc.isenabled()


def test_other_capture_failures_pass_through_unchanged(glue: torch_glue.MluGlue, stub: types.ModuleType) -> None:
    assert torch_glue.capture_failure(RuntimeError("allocated 1003610 bytes")) is None
    assert torch_glue.capture_failure(RuntimeError("CNRT error: no sufficient MLU device memory")) is None
    stub.fail_capture = ValueError("bad shape")
    with pytest.raises(ValueError, match="bad shape"):
        with glue.capture(glue.create_graph(), None, None, None):
            pass


def test_pool_active_blocks_reads_the_memory_snapshot(glue: torch_glue.MluGlue, stub: types.ModuleType) -> None:
    pool = glue.create_pool(None, None)
    stub.segments[:] = [
        {"address": 0x4000, "segment_pool_id": pool.id,
         "blocks": [{"size": 1024, "state": "inactive"}, {"size": 512, "state": "active_allocated"}]},
        {"address": 0x8000, "segment_pool_id": ("other", 1), "blocks": [{"size": 64, "state": "active_allocated"}]},
    ]
    assert glue.pool_active_blocks(pool) == [(0x4400, 512)]


@needs_gcc
def test_the_default_location_with_torch_mlu_is_available(stub: types.ModuleType,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(locate.ENV_LIBRARY, raising=False)
    monkeypatch.setenv(locate.ENV_HOME, str(home("mlu")))
    assert locate.probe_reason() is None


# -- on an MLU ------------------------------------------------------------------------------


@pytest.fixture
def mlu():
    be = hal.get_backend("mlu")
    if "graphs" not in be.capabilities:
        be.close()
        pytest.skip("the mlu backend runs without torch_mlu here (VMM only)")
    yield be
    be.close()


@pytest.mark.mlu
def test_capture_and_replay_on_an_mlu(mlu: hal.Backend) -> None:
    import torch

    x = torch.ones(8, device=mlu.torch_device())
    stream, graph, pool = mlu.create_stream(), mlu.create_graph(), mlu.create_pool()
    with mlu.use_stream(stream):
        (x * 2 + 1).sum()  # warm up on the capture queue
    mlu.synchronize(stream)
    with mlu.capture(graph, pool, stream, capture_error_mode="relaxed"):
        y = x * 2 + 1
    x.fill_(3)
    mlu.replay(graph)
    mlu.synchronize()
    assert y.cpu().tolist() == [7.0] * 8
    mlu.release_graph(graph)
    mlu.release_pool(pool)


@pytest.mark.mlu
def test_vmm_chunks_are_device_memory_on_an_mlu(mlu: hal.Backend) -> None:
    g = mlu.granularity
    before = mlu.mem_info().free
    va, h = mlu.create_vir_ptr(2 * g), mlu.create_phy_mem_handle(2 * g)
    mlu.map(va, 2 * g, h)
    assert mlu.mem_info().free <= before - 2 * g
    mlu.unmap(va, 2 * g)
    mlu.release_phy_mem_handle(h)
    mlu.release_vir_ptr(va, 2 * g)


@needs_gcc
def test_the_context_torch_mlu_binds_is_the_one_the_backend_uses(monkeypatch: pytest.MonkeyPatch) -> None:
    stub = generation("torch_mlu 1.24")
    monkeypatch.setitem(sys.modules, "torch_mlu", stub)
    bound: list[int] = []

    def set_device(device: int) -> None:  # as torch_mlu does: the device's context becomes current
        cndrv = locate.open_library(library_path[0])
        cndrv.init_once()  # torch_mlu initialises the driver itself
        dev, ctx = ctypes.c_uint64(), ctypes.c_void_p()
        cndrv.call("t", "cnDeviceGet", ctypes.byref(dev), device)
        cndrv.call("t", "cnCtxCreate", ctypes.byref(ctx), 0, dev.value)
        bound.append(int(ctx.value or 0))

    library_path = [str(private_copy("mlu"))]
    stub.mlu.set_device = set_device
    plugin = MluBackend(library=library_path[0], use_torch=True)
    assert not plugin.made_context and plugin.library.current_context("t") == bound[-1]
    plugin.mem_info()


def test_a_capture_that_fails_at_its_end_is_undone(glue: torch_glue.MluGlue, stub: types.ModuleType) -> None:
    pool, graph = glue.create_pool(None, None), glue.create_graph()
    stub.fail_end = RuntimeError("the capture sequence was invalidated by an earlier error")
    with pytest.raises(hal.CaptureError, match="could not be captured") as info:
        with glue.capture(graph, pool, "stream-1", None):
            pass
    assert info.value.backend == "mlu" and info.value.__cause__ is not None and gc.isenabled()
    assert ("endAllocateToPool", 0, pool.id) in stub.calls and ("releasePool", 0, pool.id) in stub.calls
    assert ("reset", graph) in stub.calls
    rearm = [c for c in stub.calls if c[0] == "graph" and c[1] is not graph]
    assert len(rearm) == 1 and "pool" not in rearm[0][2]  # an empty capture took the generators out of capture mode


def test_a_released_pool_is_refused_before_the_capture_starts(glue: torch_glue.MluGlue,
                                                              stub: types.ModuleType) -> None:
    pool = glue.create_pool(None, None)
    glue.release_pool(pool)
    with pytest.raises(hal.InvalidStateError, match="released") as info:
        with glue.capture(glue.create_graph(), pool, None, None):
            pass
    assert info.value.backend == "mlu" and info.value.call == "capture"
    assert not any(c[0] == "graph" for c in stub.calls)
