"""MemorySaver on fake: regions, pause and resume at the same addresses, backups, graphs, failures, cycles."""

from __future__ import annotations

import gc
import threading
import time

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import graphkit
import hal
from hal.backends.fake import FakeBackend
from tests.conftest import G
from tests.values import BAD_VALUE_SETTINGS, refused_cleanly


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def inside(saver: graphkit.MemorySaver, tag: str, t: torch.Tensor) -> bool:
    return any(s.ptr <= t.data_ptr() < s.ptr + s.size for s in saver._regions[tag].segments.values())


def test_regions_pause_and_resume_at_the_same_addresses(be: hal.Backend) -> None:
    saver = graphkit.MemorySaver(be)
    with saver.region("weights", backup=True):
        w = torch.randn(512, 512)
    with saver.region("kv_cache"):
        kv = torch.ones(2048, 512)  # 4 MiB
    outside = torch.randn(8)
    assert inside(saver, "weights", w) and inside(saver, "kv_cache", kv)
    assert not inside(saver, "weights", outside) and not inside(saver, "kv_cache", outside)
    expected, addresses = w.clone(), (w.data_ptr(), kv.data_ptr())
    baseline = be.live.chunk_bytes
    rss = rss_bytes()
    released = saver.pause("kv_cache")
    assert rss - rss_bytes() >= released * 3 // 4  # the host pages really went (memfd released)
    released += saver.pause()
    assert released == baseline and be.live.chunk_bytes == 0  # every byte of both tags went back
    assert be.live.ranges == 2  # the addresses stay reserved
    saver.resume()
    assert (w.data_ptr(), kv.data_ptr()) == addresses
    assert torch.equal(w, expected)  # backed up: bit-exact
    kv.fill_(3)  # no backup: the memory is back, its contents are not
    assert float(kv.sum()) == 3 * kv.numel()
    report = {r.tag: r for r in saver.report()}
    assert report["weights"].host_bytes == report["weights"].footprint_bytes and report["kv_cache"].host_bytes == 0
    del w, kv
    saver.close()


def test_pause_and_resume_of_one_tag_leave_the_others(be: hal.Backend) -> None:
    saver = graphkit.MemorySaver(be)
    with saver.region("a", backup=True):
        a = torch.arange(4096, dtype=torch.float32)
    with saver.region("b", backup=True):
        b = torch.arange(4096, dtype=torch.float32) * 2
    saver.pause("a")
    assert saver.is_paused("a") and not saver.is_paused("b")
    assert float(b.sum()) == 2 * float(torch.arange(4096.0).sum())  # b is still mapped and readable
    saver.pause("a")  # idempotent
    saver.resume("a")
    saver.resume("a")
    assert torch.equal(a, torch.arange(4096, dtype=torch.float32))
    with pytest.raises(hal.InvalidArgumentError, match="unknown"):
        saver.pause("nope")
    with pytest.raises(hal.InvalidArgumentError, match="tag="):
        with saver.region(""):
            pass
    with pytest.raises(hal.InvalidArgumentError, match="backup=True"):
        with saver.region("a", backup=False):
            pass
    del a, b
    saver.close()


def test_graphs_replay_after_resume_without_recapture(be: hal.Backend) -> None:
    saver = graphkit.MemorySaver(be)
    with saver.region("weights", backup=True):
        w = torch.randn(256, 256) / 16
    step = lambda x: torch.tanh(x @ w) + x  # noqa: E731,F821 - F821: ruff reads the `del w` below
    pools = graphkit.GraphPools(be, saver=saver)
    graphs = {}
    for n in (16, 4, 1):
        x = torch.zeros(n, 256)
        g = be.create_graph()
        with be.capture(g, pool=pools.pool(n)):
            out = step(x)
        graphs[n] = (g, x, out)
    runner = graphkit.GraphRunner(step, sizes=[2, 8], backend=be, saver=saver, progress=False)
    runner.capture(x=torch.zeros(8, 256))
    saver.pause()
    assert be.live.chunk_bytes == 0
    with pytest.raises(hal.InvalidStateError, match="paused"):
        runner(x=torch.randn(3, 256))
    with pytest.raises(hal.InvalidStateError, match="paused"):
        pools.pool("new")  # a new space needs memory
    saver.resume()
    for n, (g, x, out) in graphs.items():
        x.copy_(torch.randn(n, 256))
        be.replay(g)
        torch.testing.assert_close(out, step(x), rtol=1e-5, atol=1e-5)
    x = torch.randn(5, 256)
    torch.testing.assert_close(runner(x=x), step(x), rtol=1e-5, atol=1e-5)
    runner.close()
    for g, _, _ in graphs.values():
        be.release_graph(g)
    del graphs, out, w
    pools.close()
    saver.close()


def test_a_failed_resume_rolls_back_and_can_be_retried(be: hal.Backend) -> None:
    saver = graphkit.MemorySaver(be)
    with saver.region("weights", backup=True):
        w = torch.randn(1024, 256)  # several chunks' worth
        w2 = torch.randn(64, 256)
    expected = (w.clone(), w2.clone())
    pools = graphkit.GraphPools(be, saver=saver)
    g = be.create_graph()
    with be.capture(g, pool=pools.pool(1)):
        out = torch.relu(w2 @ w2.t())
    saver.pause()
    paused = be.live
    for hook, nth in (("create_phy_mem_handle", 2), ("map", 2), ("create_phy_mem_handle", 1)):
        be.faults.fail(hook, nth=nth)
        with pytest.raises(hal.DriverError, match="injected"):
            saver.resume()
        be.faults.clear()
        assert be.live == paused  # nothing made by the failed resume is left
        assert saver.is_paused("weights") or saver.is_paused("graphs")
    saver.resume()
    assert not any(r.paused for r in saver.report())
    assert torch.equal(w, expected[0]) and torch.equal(w2, expected[1])
    be.replay(g)
    torch.testing.assert_close(out, torch.relu(w2 @ w2.t()))
    be.release_graph(g)
    del w, w2, out
    pools.close()
    saver.close()


@pytest.mark.parametrize("restore", [False, True])
def test_a_failed_resume_keeps_the_backup_of_the_buffers_it_had_mapped(be: hal.Backend, restore: bool) -> None:
    """Two backed-up buffers under one tag; the second one's chunk fails: the first goes back to sleep with the
    backup of the pause, never one of the fresh memory (a later resume would bring back garbage)."""
    saver = graphkit.MemorySaver(be)
    bufs = [graphkit.ElasticBuffer(be, max_bytes=4 * G, saver=saver, tag="kv", backup=True) for _ in range(2)]
    data = torch.arange(G // 4, dtype=torch.int32)
    for i, buf in enumerate(bufs):
        buf.resize(G)
        buf.view(torch.int32, (G // 4,)).copy_(data + i)
    saver.pause("kv")
    be.faults.fail("create_phy_mem_handle", nth=2)
    with pytest.raises(hal.DriverError, match="injected"):
        saver.resume("kv", restore=restore)
    assert saver.is_paused("kv") and all(b.paused for b in bufs)
    saver.resume("kv")
    for i, buf in enumerate(bufs):
        assert torch.equal(buf.view(torch.int32, (G // 4,)), data + i)
        buf.close()
    saver.close()
    assert be.live.zero, be.live


def test_a_resume_whose_final_wait_fails_leaves_the_tag_paused(be: hal.Backend) -> None:
    """A resume is all or nothing up to the device's wait for it: one that raises left nothing awake (a caller
    that retries with ``resume()`` gets the backup back, not the fresh memory of a ``restore=False``)."""
    saver = graphkit.MemorySaver(be)
    buf = graphkit.ElasticBuffer(be, max_bytes=2 * G, saver=saver, tag="weights", backup=True)
    buf.resize(G)
    data = torch.arange(G // 4, dtype=torch.int32)
    buf.view(torch.int32, (G // 4,)).copy_(data)
    saver.pause("weights")
    be.faults.fail("synchronize", nth=1)
    with pytest.raises(hal.DriverError, match="injected"):
        saver.resume("weights", restore=False)
    assert saver.is_paused("weights") and buf.paused
    saver.resume("weights")
    assert torch.equal(buf.view(torch.int32, (G // 4,)), data)
    buf.close()
    saver.close()
    assert be.live.zero, be.live


def test_a_capture_into_a_paused_keys_handle_is_refused(be: hal.Backend) -> None:
    """A key kept from an earlier capture: its pool would hand out cached blocks of the unmapped space."""
    saver = graphkit.MemorySaver(be)
    pools = graphkit.GraphPools(be, saver=saver)
    g = be.create_graph()
    with be.capture(g, pool=pools.pool(1)):
        y = torch.ones(8, 64) * 2
    be.release_graph(g)
    del y
    gc.collect()
    saver.pause()
    handle = pools.pool(1)  # an existing key: no new memory needed to hand it out
    for attempt in range(3):
        g = be.create_graph()
        with pytest.raises(hal.InvalidStateError, match=r"key 1: .* is paused: resume it"):
            if attempt == 0:
                with be.capture(g, pool=handle):
                    pass
            elif attempt == 1:
                tuple(handle)  # what a framework's capture API does with a pool id
            else:
                with graphkit.graph_memory(pools=pools), pools.group(1), be.capture(g):
                    pass
        be.release_graph(g)
    saver.resume()
    g = be.create_graph()
    with be.capture(g, pool=handle):
        y = torch.ones(8, 64) * 3
    be.replay(g)
    assert torch.equal(y, torch.full((8, 64), 3.0))
    be.release_graph(g)
    del y
    pools.close()
    saver.close()
    assert be.live.zero, be.live


def test_a_failed_pause_leaves_the_tag_awake(be: hal.Backend) -> None:
    saver = graphkit.MemorySaver(be)
    with saver.region("weights", backup=True):
        w = torch.randn(1024, 256)
        w2 = torch.randn(1024, 256)  # a second segment
    expected = w.clone()
    assert len(saver._regions["weights"].segments) == 2
    be.faults.fail("unmap", nth=2)
    with pytest.raises(hal.DriverError):
        saver.pause("weights")
    be.faults.clear()
    assert not saver.is_paused("weights") and torch.equal(w, expected)  # still mapped, data intact
    saver.pause("weights")
    saver.resume("weights")
    assert torch.equal(w, expected)
    del w, w2
    saver.close()


def test_allocating_in_a_paused_region_raises(be: hal.Backend) -> None:
    saver = graphkit.MemorySaver(be)
    with saver.region("kv"):
        kv = torch.zeros(64)
    saver.pause("kv")
    with pytest.raises(hal.InvalidStateError, match="paused"):
        with saver.region("kv"):
            torch.zeros(64)
    saver.resume("kv")
    del kv
    saver.close()


def test_a_hundred_cycles_grow_nothing(be: hal.Backend) -> None:
    saver = graphkit.MemorySaver(be)
    with saver.region("weights", backup=True):
        w = torch.randn(512, 512)
    expected = w.clone()
    pools = graphkit.GraphPools(be, saver=saver)
    g = be.create_graph()
    x = torch.zeros(8, 512)
    with be.capture(g, pool=pools.pool(8)):
        out = x @ w
    for cycle in range(100):
        saver.pause()
        saver.resume()
        if cycle == 4:
            live, rss = be.live, rss_bytes()
    assert be.live == live
    assert rss_bytes() - rss < 4 << 20  # backups are reused, not made again each cycle
    x.copy_(torch.randn(8, 512))
    be.replay(g)
    torch.testing.assert_close(out, x @ expected)
    be.release_graph(g)
    del w, out
    pools.close()
    saver.close()


class NoUsePool(FakeBackend):
    """Pools over callbacks, but no way to make the framework allocate from one (like torch_mlu)."""

    @hal.hookimpl
    def capabilities(self) -> frozenset[str]:
        return frozenset({"graphs", "custom_pool"})


def test_without_use_pool_regions_refuse_and_graph_memory_still_sleeps() -> None:
    be = hal.Backend("nousepool", NoUsePool(granularity=G))
    saver = graphkit.MemorySaver(be)
    with pytest.raises(hal.UnsupportedError, match="use_pool"):
        with saver.region("weights"):
            pass
    pools = graphkit.GraphPools(be, saver=saver)
    g = be.create_graph()
    x = torch.ones(4, 4)
    with be.capture(g, pool=pools.pool(4)):
        out = x * 2
    saver.pause("graphs")
    assert be.live.chunk_bytes == 0
    saver.resume("graphs")
    be.replay(g)
    assert torch.equal(out, x * 2)
    be.release_graph(g)
    del out
    pools.close()
    saver.close()
    be.close()
    assert be.live.zero


@pytest.mark.parametrize("name", ["ascend", "mlu"])
def test_graph_memory_and_elastic_buffers_sleep_on_the_vendor_simulators(name: str,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The vendors' VMM calls give the memory back and map it again at the same addresses;
    regions need a framework pool hook these backends do not declare, and say so."""
    import sys

    from hal.backends._native.torch_glue import TorchGlue
    from tests.sim import compiler_reason, simulated_backend, simulator
    from tests.sim.torch_stub import generation

    if compiler_reason() is not None:
        pytest.skip(str(compiler_reason()))
    extension = {"ascend": "torch_npu", "mlu": "torch_mlu"}[name]
    # generations without pools the framework allocates from (torch_npu up to 2.12, torch_mlu without MemPool)
    old = generation({"ascend": "torch_npu 2.12.0", "mlu": "torch_mlu 1.24"}[name])
    monkeypatch.setitem(sys.modules, extension, old)
    monkeypatch.setattr(TorchGlue, "torch_device", lambda self: torch.device("meta"))  # plain torch has no npu/mlu
    with simulated_backend(name, capacity=64 * G, granularity=G, use_torch=True) as be:
        saver = graphkit.MemorySaver(be)
        with pytest.raises(hal.UnsupportedError, match="use_pool"):
            with saver.region("weights"):
                pass
        alloc = graphkit.SharedVMMAllocator(be, reserve_bytes=8 * G)
        saver.adopt(alloc)
        alloc.switch_to_new_virtual_space()
        ptr = alloc.allocate(3 * G)
        kv = graphkit.ElasticBuffer(be, max_bytes=16 * G, saver=saver, tag="kv_cache")
        kv.resize(5 * G)
        base, kv_ptr = be.live.chunk_bytes, kv.ptr
        assert base >= 8 * G
        assert saver.pause() >= 8 * G
        sim = simulator(be)
        assert be.live.chunk_bytes == 0 and sim.count("used") == 0 and sim.count("chunks") == 0
        with pytest.raises(hal.InvalidStateError):
            kv.resize(6 * G)  # growing a sleeping buffer is refused, not mapped behind the saver's back
        saver.resume()
        assert be.live.chunk_bytes == base and kv.ptr == kv_ptr and kv.mapped_bytes == 5 * G
        kv.resize(6 * G)
        alloc.deallocate(ptr)
        kv.close()
        saver.close()
        alloc.close()
    assert be.live.zero


def test_pausing_graphs_under_nccl_with_graph_register_on_warns_once(monkeypatch: pytest.MonkeyPatch,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    """The NCCL graph-registration hazard is named when it applies, and only then."""
    import logging

    import torch.distributed as dist

    from graphkit.saver import nccl as _nccl

    monkeypatch.setattr(_nccl, "_warned", False)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    be = hal.get_backend("fake", granularity=G)
    saver = graphkit.MemorySaver(be)
    pools = graphkit.GraphPools(be, saver=saver)
    with caplog.at_level(logging.WARNING, logger="graphkit.saver"):
        monkeypatch.setenv("NCCL_GRAPH_REGISTER", "0")
        saver.pause()
        saver.resume()
        assert "NCCL_GRAPH_REGISTER" not in caplog.text  # turned off: no hazard
        monkeypatch.delenv("NCCL_GRAPH_REGISTER")
        for _ in range(2):
            saver.pause()
            saver.resume()
    assert caplog.text.count("NCCL_GRAPH_REGISTER=0") == 1
    pools.close()
    saver.close()
    be.close()


# -- a tag pauses all or nothing, and says exactly what it is -------------------------------------------------

W = torch.randn(64, 64) / 8


def step(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ W) + x


def test_a_failed_pause_of_a_tag_with_several_sleepers_restores_them_all(be: hal.Backend) -> None:
    saver = graphkit.MemorySaver(be)
    a = graphkit.ElasticBuffer(be, max_bytes=4 * G, saver=saver, tag="kv")
    b = graphkit.ElasticBuffer(be, max_bytes=4 * G, saver=saver, tag="kv")
    a.resize(2 * G)
    b.resize(2 * G)
    awake = be.live
    be.faults.fail("unmap", nth=2)  # a (one chunk) is released; b's first unmap fails
    with pytest.raises(hal.DriverError, match="injected"):
        saver.pause("kv")
    assert not saver.is_paused("kv") and not a.paused and not b.paused and be.live == awake
    a.resize(3 * G)  # usable
    saver.pause("kv")
    assert a.paused and b.paused and saver.is_paused("kv")
    saver.resume("kv")
    a.close()
    b.close()
    saver.close()


def test_a_failed_pause_of_graphs_never_lets_the_runner_replay_into_unmapped_memory(be: hal.Backend) -> None:
    """The README's set-up: a GraphRunner and a GraphPools both under "graphs"."""
    saver = graphkit.MemorySaver(be)
    runner = graphkit.GraphRunner(step, sizes=[4, 8], backend=be, saver=saver, progress=False)
    runner.capture(x=torch.zeros(8, 64))
    pools = graphkit.GraphPools(be, saver=saver)
    g = be.create_graph()
    x = torch.zeros(4, 64)
    with be.capture(g, pool=pools.pool(4)):
        out = step(x)
    runner_maps = sum(s.mapped for s in runner.strategy.allocator.spaces.values())
    be.faults.fail("unmap", nth=runner_maps + 1)  # the first unmap of the pools' allocator
    with pytest.raises(hal.DriverError, match="injected"):
        saver.pause("graphs")
    assert not saver.is_paused("graphs") and not runner.strategy.allocator.paused
    y = torch.randn(3, 64)
    torch.testing.assert_close(runner(x=y), step(y))
    saver.pause("graphs")
    with pytest.raises(hal.InvalidStateError, match="paused"):
        runner(x=y)
    saver.resume("graphs")
    torch.testing.assert_close(runner(x=y), step(y))
    be.release_graph(g)
    del out
    runner.close()
    pools.close()
    saver.close()


@pytest.mark.parametrize("memory", ["region", "graphs"])
def test_two_faults_a_pause_whose_rollback_fails_leaves_the_tag_paused_until_resumed(be: hal.Backend,
                                                                                     memory: str) -> None:
    """A remap that fails twice in the rollback: the tag reads paused (its memory is partly unmapped),
    nothing runs over it, and a resume maps it back with the data."""
    saver = graphkit.MemorySaver(be)
    if memory == "region":
        with saver.region("w", backup=True):
            a = torch.ones(G // 4)
            b = torch.ones(G // 4) * 2
        tag = "w"
    else:
        runner = graphkit.GraphRunner(step, sizes=[32, 64], backend=be, saver=saver, progress=False)
        runner.capture(x=torch.zeros(64, 64))
        tag = "graphs"
    mapped = be.live.mappings
    be.faults.fail("unmap", nth=2)
    be.faults.fail("map", nth=1)
    be.faults.fail("map", nth=1)  # the retry of the remap fails too
    with pytest.raises(hal.DriverError, match="injected"):
        saver.pause(tag)
    assert saver.is_paused(tag) and be.live.mappings == mapped - 1  # exactly one granule would not map back
    saver.pause(tag)  # a pause of the paused tag releases what the failed one left
    assert saver.is_paused(tag) and be.live.mappings == 0 and be.live.chunks == 0
    if memory == "graphs":
        assert runner.strategy.allocator.paused
        with pytest.raises(hal.InvalidStateError, match="paused"):
            runner(x=torch.randn(2, 64))
    saver.resume(tag)
    assert not saver.is_paused(tag)
    if memory == "region":
        assert float(a.sum()) + float(b.sum()) == 3 * G // 4
        del a, b
    else:
        y = torch.randn(5, 64)
        torch.testing.assert_close(runner(x=y), step(y))
        runner.close()
    saver.close()


def test_a_fault_creating_a_regions_pool_leaves_no_half_made_tag(be: hal.Backend) -> None:
    saver = graphkit.MemorySaver(be)
    be.faults.fail("create_pool", nth=1)
    with pytest.raises(hal.DriverError, match="injected"):
        with saver.region("w"):
            pass
    assert saver.tags == []
    with saver.region("w"):
        t = torch.ones(1024)
    assert inside(saver, "w", t)
    assert saver.pause() > 0
    saver.resume()
    del t
    saver.close()
    assert be.live.zero, be.live


def test_a_tag_does_not_pause_while_a_region_block_of_it_is_open(be: hal.Backend) -> None:
    """Inside the block the framework may hand out the region's cached memory without asking graphkit:
    a pause there would let that memory be used unmapped."""
    saver = graphkit.MemorySaver(be)
    errors: list[BaseException] = []
    with saver.region("kv"):
        keep = torch.zeros(16)
        tmp = torch.zeros(1024)
        del tmp  # its block goes back to the pool's cache

        def pause() -> None:
            try:
                saver.pause("kv")
            except hal.HalError as exc:
                errors.append(exc)

        t = threading.Thread(target=pause)
        t.start()
        t.join()
        assert len(errors) == 1 and isinstance(errors[0], hal.InvalidStateError)
        assert "region() block" in str(errors[0]) and not saver.is_paused("kv")
        y = torch.ones(1024)  # mapped memory
        assert float(y.sum()) == 1024
    saver.pause("kv")  # outside the block it pauses
    saver.resume("kv")
    del keep, y
    saver.close()


def test_pause_and_resume_racing_runner_calls_in_eight_threads(be: hal.Backend) -> None:
    """A pause waits for the calls under way; calls during a pause are refused; every answer is right."""
    saver = graphkit.MemorySaver(be)
    w = torch.randn(128, 128) / 12
    runner = graphkit.GraphRunner(lambda x: torch.tanh(x @ w) @ w + x, sizes=[16, 32], backend=be, saver=saver,
                                  progress=False)
    runner.capture(x=torch.zeros(32, 128))
    stop = threading.Event()
    counts = {"ok": 0, "refused": 0}
    failures: list[BaseException] = []

    def serve(seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        while not stop.is_set():
            x = torch.randn(1 + seed % 32, 128, generator=gen)
            try:
                y = runner(x=x)
            except hal.InvalidStateError:
                counts["refused"] += 1
                continue
            except BaseException as exc:  # noqa: BLE001 - reported below
                failures.append(exc)
                return
            if not torch.allclose(y, torch.tanh(x @ w) @ w + x, atol=1e-5):
                failures.append(AssertionError("wrong answer"))
            counts["ok"] += 1

    threads = [threading.Thread(target=serve, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()

    def sleeper() -> None:
        for _ in range(150):
            saver.pause()
            saver.resume()

    sleepers = [threading.Thread(target=sleeper) for _ in range(2)]
    for t in sleepers:
        t.start()
    for t in sleepers:
        t.join(120)
    stop.set()
    for t in threads:
        t.join(60)
    assert not failures, failures[:3]
    assert counts["ok"] > 0
    runner.close()
    saver.close()
    assert be.live.zero, be.live


def test_a_thread_inside_awake_cannot_pause_that_tag(be: hal.Backend) -> None:
    saver = graphkit.MemorySaver(be)
    pools = graphkit.GraphPools(be, saver=saver)
    with saver.awake("graphs"):
        with pytest.raises(hal.InvalidStateError, match="awake"):
            saver.pause("graphs")
    saver.pause("graphs")
    with pytest.raises(hal.InvalidStateError, match="paused"):
        with saver.awake("graphs"):
            pass
    saver.resume("graphs")
    pools.close()
    saver.close()


def _two_tags(be: hal.Backend) -> tuple[graphkit.MemorySaver, list[graphkit.ElasticBuffer]]:
    saver = graphkit.MemorySaver(be)
    bufs = []
    for tag in ("a", "b"):
        buf = graphkit.ElasticBuffer(be, max_bytes=4 * G, saver=saver, tag=tag)
        buf.resize(G)
        bufs.append(buf)
    return saver, bufs


def _in_threads(*targets: object) -> None:
    threads = [threading.Thread(target=t, daemon=True) for t in targets]  # type: ignore[arg-type]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert not any(t.is_alive() for t in threads), "deadlock: threads still waiting after 20 s"


def test_two_threads_each_pausing_the_others_awake_tag_never_deadlock(be: hal.Backend) -> None:
    """Each thread inside awake(own tag) pauses the other's: the one whose wait would close the circle is refused;
    the other pauses once the refused one has left its block."""
    saver, bufs = _two_tags(be)
    barrier = threading.Barrier(2)
    outcome: dict[str, str] = {}

    def run(mine: str, other: str) -> None:
        with saver.awake(mine):
            barrier.wait()
            try:
                saver.pause(other)
                outcome[mine] = "paused"
            except hal.InvalidStateError as exc:
                outcome[mine] = str(exc)

    _in_threads(lambda: run("a", "b"), lambda: run("b", "a"))
    assert sorted(outcome.values())[-1] == "paused", outcome
    refused = sorted(outcome.values())[0]
    assert "MemorySaver.pause: waiting for" in refused and "would deadlock" in refused, outcome
    assert sum(saver.is_paused(t) for t in "ab") == 1
    saver.resume()
    for buf in bufs:
        buf.close()
    saver.close()


def test_a_pause_of_two_tags_against_a_nested_awake_block_never_deadlocks(be: hal.Backend) -> None:
    """pause("a", "b") waits for a block of "a" whose thread then opens a block of "b" (which waits for the pause)."""
    saver, bufs = _two_tags(be)
    inside, pausing = threading.Event(), threading.Event()
    outcome: dict[str, str] = {}

    def nested() -> None:
        with saver.awake("a"):
            inside.set()
            pausing.wait(5)
            time.sleep(0.2)  # the pause is waiting for this block now
            try:
                with saver.awake("b"):
                    outcome["nested"] = "held b"
            except hal.InvalidStateError as exc:
                outcome["nested"] = str(exc)

    def pause() -> None:
        inside.wait(5)
        pausing.set()
        try:
            saver.pause("a", "b")
            outcome["pause"] = "paused"
        except hal.InvalidStateError as exc:
            outcome["pause"] = str(exc)

    _in_threads(nested, pause)
    assert outcome["pause"] == "paused" and "would deadlock" in outcome["nested"], outcome
    saver.resume()
    for buf in bufs:
        buf.close()
    saver.close()


def test_the_pause_log_names_each_tags_own_bytes(be: hal.Backend, caplog: pytest.LogCaptureFixture) -> None:
    import logging

    saver = graphkit.MemorySaver(be)
    a = graphkit.ElasticBuffer(be, max_bytes=8 * G, saver=saver, tag="a")
    b = graphkit.ElasticBuffer(be, max_bytes=8 * G, saver=saver, tag="b")
    a.resize(2 * G)
    b.resize(5 * G)
    with caplog.at_level(logging.INFO, logger="graphkit.saver"):
        saver.pause("a", "b")
    assert "paused 'a': 128.0 KiB released" in caplog.text and "paused 'b': 320.0 KiB released" in caplog.text
    saver.resume()
    a.close()
    b.close()
    saver.close()


def test_after_the_saver_closed_a_paused_object_says_how_to_wake_it(be: hal.Backend) -> None:
    saver = graphkit.MemorySaver(be)
    kv = graphkit.ElasticBuffer(be, max_bytes=4 * G, saver=saver, tag="kv")
    kv.resize(G)
    saver.pause()
    saver.close()
    with pytest.raises(hal.InvalidStateError, match="restore_physical"):
        kv.resize(2 * G)
    kv.restore_physical()
    kv.resize(2 * G)
    kv.close()
    assert be.live.zero, be.live


def test_saver_close_goes_on_past_a_fault_and_a_second_close_finishes(be: hal.Backend) -> None:
    saver = graphkit.MemorySaver(be)
    for tag in ("a", "b"):
        with saver.region(tag):
            t = torch.ones(8)
    del t
    gc.collect()
    be.faults.fail("release_pool", nth=1)
    with pytest.raises(hal.DriverError, match="injected"):
        saver.close()
    assert not saver.closed
    saver.close()
    gc.collect()
    assert saver.closed and be.live.zero, be.live


def test_a_pause_waiting_for_a_runner_call_does_not_block_the_calls_own_allocations(be: hal.Backend) -> None:
    """A call inside a region block may need a new segment of the region while a pause waits for it."""
    import time

    saver = graphkit.MemorySaver(be)
    pools = graphkit.GraphPools(be, saver=saver)
    done = threading.Event()

    def call() -> None:
        with saver.region("kv"), saver.awake("graphs"):
            pauser = threading.Thread(target=saver.pause, args=("graphs",), daemon=True)
            pauser.start()
            time.sleep(0.2)  # the pause now waits for this block
            t = torch.ones(1 << 16)  # a new segment of the region
            assert float(t.sum()) == 1 << 16
        pauser.join(10)
        done.set()

    worker = threading.Thread(target=call, daemon=True)
    worker.start()
    worker.join(20)
    assert done.is_set(), "deadlock: the pause held the saver while it waited for the call"
    assert saver.is_paused("graphs")
    saver.resume()
    pools.close()
    gc.collect()
    saver.close()


def test_backup_buffers_are_made_when_a_region_block_ends_not_at_the_first_pause(be: hal.Backend) -> None:
    saver = graphkit.MemorySaver(be)
    with saver.region("weights", backup=True):
        w = torch.randn(512, 512)
    region = saver._regions["weights"]
    assert region.preparing is not None  # started as the block ended
    region.preparing.join()
    made = dict(region.host)
    assert set(made) == set(region.segments) and all(made[p].numel() == s.size for p, s in region.segments.items())
    expected = w.clone()
    saver.pause()
    assert all(region.host[p] is t for p, t in made.items())  # the pause copied into them, made none
    saver.resume()
    assert torch.equal(w, expected)
    report = {r.tag: r for r in saver.report()}
    assert report["weights"].pin_s > 0 and report["weights"].last_pause_s is not None
    del w
    saver.close()


def test_resume_without_restore_maps_the_memory_back_at_the_same_addresses_and_copies_nothing(
        be: hal.Backend) -> None:
    saver = graphkit.MemorySaver(be)
    with saver.region("weights", backup=True):
        w = torch.full((512, 512), 7.0)
    address = w.data_ptr()
    saver.pause()
    saver.resume("weights", restore=False)
    assert w.data_ptr() == address and not saver.is_paused("weights")
    assert not torch.equal(w, torch.full_like(w, 7.0))  # fresh memory: the backup was not copied in
    w.copy_(torch.full_like(w, 9.0))  # the new weights of an RL step, written in place
    saver.pause()  # the next pause backs up the new weights
    saver.resume()
    assert torch.equal(w, torch.full_like(w, 9.0))
    with pytest.raises(hal.InvalidArgumentError, match="restore"):
        saver.resume(restore="no")  # type: ignore[arg-type]
    del w
    saver.close()


def test_a_staged_wake_brings_the_weights_back_first(be: hal.Backend) -> None:
    saver = graphkit.MemorySaver(be)
    with saver.region("weights", backup=True):
        w = torch.randn(256, 512)  # 512 KiB
    with saver.region("kv_cache"):
        kv = torch.zeros(4096, 512)  # 8 MiB
    pools = graphkit.GraphPools(be, saver=saver)
    graph = be.create_graph()
    with be.capture(graph, pool=pools.pool(1)):
        out = (kv[:8] @ w.t()).relu()
    awake = be.mem_info().used
    saver.pause()
    asleep = be.mem_info().used
    saver.resume("weights", restore=False)
    staged = be.mem_info().used - asleep
    assert saver.is_paused("kv_cache") and saver.is_paused("graphs") and not saver.is_paused("weights")
    assert staged == sum(s.size for s in saver._regions["weights"].segments.values())  # the weights alone
    w.normal_()  # new weights loaded while the rest still sleeps
    saver.resume()
    assert be.mem_info().used == awake
    kv.zero_()
    be.replay(graph)
    torch.testing.assert_close(out, (kv[:8] @ w.t()).relu())
    be.release_graph(graph)
    del out, w, kv
    pools.close()
    saver.close()


@BAD_VALUE_SETTINGS
@given(value=st.one_of(st.integers(), st.none(), st.just(""), st.lists(st.text(), max_size=2), st.floats()))
def test_bad_tags_are_hal_errors(be: hal.Backend, value: object) -> None:
    saver = graphkit.MemorySaver(be)
    with pytest.raises(hal.HalError):
        with saver.region(value):  # type: ignore[arg-type]
            pass
    with pytest.raises(hal.HalError):
        saver.pause("unknown" if value is None else str(value) + "?")
    saver.close()
    with pytest.raises(hal.InvalidStateError):
        saver.pause()


SAVER_BAD_CALLS = {
    "is_paused(['x'])": lambda saver: saver.is_paused(["x"]),
    "check_awake(['x'])": lambda saver: saver.check_awake(["x"], "c"),
    "awake(['x'])": lambda saver: saver.awake(["x"]).__enter__(),
    "region(backup='yes')": lambda saver: saver.region("tb", backup="yes").__enter__(),
    "adopt(object())": lambda saver: saver.adopt(object(), "zz"),
    "MemorySaver('fake')": lambda saver: graphkit.MemorySaver("fake"),
}


@pytest.mark.parametrize("name", sorted(SAVER_BAD_CALLS))
def test_bad_arguments_are_refused_before_anything_is_made(name: str) -> None:
    with refused_cleanly(graphkit.MemorySaver) as (_, saver):
        SAVER_BAD_CALLS[name](saver)


def test_close_after_the_backends_close_finishes(be: hal.Backend) -> None:
    """The backend's close released the regions' pools and memory: the saver's close only forgets them."""
    saver = graphkit.MemorySaver(be)
    with saver.region("weights", backup=True):
        w = torch.ones(1 << 14)
    kv = graphkit.ElasticBuffer(be, max_bytes=4 * G, saver=saver, tag="kv")
    kv.resize(G)
    be.close()
    kv.close()
    saver.close()
    assert saver.closed and kv.closed
    del w
    gc.collect()
