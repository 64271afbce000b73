"""Parts of the cuda backend that run without a GPU: the probe, the allocator callbacks, the private
torch APIs, the map step it shares with ascend and mlu, and its torch glue against a stand-in torch.cuda."""

from __future__ import annotations

import ctypes
import gc
import logging
import subprocess
import sys
import types

import pytest
import torch

import hal
from hal.backends._native import torch_compat as compat
from hal.backends._native.callbacks import ALLOC_FN, FREE_FN, CallbackPair
from hal.backends._native.vmm import map_with_access
from hal.backends.cuda.torch_glue import CudaGlue
from tests.sim.torch_stub import cuda_stub


def test_import_stays_cheap() -> None:
    code = ("import sys, hal, hal.backends.cuda; hal.list_backends(); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch' or m.startswith('cuda.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_probe_gives_a_reason_or_none() -> None:
    from hal.backends.cuda.probe import probe_reason

    reason = probe_reason()
    assert reason is None or (isinstance(reason, str) and reason)


def _call_alloc(pair: CallbackPair, size: int, device: int = 0) -> int:
    """Call the C alloc callback through its function pointer, as torch would."""
    fn = ctypes.cast(pair.addresses[0], ALLOC_FN)
    return fn(size, device, None) or 0


def _call_free(pair: CallbackPair, ptr: int, size: int, device: int = 0) -> None:
    ctypes.cast(pair.addresses[1], FREE_FN)(ptr, size, device, None)


def test_callbacks_pass_through_and_track_segments() -> None:
    seen: list[tuple] = []
    pair = CallbackPair(lambda n: seen.append(("alloc", n)) or 0x10000, lambda p, n: seen.append(("free", p, n)),
                        device=0, backend="cuda", label="test pool")
    assert _call_alloc(pair, 4096) == 0x10000
    assert pair.live == {0x10000: 4096}
    _call_free(pair, 0x10000, 4096)
    assert seen == [("alloc", 4096), ("free", 0x10000, 4096)]
    assert pair.live == {}


def test_alloc_never_raises_and_logs_the_reason(caplog: pytest.LogCaptureFixture) -> None:
    def alloc(n: int) -> int:
        raise MemoryError("capacity of 2.0 MiB reached")

    pair = CallbackPair(alloc, lambda p, n: None, device=0, backend="cuda", label="test pool")
    with caplog.at_level(logging.ERROR, logger="hal.cuda"):
        assert _call_alloc(pair, 1 << 20) == 0
    assert "capacity of 2.0 MiB reached" in caplog.text
    assert "capacity of 2.0 MiB reached" in (pair.last_error or "")
    pair2 = CallbackPair(lambda n: 0, lambda p, n: None, device=0, backend="cuda", label="test pool")
    assert _call_alloc(pair2, 512) == 0 and "returned no memory" in (pair2.last_error or "")


def test_alloc_refuses_another_device() -> None:
    pair = CallbackPair(lambda n: 0x20000, lambda p, n: None, device=1, backend="cuda", label="test pool")
    assert _call_alloc(pair, 512, device=0) == 0
    assert "device 0" in (pair.last_error or "")


def test_gc_is_off_inside_the_callbacks() -> None:
    states: list[bool] = []
    pair = CallbackPair(lambda n: states.append(gc.isenabled()) or 0x30000,
                        lambda p, n: states.append(gc.isenabled()), device=0, backend="cuda", label="test pool")
    assert gc.isenabled()
    _call_alloc(pair, 512)
    _call_free(pair, 0x30000, 512)
    assert states == [False, False] and gc.isenabled()


def test_released_pair_forgets_callables_after_last_free() -> None:
    pair = CallbackPair(lambda n: 0x40000, lambda p, n: None, device=0, backend="cuda", label="test pool")
    _call_alloc(pair, 512)
    pair.pool_released = True
    assert pair.alloc is not None
    _call_free(pair, 0x40000, 512)
    assert pair.alloc is None and pair.free is None
    assert _call_alloc(pair, 512) == 0 and "released" in (pair.last_error or "")


# -- private torch APIs ------------------------------------------------------------------------------


@pytest.mark.skipif(torch.version.cuda is not None, reason="checks a CPU build of torch")
def test_a_cpu_torch_lacks_the_pool_apis_and_says_which() -> None:
    glue = CudaGlue(0)
    kept = {"lazy_graphs", "graph_update"} if glue.keeps_graphs() else set()
    assert glue.capabilities == {"graphs", "capture_routing"} | kept
    assert glue.private(compat.END_ALLOCATE_TO_POOL) is None  # a dummy that raises when called counts as missing
    with pytest.raises(hal.UnsupportedError, match=r"torch\._C\._cuda_customAllocator is missing in torch 2\."):
        glue.create_pool(lambda n: 0, lambda p, n: None)
    with pytest.raises(hal.UnsupportedError, match=r"_cuda_releasePool is missing in torch .* \(checked on torch"):
        glue.require(compat.RELEASE_POOL, "capture")


def test_active_blocks_reads_one_pool_of_one_device() -> None:
    blocks = [{"size": 512, "state": "active_allocated"}, {"size": 256, "state": "inactive"},
              {"size": 128, "state": "active_allocated"}]
    segments = [{"address": 0x1000, "segment_pool_id": (0, 1), "device": 0, "blocks": blocks},
                {"address": 0x9000, "segment_pool_id": (0, 1), "device": 1, "blocks": blocks},
                {"address": 0x5000, "segment_pool_id": (0, 2), "device": 0, "blocks": blocks},
                {"address": 0x7000, "segment_pool_id": [0, 1], "blocks": [{"address": 0x7400, "size": 64,
                                                                          "state": "active_allocated"}]}]
    assert compat.active_blocks(segments, (0, 1), 0) == [(0x1000, 512), (0x1300, 128), (0x7400, 64)]
    assert len(compat.active_blocks(segments)) == 7


# -- map, then set access ----------------------------------------------------------------------------


def _snapshot_that_drops_pool_id_references(mempool_id: tuple | None = None,
                                             include_traces: bool = True) -> list[dict]:
    """torch.cuda.memory_snapshot as torch 2.11 runs it: its C entry drops a reference to each pool id element."""
    for part in (mempool_id or (0, 0))[:2]:
        ctypes.pythonapi.Py_DecRef(ctypes.py_object(part))
    return []


def test_snapshots_leave_the_callers_pool_id_alone() -> None:
    """Pool ids above 256 are heap integers: a snapshot must not free the caller's (an H100 soak crashed)."""
    pool_id = (0, int("1000003"))
    refs = sys.getrefcount(pool_id[1])
    for _ in range(1000):
        assert compat.memory_snapshot(_snapshot_that_drops_pool_id_references, pool_id) == []
        assert compat.memory_snapshot(lambda mempool_id=None, include_traces=True: [], pool_id) == []
    refs_after = sys.getrefcount(pool_id[1])
    assert refs_after == refs
    assert pool_id == (0, 1000003)


def test_a_failed_access_call_unmaps_and_raises_its_own_error(caplog: pytest.LogCaptureFixture) -> None:
    done: list[str] = []

    def refuse() -> None:
        raise hal.DriverError("cuMemSetAccess failed", backend="cuda", call="map")

    with pytest.raises(hal.DriverError, match="cuMemSetAccess"):
        map_with_access(lambda: done.append("map"), refuse, lambda: done.append("unmap"),
                        backend="cuda", ptr=0x1000, access_call="cuMemSetAccess")
    assert done == ["map", "unmap"]

    def unmap_fails() -> None:
        raise hal.DriverError("cuMemUnmap failed", backend="cuda", call="map")

    with caplog.at_level(logging.ERROR, logger="hal.cuda"), pytest.raises(hal.DriverError, match="cuMemSetAccess"):
        map_with_access(lambda: None, refuse, unmap_fails, backend="cuda", ptr=0x1000, access_call="cuMemSetAccess")
    assert "undoing the map at 0x1000 after a failed cuMemSetAccess" in caplog.text
    map_with_access(lambda: done.append("map"), None, pytest.fail, backend="cuda", ptr=0, access_call="-")
    assert done == ["map", "unmap", "map"]


# -- the glue against a stand-in torch.cuda ------------------------------------------------------------


def test_capabilities_follow_the_allocator_backend() -> None:
    assert CudaGlue(0, ext=cuda_stub()).capabilities == {"graphs", "capture_routing", "custom_pool", "use_pool"}
    glue = CudaGlue(0, ext=cuda_stub(allocator_backend="cudaMallocAsync"))
    assert glue.capabilities == {"graphs", "capture_routing"}
    with pytest.raises(hal.UnsupportedError, match="cudaMallocAsync"):
        glue.create_pool(lambda n: 0, lambda p, n: None)


def test_a_lazy_graph_is_instantiated_at_its_first_replay() -> None:
    stub = cuda_stub(keep_graph=True)
    glue = CudaGlue(0, ext=stub)
    assert "lazy_graphs" in glue.capabilities
    lazy, eager = glue.create_graph(lazy=True), glue.create_graph()
    # both keep their captured graph (a route may take either's replays); the eager one is instantiated at its end
    assert lazy.lazy and lazy.torch_graph.keep_graph and eager.torch_graph.keep_graph and not eager.lazy
    assert "lazy" in repr(lazy)
    for graph in (lazy, eager):
        with glue.capture(graph, None, None, None):
            pass
    assert eager.torch_graph.instantiated and not lazy.torch_graph.instantiated  # captured, not instantiated
    glue.replay(lazy)
    glue.replay(lazy)
    assert [c[0] for c in stub.calls if c[0] in ("instantiate", "replay") and c[1] is lazy.torch_graph] == [
        "instantiate", "replay", "replay"]


def test_an_update_hands_the_driver_the_executable_graph_and_the_lazy_capture() -> None:
    glue = CudaGlue(0, ext=cuda_stub(keep_graph=True))
    assert {"lazy_graphs", "graph_update"} <= glue.capabilities
    target, source, eager = glue.create_graph(lazy=True), glue.create_graph(lazy=True), glue.create_graph()
    for graph in (target, source, eager):
        with glue.capture(graph, None, None, None):
            pass
    updates: list[tuple[int, int]] = []
    glue.update_graph(target, source, lambda exe, g, s: updates.append((exe, g)))
    assert target.instantiated and not source.instantiated  # the target first, never the source
    assert updates == [(target.torch_graph.raw_cuda_graph_exec(), source.torch_graph.raw_cuda_graph())]
    assert all(updates[0])
    with pytest.raises(hal.InvalidArgumentError, match="lazy=True"):
        glue.update_graph(target, eager, lambda exe, g, s: updates.append((exe, g)))
    glue.release_graph(source)
    with pytest.raises(hal.InvalidStateError, match=r"source=.* is not captured"):
        glue.update_graph(target, source, lambda exe, g, s: updates.append((exe, g)))
    assert len(updates) == 1


def test_lazy_graphs_need_a_torch_that_keeps_graphs() -> None:
    glue = CudaGlue(0, ext=cuda_stub())
    assert "lazy_graphs" not in glue.capabilities
    with pytest.raises(hal.UnsupportedError, match="keep_graph"):
        glue.create_graph(lazy=True)


def test_a_capture_into_a_custom_pool_and_its_teardown() -> None:
    stub = cuda_stub()
    glue = CudaGlue(1, ext=stub)
    pool, graph = glue.create_pool(lambda n: 0x10000, lambda p, n: None), glue.create_graph()
    assert pool.mempool.allocator[0] == "allocator" and pool.id == pool.mempool.id and pool.device == 1
    with glue.capture(graph, pool, None, None) as got:
        assert got is graph and not gc.isenabled()
    assert gc.isenabled() and graph.captured and pool.graphs == 1
    assert ("capture_begin", graph.torch_graph, pool.id) in stub.calls and ("mode", "global") in stub.calls
    other = glue.create_graph()
    with glue.capture(other, None, None, "relaxed"):
        pass
    assert other.stream is graph.stream and graph.stream.device == torch.device("cuda", 1)  # the glue's own
    assert stub.cuda.current_stream(1) is not graph.stream
    glue.replay(graph)  # from the current stream: ordered both ways around the replay
    assert [c[0] for c in stub.calls[-3:]] == ["wait_stream", "replay", "wait_stream"]
    with pytest.raises(hal.InvalidStateError):
        with glue.capture(graph, pool, None, None):
            pass
    stream = graph.stream
    glue.release_graph(graph)
    assert graph.released and pool.graphs == 0 and ("synchronize", stream) in stub.calls
    glue.release_pool(pool)
    assert pool.released and pool.mempool is None and pool.callbacks.alloc is None
    with pytest.raises(hal.InvalidStateError, match="released"):
        glue.pool_active_blocks(pool)


def test_pool_active_blocks_and_device_pools() -> None:
    stub = cuda_stub()
    glue = CudaGlue(0, ext=stub)
    pool = glue.create_pool(None, None)
    stub.segments[:] = [{"address": 0x4000, "segment_pool_id": pool.id, "device": 0,
                         "blocks": [{"size": 64, "state": "inactive"}, {"size": 32, "state": "active_allocated"}]}]
    assert glue.pool_active_blocks(pool) == [(0x4040, 32)]
    glue.release_pool(pool)
    assert ("empty_cache",) in stub.calls


def test_a_failed_capture_is_undone() -> None:
    stub = cuda_stub()
    glue = CudaGlue(0, ext=stub)
    pool, graph = glue.create_pool(lambda n: 0x10000, lambda p, n: None), glue.create_graph()
    before = stub.cuda.current_stream()
    stub.fail_end = RuntimeError("operation not permitted when stream is capturing")
    with pytest.raises(hal.CaptureError, match="not permitted"):
        with glue.capture(graph, pool, None, None):
            pass
    assert stub.cuda.current_stream() is before
    assert ("endAllocateToPool", 0, pool.id) in stub.calls and ("releasePool", 0, pool.id) in stub.calls
    assert ("reset", graph.torch_graph) in stub.calls and not graph.captured and pool.graphs == 0
    rearm = [c for c in stub.calls if c[0] == "capture_begin" and c[1] is not graph.torch_graph]
    assert len(rearm) == 1 and rearm[0][2] is None  # an empty capture took the generators out of capture mode
    stub.fail_begin = RuntimeError("capture_begin failed")
    with pytest.raises(RuntimeError, match="capture_begin failed"):
        with glue.capture(glue.create_graph(), None, None, None):
            pass
    assert stub.cuda.current_stream() is before


def test_out_of_memory_in_a_capture_carries_the_pools_reason() -> None:
    def alloc(n: int) -> int:
        raise MemoryError("capacity of 2.0 MiB reached")

    glue = CudaGlue(0, ext=cuda_stub())
    pool = glue.create_pool(alloc, lambda p, n: None)
    with pytest.raises(torch.OutOfMemoryError) as info:
        with glue.capture(glue.create_graph(), pool, None, None):
            assert ALLOC_FN(pool.callbacks.addresses[0])(4 << 20, 0, None) is None
            raise torch.OutOfMemoryError("CUDA out of memory")
    assert any("no segment" in note and "capacity" in note for note in info.value.__notes__)


def test_a_route_that_owns_replays_gets_the_replays_of_the_engines_own_graphs() -> None:
    """An engine's CUDAGraph made while captures are routed keeps its captured graph; a route with on_replay
    gets every ``graph.replay()`` (with the backend's graph object for it), which the glue then launches,
    instantiating it at its first launch; one that no route serves is instantiated at its capture's end, as
    torch would, and one made before routing began is left as the class makes it."""
    from hal.backends.cuda.graph import FrameworkGraph
    from hal.types import Route

    stub = cuda_stub(keep_graph=True)
    glue = CudaGlue(0, ext=stub)
    assert glue.routing is not None and glue.routing.serves_replays
    cuda = stub.cuda
    before = cuda.CUDAGraph()
    served: list[object] = []
    pools = [types.SimpleNamespace(id=(0, n)) for n in (1, 2)]
    routes = iter([Route(pools[0], on_replay=served.append), Route(pools[1]), None])
    with glue.routing.activate(0, lambda graph, pool: next(routes)):
        mine, theirs, left = cuda.CUDAGraph(), cuda.CUDAGraph(), cuda.CUDAGraph()
        for graph in (mine, theirs, left):
            with cuda.graph(graph):
                pass
    assert not before.keep_graph and mine.keep_graph and theirs.keep_graph
    assert not mine.instantiated and theirs.instantiated and left.instantiated  # served: left to its route
    mine.replay()
    mine.instantiate()  # the route instantiates it when it must: nothing happens now
    assert not mine.instantiated
    record = served[0]
    assert isinstance(record, FrameworkGraph) and record.torch_graph is mine and served == [record]
    glue.replay(record)  # the route's launch: torch's own replay of the class, on the current stream
    assert mine.instantiated and record.instantiated
    assert [c[0] for c in stub.calls if c[0] in ("instantiate", "replay") and c[1] is mine] == ["instantiate",
                                                                                                 "replay"]
    mine.reset()  # the engine resets it: the route hears of it, and its record refuses to launch
    assert record.released
    with pytest.raises(hal.InvalidStateError, match="released"):
        glue.replay(record)


def test_a_graph_that_draws_random_numbers_keeps_its_own_executable() -> None:
    stub = cuda_stub(keep_graph=True)
    offset = [0]

    class Generator:
        def get_offset(self) -> int:
            return offset[0]

    stub.cuda.default_generators = [Generator()]
    glue = CudaGlue(0, ext=stub)
    plain, random, other = (glue.create_graph(lazy=True) for _ in range(3))
    for graph in (plain, random, other):
        with glue.capture(graph, None, None, None):
            pass
    glue.replay(plain)
    original = type(random.torch_graph).replay

    def drawing(self: object) -> None:  # torch's replay advances the generator by what the graph drew
        original(self)
        offset[0] += 4

    type(random.torch_graph).replay = drawing  # type: ignore[method-assign]
    glue.replay(random)
    type(random.torch_graph).replay = original  # type: ignore[method-assign]
    assert plain.draws_random is False and random.draws_random is True and other.draws_random is None
    updates: list[tuple[int, int]] = []
    with pytest.raises(hal.InvalidArgumentError, match="draws random numbers"):
        glue.update_graph(random, other, lambda exe, g, s: updates.append((exe, g)))
    with pytest.raises(hal.InvalidArgumentError, match="draws random numbers"):
        glue.update_graph(plain, random, lambda exe, g, s: updates.append((exe, g)))
    glue.update_graph(plain, other, lambda exe, g, s: updates.append((exe, g)))
    assert len(updates) == 1
