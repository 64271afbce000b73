"""The ascend backend's torch_npu glue: on a CPU against stand-ins of each torch_npu generation, on an NPU for real."""

from __future__ import annotations

import gc
import logging
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

import hal
from hal.backends._native import torch_compat as compat
from hal.backends._native.callbacks import ALLOC_FN, FREE_FN, KEEP_ALIVE
from hal.backends.ascend import locate, torch_glue
from tests.conftest import G
from tests.paths import ROOT
from tests.sim import compiler_reason, home, sim_env, simulated_backend
from tests.sim.torch_stub import extension_stub, generation

needs_gcc = pytest.mark.skipif(compiler_reason() is not None, reason=str(compiler_reason()))
ROUTED = {"custom_pool", "use_pool", "capture_routing"}
OLD, NEW = ["torch_npu 2.5.1", "torch_npu 2.12.0"], ["torch_npu 2.13.0", "torch_npu 2.14.0"]


@pytest.fixture(autouse=True)
def no_alloc_conf(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("PYTORCH_NPU_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def stub(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    module = extension_stub("torch_npu")
    monkeypatch.setitem(sys.modules, "torch_npu", module)
    return module


@pytest.fixture
def glue(stub: types.ModuleType) -> torch_glue.NpuGlue:
    return torch_glue.NpuGlue(0, ext=stub)


def segments(pool: object) -> list[int]:
    """The sizes the pool's allocator callback handed out, live now."""
    return sorted(pool.callbacks.live.values())  # type: ignore[attr-defined]


def test_the_static_capabilities_follow_the_installed_api() -> None:
    full, old = extension_stub("torch_npu"), extension_stub("torch_npu", mempool=False)
    capabilities = torch_glue.EXTENSION.capabilities
    assert capabilities(full, full.npu) == {"graphs", "custom_pool"}
    assert capabilities(old, old.npu) == {"graphs"}
    assert capabilities(types.SimpleNamespace(), types.SimpleNamespace()) == frozenset()


@pytest.mark.parametrize("label", OLD + NEW)
def test_each_generation_gets_the_routed_capabilities_only_where_pools_take_hals_memory(
        label: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="hal.ascend"):
        glue = torch_glue.NpuGlue(0, ext=generation(label, capture_api=True))
    if label in NEW:
        assert glue.capabilities == {"graphs"} | ROUTED and glue.routing is not None
        assert caplog.text == ""
    else:
        assert glue.capabilities == {"graphs"} and glue.routing is None
        assert f"{label}" in caplog.text and "from torch_npu 2.13 on" in caplog.text


@pytest.mark.parametrize("conf", ["PYTORCH_NPU_ALLOC_CONF=expandable_segments:True",
                                  "PYTORCH_NPU_ALLOC_CONF=max_split_size_mb:64,expandable_segments:True",
                                  "PYTORCH_ALLOC_CONF=expandable_segments:True"])
def test_expandable_segments_turn_the_routed_capabilities_off(monkeypatch: pytest.MonkeyPatch, conf: str,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    var, _, value = conf.partition("=")
    monkeypatch.setenv(var, value)
    with caplog.at_level(logging.WARNING, logger="hal.ascend"):
        glue = torch_glue.NpuGlue(0, ext=generation("torch_npu 2.14.0", capture_api=True))
    assert glue.capabilities == {"graphs"}
    assert f"expandable segments are on ({conf})" in caplog.text
    with pytest.raises(hal.UnsupportedError, match="expandable segments are on"):
        glue.create_pool(lambda n: 0, lambda p, n: None)


@pytest.mark.parametrize("conf", ["expandable_segments:False", "pin_memory_expandable_segments:True"])
def test_other_allocator_settings_leave_the_routed_capabilities_on(monkeypatch: pytest.MonkeyPatch,
                                                                   conf: str) -> None:
    monkeypatch.setenv("PYTORCH_NPU_ALLOC_CONF", conf)
    assert torch_glue.NpuGlue(0, ext=generation("torch_npu 2.14.0", capture_api=True)).capabilities >= ROUTED


@pytest.mark.parametrize("label", NEW)
def test_a_capture_into_a_custom_pool_takes_hals_memory(label: str) -> None:
    stub = generation(label)
    glue, seen = torch_glue.NpuGlue(0, ext=stub), []
    pool = glue.create_pool(lambda n: seen.append(n) or 0x10000 * len(seen), lambda p, n: None)
    with glue.capture(glue.create_graph(), pool, None, None):
        stub.allocate(4096)
    assert seen == [4096] and segments(pool) == [4096]
    assert not [c for c in stub.calls if c[0] == "own_alloc"]


@pytest.mark.parametrize("label", OLD)
def test_why_old_generations_are_refused_their_captures_bypass_a_pools_allocator(label: str) -> None:
    """What the stand-in of torch_npu <= 2.12 does (as the real one): pool=MemPool.id alone takes its own memory."""
    stub, seen = generation(label), []
    mempool = stub.npu.MemPool(stub._C._npu_customAllocator(0, 0))
    with stub.npu.graph(stub.npu.NPUGraph(), pool=mempool.id):
        stub.allocate(4096)
    assert seen == [] and ("own_alloc", 4096, "no pool with a custom allocator") in stub.calls


@needs_gcc
@pytest.mark.parametrize("label", OLD)
def test_an_old_generation_never_lets_a_capture_silently_bypass_graphkit(
        label: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setitem(sys.modules, "torch_npu", generation(label, capture_api=True))
    with caplog.at_level(logging.WARNING), \
            simulated_backend("ascend", capacity=8 * G, granularity=G, use_torch=True) as be:
        assert be.capabilities == {"graphs"}
        assert label in caplog.text
        with pytest.raises(hal.UnsupportedError, match="custom_pool"):
            be.create_pool(lambda n: 0, lambda p, n: None)
        with pytest.raises(hal.UnsupportedError, match="capture_routing"):
            be.route_captures(lambda graph, pool: None)
        with pytest.raises(hal.UnsupportedError, match="use_pool"):
            be.use_pool(be.create_pool())
        assert be.create_pool() is not None  # pools from torch_npu's own allocator still work


@needs_gcc
def test_graphkit_falls_back_to_a_shared_pool_on_an_old_generation_and_says_why(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    import torch

    import graphkit
    from hal.backends._native.torch_glue import TorchGlue

    monkeypatch.setitem(sys.modules, "torch_npu", generation("torch_npu 2.12.0", capture_api=True))
    monkeypatch.setattr(TorchGlue, "torch_device", lambda self: torch.device("meta"))  # plain torch has no "npu"
    with caplog.at_level(logging.WARNING), \
            simulated_backend("ascend", capacity=8 * G, granularity=G, use_torch=True) as be:
        pools = graphkit.GraphPools(be)
        assert "custom_pool" in caplog.text and "torch_npu 2.12.0" in caplog.text
        pools.close()


@needs_gcc
@pytest.mark.parametrize("label", NEW)
def test_a_new_generation_routes_captures_and_use_pool_to_the_callbacks(
        label: str, monkeypatch: pytest.MonkeyPatch) -> None:
    stub = generation(label, capture_api=True)
    monkeypatch.setitem(sys.modules, "torch_npu", stub)
    with simulated_backend("ascend", capacity=8 * G, granularity=G, use_torch=True) as be:
        assert be.capabilities == {"graphs"} | ROUTED
        seen: list[int] = []
        pool = be.create_pool(lambda n: seen.append(n) or 0x20000, lambda p, n: None)
        with be.use_pool(pool):
            stub.allocate(512)
        assert ("use_mem_pool", pool.mempool, 0) in stub.calls
        with be.capture(be.create_graph(), pool, None):
            stub.allocate(1024)
        assert seen == [512, 1024]


@pytest.mark.parametrize("label, name", [("torch_npu 2.12.0", "_npu_endAllocateCurrentStreamToPool"),
                                         ("torch_npu 2.13.0", "_npu_endAllocateToPool")])
def test_the_renamed_end_allocate_entry_point_is_found(label: str, name: str) -> None:
    stub = generation(label)
    glue = torch_glue.NpuGlue(0, ext=stub)
    assert glue.private(compat.END_ALLOCATE_TO_POOL) is getattr(stub._C, name)


def test_pool_attribution_without_segment_pool_id_uses_the_callbacks_addresses() -> None:
    stub = generation("torch_npu 2.14.0", pool_ids_in_snapshot=False)
    glue = torch_glue.NpuGlue(0, ext=stub)
    pool = glue.create_pool(lambda n: 0x40000, lambda p, n: None)
    with glue.capture(glue.create_graph(), pool, None, None):
        address = stub.allocate(4096)
    blocks = [{"size": 1024, "state": "active_allocated"}, {"size": 3072, "state": "inactive"}]
    stub.segments[:] = [{"address": address, "segment_pool_id": pool.id, "blocks": blocks},
                        {"address": 0x90000, "segment_pool_id": ("other", 1), "blocks": blocks}]
    assert "segment_pool_id" not in stub.npu.memory_snapshot()[0]
    assert glue.pool_active_blocks(pool) == [(address, 1024)]


def test_the_2_5_1_snapshot_has_no_pool_ids_and_attributes_nothing_to_a_device_pool(
        caplog: pytest.LogCaptureFixture) -> None:
    stub = generation("torch_npu 2.5.1")
    glue = torch_glue.NpuGlue(0, ext=stub)
    pool = glue.create_pool(None, None)
    stub.segments[:] = [{"address": 0x1000, "segment_pool_id": pool.id,
                         "blocks": [{"size": 64, "state": "active_allocated"}]}]
    with caplog.at_level(logging.INFO, logger="hal.ascend"):
        assert glue.pool_active_blocks(pool) == []  # no segment_pool_id: nothing can be attributed
    assert "the memory snapshot of torch_npu 2.5.1.post1 has no segment_pool_id" in caplog.text


@needs_gcc
def test_the_backend_uses_torch_npu_when_it_is_installed(stub: types.ModuleType) -> None:
    with simulated_backend("ascend", capacity=8 * G, granularity=G, use_torch=None) as be:
        assert be.capabilities == {"graphs", "custom_pool", "use_pool"}  # a graph class without capture_begin
        assert ("set_device", 0) in stub.calls
        va, h = be.create_vir_ptr(G), be.create_phy_mem_handle(G)  # the VMM half is unchanged
        be.map(va, G, h)
        extension, reasons = be.plugin.capability_report()
        assert extension == "torch_npu 2.14.0" and set(reasons) == {"graphs"} | ROUTED


@needs_gcc
def test_builds_without_mempool_report_no_custom_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch_npu", extension_stub("torch_npu", mempool=False))
    with simulated_backend("ascend", capacity=8 * G, granularity=G, use_torch=True) as be:
        assert be.capabilities == {"graphs"}
        with pytest.raises(hal.UnsupportedError, match="custom_pool"):
            be.create_pool(lambda n: 0, lambda p, n: None)
        assert be.create_pool() is not None  # pools from torch_npu's own allocator still work
        assert "MemPool" in be.plugin.capability_report()[1]["custom_pool"]


@needs_gcc
def test_python_m_hal_prints_the_torch_npu_version_and_why_each_capability_is_off(tmp_path: Path) -> None:
    root = ROOT
    (tmp_path / "torch_npu.py").write_text(  # the stand-in, importable in the child as torch_npu
        "import sys\nfrom tests.sim.torch_stub import generation\n"
        "sys.modules[__name__] = generation('torch_npu 2.12.0', capture_api=True)\n")
    env = {k: v for k, v in os.environ.items() if k not in ("HAL_MLU_LIBRARY", "NEUWARE_HOME", "HAL_BACKEND",
                                                            "PYTORCH_NPU_ALLOC_CONF", "PYTORCH_ALLOC_CONF")}
    env.update(sim_env("ascend", capacity=1 << 30, granularity=1 << 16),
               PYTHONPATH=os.pathsep.join([str(tmp_path), str(root)]))
    out = subprocess.run([sys.executable, "-m", "hal"], env=env, capture_output=True, text=True, timeout=120,
                         cwd=root)
    assert out.returncode == 0, out.stderr
    assert "torch extension: torch_npu 2.12.0" in out.stdout
    assert "graphs: on (" in out.stdout
    for capability in ROUTED:
        assert f"{capability}: off (torch_npu 2.12.0 gives a capture's segments" in out.stdout, out.stdout


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
    assert "2048" not in str(err) and "1800" not in str(err)  # no fixed budget: it depends on HDK and CANN
    assert gc.isenabled()


@pytest.mark.parametrize("message", ["error code is 207008", "EE9999: stream resources are insufficient",
                                     "ACL_ERROR_RT_NO_STREAM_RESOURCE", "NPU function error: error code is 207005",
                                     "EL0004: resource alloc fail", "rtStreamCreate: alloc sq cq fail"])
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
        assert be.plugin.capability_report() == (None, {"graphs": "the backend runs without torch_npu "
                                                                  "(VMM hooks only)"})


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
        pytest.skip("this torch_npu gives no pool's segments to a custom allocator (see python -m hal)")
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


def test_a_capture_that_fails_at_its_end_is_undone(glue: torch_glue.NpuGlue, stub: types.ModuleType) -> None:
    pool, graph = glue.create_pool(None, None), glue.create_graph()
    stub.fail_end = RuntimeError("the capture sequence was invalidated by an earlier error")
    with pytest.raises(hal.CaptureError, match="could not be captured") as info:
        with glue.capture(graph, pool, "stream-1", None):
            pass
    assert info.value.backend == "ascend" and info.value.__cause__ is not None and gc.isenabled()
    assert ("endAllocateToPool", 0, pool.id) in stub.calls and ("releasePool", 0, pool.id) in stub.calls
    assert ("reset", graph) in stub.calls
    rearm = [c for c in stub.calls if c[0] == "graph" and c[1] is not graph]
    assert len(rearm) == 1 and "pool" not in rearm[0][2]  # an empty capture took the generators out of capture mode


def test_a_released_pool_is_refused_before_the_capture_starts(glue: torch_glue.NpuGlue,
                                                              stub: types.ModuleType) -> None:
    pool = glue.create_pool(None, None)
    glue.release_pool(pool)
    with pytest.raises(hal.InvalidStateError, match="released") as info:
        with glue.capture(glue.create_graph(), pool, None, None):
            pass
    assert info.value.backend == "ascend" and info.value.call == "capture"
    assert not any(c[0] == "graph" for c in stub.calls)
