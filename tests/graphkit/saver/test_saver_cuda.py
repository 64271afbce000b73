"""MemorySaver on an NVIDIA GPU: regions in torch pools over graphkit memory, graphs intact after a resume."""

from __future__ import annotations

import gc

import pytest
import torch

import graphkit
import hal

pytestmark = pytest.mark.cuda
MIB = 1 << 20


@pytest.fixture
def be():
    backend = hal.get_backend("cuda")
    yield backend
    torch.cuda.synchronize()
    gc.collect()
    backend.close()


def test_pause_gives_memory_back_and_resume_keeps_weights_and_graphs(be: hal.Backend) -> None:
    saver = graphkit.MemorySaver(be)
    with saver.region("weights", backup=True):
        w = torch.randn(4096, 8192, device="cuda")  # 128 MiB
    with saver.region("kv_cache"):
        kv = torch.zeros(256 * MIB // 4, device="cuda")
    expected = w.clone()
    pools = graphkit.GraphPools(be, saver=saver)
    x = torch.randn(64, 4096, device="cuda")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pools.pool(64)):
        out = x @ w
    torch.cuda.synchronize()
    used = be.mem_info().used
    released = saver.pause()
    asleep = be.mem_info().used
    assert released >= 384 * MIB and used - asleep >= released - 4 * MIB  # the driver sees it go
    saver.resume()
    assert torch.equal(w, expected)  # bit-exact, same address
    torch.cuda.empty_cache()  # the comparison's 32 MiB result sits in torch's own cache, not ours
    for _ in range(100):  # cycles grow nothing
        saver.pause()
        saver.resume()
    assert abs(be.mem_info().used - used) <= 4 * MIB
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, x @ w)
    graph.reset()
    del out, w, kv, expected
    gc.collect()
    pools.close()
    saver.close()


def test_an_elastic_buffer_grows_in_place_on_the_gpu(be: hal.Backend) -> None:
    buf = graphkit.ElasticBuffer(be, max_bytes=1 << 30)
    buf.resize(8 * MIB)
    head = buf.view(torch.float32, (8 * MIB // 4,))
    head.copy_(torch.arange(head.numel(), device="cuda", dtype=torch.float32))
    ptr = buf.ptr
    buf.resize(512 * MIB)
    assert buf.ptr == ptr and head.data_ptr() == ptr
    assert torch.equal(head, torch.arange(head.numel(), device="cuda", dtype=torch.float32))
    whole = buf.view(torch.float32, (512 * MIB // 4,))
    whole[-1] = 7
    torch.cuda.synchronize()
    assert float(whole[-1]) == 7
    del head, whole
    buf.close()


def test_a_failed_pause_and_a_failed_resume_roll_back_on_the_gpu(be: hal.Backend) -> None:
    """Real driver calls: a pause that fails half-way maps the same chunks back (data intact); a resume
    whose backup copy fails releases what it made and stays paused; the retry brings the data back."""
    saver = graphkit.MemorySaver(be)
    kv = graphkit.ElasticBuffer(be, max_bytes=64 * MIB, saver=saver, tag="kv", backup=True,
                                chunk_bytes=be.granularity)  # a chunk per granule: the third unmap is mid-pause
    kv.resize(16 * MIB)
    n = 16 * MIB // 4
    view = kv.view(torch.int32, (n,))
    view.copy_(torch.arange(n, device="cuda", dtype=torch.int32))
    del view
    torch.cuda.synchronize()
    be.faults.fail("unmap", nth=3)
    with pytest.raises(hal.DriverError, match="injected"):
        saver.pause("kv")
    assert not saver.is_paused("kv") and not kv.paused
    view = kv.view(torch.int32, (n,))
    assert torch.equal(view, torch.arange(n, device="cuda", dtype=torch.int32))
    del view
    saver.pause("kv")
    asleep = be.live
    be.faults.fail("tensor_at", nth=1)  # the copy back from the host
    with pytest.raises(hal.DriverError, match="injected"):
        saver.resume("kv")
    assert saver.is_paused("kv") and kv.paused and be.live == asleep
    saver.resume("kv")
    view = kv.view(torch.int32, (n,))
    assert torch.equal(view, torch.arange(n, device="cuda", dtype=torch.int32))
    del view
    kv.close()
    saver.close()


def test_pause_and_resume_racing_runner_calls_on_the_gpu(be: hal.Backend) -> None:
    """A pause waits for the replays under way; calls during it are refused; every answer is right."""
    import threading

    saver = graphkit.MemorySaver(be)
    w = torch.randn(512, 512, device="cuda") / 24
    runner = graphkit.GraphRunner(lambda x: torch.tanh(x @ w) @ w + x, sizes=[16, 64], backend=be, saver=saver,
                                  progress=False)
    runner.capture(x=torch.zeros(64, 512, device="cuda"))
    stop = threading.Event()
    failures: list[BaseException] = []
    served = [0]

    def serve() -> None:
        while not stop.is_set():
            x = torch.randn(40, 512, device="cuda")
            try:
                y = runner(x=x)
            except hal.InvalidStateError:
                continue
            except BaseException as exc:  # noqa: BLE001 - reported below
                failures.append(exc)
                return
            if not torch.allclose(y, torch.tanh(x @ w) @ w + x, atol=1e-3):
                failures.append(AssertionError("wrong answer"))
            served[0] += 1

    threads = [threading.Thread(target=serve) for _ in range(4)]
    for t in threads:
        t.start()
    for _ in range(100):
        saver.pause()
        saver.resume()
    stop.set()
    for t in threads:
        t.join(60)
    assert not failures, failures[:3]
    assert served[0] > 0
    runner.close()
    saver.close()
