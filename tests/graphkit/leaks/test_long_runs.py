"""Soak on fake, in CI: a thousand cycles of capture, replay, pause, resume, grow, shrink and close over several keys
and threads, and the process's host memory, file descriptors and threads back where they started."""

from __future__ import annotations

import contextlib
import gc
import os
import resource
import threading
import time
from collections.abc import Iterator

import torch

import graphkit
import hal
from tests.conftest import G

MIB = 1 << 20
THREADS = 4
CYCLES = 1_000  # over all threads
RSS_BOUND = 64 * MIB  # what a thousand cycles may leave behind in host memory (allocator caches, logging)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@contextlib.contextmanager
def _awake(saver: graphkit.MemorySaver, call: str) -> Iterator[None]:
    """``saver.awake("graphs")`` as an engine's step under another thread's pauses holds it: ``awake`` refuses
    a block when the pause came first (documented), so the step waits for the resume and enters again."""
    with contextlib.ExitStack() as stack:
        while True:
            try:
                stack.enter_context(saver.awake("graphs", call))
                break
            except hal.InvalidStateError as exc:
                if "is paused" not in str(exc):
                    raise
                time.sleep(0.001)
        yield


def _worker(t: int, be: hal.Backend, pools: graphkit.GraphPools, saver: graphkit.MemorySaver, cycles: int,
            start: threading.Barrier, wrong: list[str]) -> None:
    """``cycles`` cycles of one thread: a key of its own captured and replayed under the saver's turn, its elastic
    KV buffer grown, checked and shrunk, its own tag paused and resumed; every tenth cycle the buffer closed and made
    again, every 25th the graph memory of every thread paused and resumed."""
    gen = torch.Generator().manual_seed(t)
    w = torch.randn(64, 64, generator=gen) / 8
    tag = f"kv{t}"

    def new_buffer() -> graphkit.ElasticBuffer:
        return graphkit.ElasticBuffer(be, max_bytes=8 * G, saver=saver, tag=tag, chunk_bytes=G, backup=t % 2 == 0)

    kv = new_buffer()
    start.wait()
    try:
        for i in range(cycles):
            n = (1, 8, 32, 4)[i % 4]
            x = torch.randn(n, 64, generator=gen)
            graph = be.create_graph()
            with _awake(saver, tag):
                with be.capture(graph, pool=pools.pool((t, i))):
                    out = torch.tanh(x @ w) * 2
                x.copy_(torch.randn(n, 64, generator=gen))
                be.replay(graph)
                if not torch.allclose(out, torch.tanh(x @ w) * 2, atol=1e-5):
                    wrong.append(f"thread {t} cycle {i}: replay")
                be.release_graph(graph)
                del out
                pools.release((t, i))
                kv.resize((1 + i % 8) * G)  # grow, and shrink every eighth cycle
                view = kv.view(torch.int32, (G // 4,))
                view.fill_(i)
                del view
            saver.pause(tag)
            saver.resume(tag)
            check = kv.view(torch.int32, (G // 4,))
            if kv.backup and int(check[0]) != i:
                wrong.append(f"thread {t} cycle {i}: the buffer woke with {int(check[0])}")
            del check
            if i % 10 == 9:
                kv.close()
                kv = new_buffer()
            if t == 0 and i % 25 == 24:
                saver.pause("graphs")
                saver.resume("graphs")
    except BaseException as exc:  # noqa: BLE001 - reported by the test
        wrong.append(f"thread {t}: {type(exc).__name__}: {exc}")
    finally:
        kv.close()


def _run(cycles_per_thread: int) -> list[str]:
    be = hal.get_backend("fake", granularity=G)
    saver = graphkit.MemorySaver(be)
    pools = graphkit.GraphPools(be, saver=saver)
    wrong: list[str] = []
    start = threading.Barrier(THREADS)
    threads = [threading.Thread(target=_worker, args=(t, be, pools, saver, cycles_per_thread, start, wrong))
               for t in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not any(thread.is_alive() for thread in threads), "a soak thread hangs"
    pools.close()
    saver.close()
    live = be.live
    be.close()
    assert not wrong, wrong[:10]  # a worker's failure first: it may also have left a graph unreleased
    assert live.zero, live
    return wrong


def test_a_thousand_cycles_over_keys_and_threads_leave_memory_fds_and_threads_as_they_were() -> None:
    _run(2)  # the warm-up: torch's kernels, logging, the first of everything
    gc.collect()
    rss, fds, threads = _rss(), _fds(), threading.active_count()
    t0 = time.perf_counter()
    wrong = _run(CYCLES // THREADS)
    seconds = time.perf_counter() - t0
    gc.collect()
    assert not wrong, wrong[:10]
    assert _fds() == fds, f"{_fds() - fds} file descriptor(s) left open"
    assert threading.active_count() == threads, [t.name for t in threading.enumerate()]
    grown = _rss() - rss
    assert grown <= RSS_BOUND, f"host RSS grew by {grown / MIB:.1f} MiB over {CYCLES} cycles ({seconds:.1f} s)"
