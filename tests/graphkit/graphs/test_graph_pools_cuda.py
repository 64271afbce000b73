"""GraphPools and graph_memory on an NVIDIA GPU, through torch.cuda.graph as engines call it."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

import graphkit
import hal
from tests.ranks import explain, run_ranks

pytestmark = pytest.mark.cuda

SIZES = [256, 128, 64, 32, 16, 8, 4, 1]


@pytest.fixture
def be():
    backend = hal.get_backend("cuda")
    yield backend
    torch.cuda.synchronize()
    gc.collect()
    backend.close()


def make_step(width: int = 1024, depth: int = 4):
    gen = torch.Generator().manual_seed(0)
    ws = [(torch.randn(width, width, generator=gen) / width ** 0.5).to("cuda") for _ in range(depth)]

    def step(x: torch.Tensor) -> torch.Tensor:
        h = x
        for w in ws:
            h = torch.tanh(h @ w) + h
        return h

    return step


def check_replays(graphs: dict, step) -> None:
    for _n, (graph, x, out) in graphs.items():
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, step(x), rtol=1e-3, atol=1e-3)


def engine_loop(step, sizes, pool_for, warm_up=None) -> dict:
    """An engine's capture loop as nano-vllm writes it: torch.cuda.graph, the first graph's pool after that."""
    graphs: dict = {}
    graph_pool = None
    for n in sizes:
        x = torch.zeros(n, 1024, device="cuda")
        (warm_up or (lambda f, *a: f(*a)))(step, x)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool_for(n, graph_pool)):
            out = step(x)
        if graph_pool is None:
            graph_pool = graph.pool()
        graphs[n] = (graph, x, out)
    return graphs


@pytest.mark.parametrize("order", ["descending", "ascending"])
def test_torch_cuda_graph_takes_a_pool_handle(be: hal.Backend, order: str) -> None:
    step = make_step()
    sizes = SIZES if order == "descending" else SIZES[::-1]
    with graphkit.GraphPools(be) as pools:
        graphs = engine_loop(step, sizes, lambda n, _: pools.pool(n))
        check_replays(graphs, step)
        report = pools.report()
        assert len(report.keys) == len(sizes) and all(k.used_bytes for k in report.keys)
        # the largest, in any order, plus the granules under the outputs the loop keeps (each its key's alone)
        assert report.chunk_bytes <= max(k.mapped_bytes for k in report.keys) + pools.allocator.survivor_bytes
        assert report.chunk_bytes == pools.allocator.shared_bytes + pools.allocator.survivor_bytes
        for graph, _, _ in graphs.values():
            graph.reset()
        del graphs
        gc.collect()
    assert be.live.chunks == 0 and be.live.mappings == 0


@pytest.mark.xfail(strict=False, reason="on an H100 (torch 2.11) the second thread's capture failed with "
                   "cudaErrorStreamCaptureUnsupported while the first one captured; the likely cause, a device-wide "
                   "wait at the second capture's end (its survivor promotion) under the first one's capture, is "
                   "gone: promotions wait for the captures under way. Not strict until a GPU run shows it passes")
def test_two_threads_capture_into_handles_made_up_front_in_a_process_of_its_own() -> None:
    """The test below, in a process of its own: its failed capture leaves torch's caching allocator in a state
    that a later pool release of the same process aborts on."""
    test = f"{__file__}::test_two_threads_capture_into_handles_made_up_front"
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test],
                         env={**os.environ, _OWN_PROCESS: "1"}, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]


_OWN_PROCESS = "GRAPHKIT_TEST_OWN_PROCESS"


@pytest.mark.skipif(os.environ.get(_OWN_PROCESS) != "1", reason="runs in a process of its own, from the test above")
def test_two_threads_capture_into_handles_made_up_front(be: hal.Backend) -> None:
    """Handles made first; thread A's capture goes on while thread B captures into another key (each on its
    own stream, thread_local capture mode): neither runs out of room, both replay right.

    Through ``capture_begin``/``capture_end``, as a capture from worker threads must be: ``torch.cuda.graph``
    empties the allocator's cache on entry, which torch refuses (an internal assert) while another thread
    captures."""
    step = make_step()
    a_started, b_done = threading.Event(), threading.Event()
    done: dict = {}
    with graphkit.GraphPools(be) as pools:
        handles = {n: pools.pool(n) for n in (64, 256)}
        for n in handles:
            step(torch.zeros(n, 1024, device="cuda"))  # the engine's warm-up
        torch.cuda.synchronize()

        def capture(n: int, between) -> None:
            x = torch.zeros(n, 1024, device="cuda")
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.stream(torch.cuda.Stream()):
                    graph.capture_begin(handles[n], capture_error_mode="thread_local")
                    try:
                        h = step(x)
                        between()
                        out = step(h)
                    finally:
                        graph.capture_end()
                torch.cuda.synchronize()
                done[n] = (graph, x, out)
            except BaseException as exc:  # noqa: BLE001 - checked below
                done[n] = exc

        def first() -> None:
            try:
                capture(256, lambda: (a_started.set(), b_done.wait(30)))
            finally:
                a_started.set()

        def second() -> None:
            a_started.wait(30)
            try:
                capture(64, lambda: None)
            finally:
                b_done.set()

        threads = [threading.Thread(target=first), threading.Thread(target=second)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert all(isinstance(v, tuple) for v in done.values()), done
        check_replays(done, lambda x: step(step(x)))
        for graph, _, _ in done.values():
            graph.reset()
        done.clear()
        gc.collect()
    assert be.live.chunks == 0 and be.live.mappings == 0


def test_the_scope_routes_an_engines_own_loop(be: hal.Backend) -> None:
    step = make_step()
    before = dict(vars(torch.cuda.CUDAGraph))
    with graphkit.graph_memory(be) as pools:
        graphs = engine_loop(step, SIZES, lambda n, pool: pool)
    assert dict(vars(torch.cuda.CUDAGraph)) == before  # torch restored exactly
    report = pools.report()
    assert len(report.keys) == len(SIZES)  # one space per capture, although the engine passed graph.pool()
    assert report.chunk_bytes <= max(k.mapped_bytes for k in report.keys) + pools.allocator.survivor_bytes
    check_replays(graphs, step)
    # engines that read graph.pool() keep getting a working pool id: a later capture outside the scope
    graph, x, _ = graphs[SIZES[-1]]
    extra = torch.cuda.CUDAGraph()
    with torch.cuda.graph(extra, pool=graph.pool()):
        y = step(x)
    extra.replay()
    torch.testing.assert_close(y, step(x), rtol=1e-3, atol=1e-3)
    extra.reset()
    # a space lives as long as its graph
    spaces = pools.allocator.num_virtual_spaces
    graphs.pop(SIZES[0])[0].reset()
    gc.collect()
    pools.collect()
    assert pools.allocator.num_virtual_spaces == spaces - 1
    for graph, _, _ in graphs.values():
        graph.reset()
    del graphs, graph, x, y
    gc.collect()
    pools.close()
    assert be.live.chunks == 0 and be.live.mappings == 0


STALE_SCRIPT = textwrap.dedent('''
    import gc, torch, hal, graphkit
    be = hal.get_backend("cuda")
    pools = graphkit.GraphPools(be)
    handle = pools.pool("gone")
    pools.release("gone")
    stream = torch.cuda.current_stream()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, pool=handle):
            pass
    except hal.InvalidStateError as exc:
        assert "gone" in str(exc), exc
    else:
        raise SystemExit("no error")
    finally:
        torch.cuda.set_stream(stream)  # torch leaves its side stream current when capture_begin raises
    # the error was raised inside torch's argument conversion: the process must stay sound afterwards
    w = torch.randn(512, 512, device="cuda")
    torch.randn(64, 512, device="cuda") @ w  # cuBLAS made outside any capture
    torch.cuda.synchronize()
    for _ in range(50):
        g = torch.cuda.CUDAGraph()
        x = torch.randn(64, 512, device="cuda")
        with torch.cuda.graph(g, pool=pools.pool("live")):
            y = x @ w
        g.replay(); torch.cuda.synchronize(); g.reset()
        del g, y
        gc.collect()
    pools.close(); be.close()
    print("sound")
''')


@pytest.mark.slow  # 13 s on an H100: a child process that dies on purpose
def test_a_stale_handle_raises_through_torch(tmp_path) -> None:
    """In a process of its own: the error comes out of torch's argument conversion."""
    script = tmp_path / "stale.py"
    script.write_text(STALE_SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "sound" in proc.stdout, proc.stdout + proc.stderr


def test_routing_through_hal_capture_and_runner(be: hal.Backend) -> None:
    """GraphRunner's own captures go through hal and are routed the same way."""
    step = make_step()
    with graphkit.graph_memory(be) as pools:
        runner = graphkit.GraphRunner(step, sizes=[1, 8, 32], backend=be, kind="private", progress=False)
        runner.capture(x=torch.zeros(32, 1024, device="cuda"))
    assert len(pools.report().keys) == 3
    x = torch.randn(5, 1024, device="cuda")
    torch.testing.assert_close(runner(x=x), step(x), rtol=1e-3, atol=1e-3)
    runner.close()
    gc.collect()
    pools.collect()
    assert pools.keys == []
    pools.close()


FRESH_STREAM_SCRIPT = textwrap.dedent('''
    import sys, torch, hal, graphkit
    order, adoption = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    ws = [torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16) / 32 for _ in range(4)]
    bias = torch.randn(1024, device="cuda", dtype=torch.bfloat16)
    def step(x):
        for w in ws:
            x = torch.nn.functional.linear(torch.relu(x @ w), w, bias)  # cuBLAS and cuBLASLt (bias epilogue)
        return x
    sizes = [64, 32, 8, 1] if order == "descending" else [1, 8, 32, 64]
    be = hal.get_backend("cuda")
    pools = graphkit.GraphPools(be)
    graphs = {}
    scope = graphkit.graph_memory(be, pools=pools) if adoption == "scope" else None
    if scope is not None:
        scope.__enter__()
    for n in sizes:  # nano-vllm's loop: warm up on the engine's own stream, capture on torch's
        x = torch.zeros(n, 1024, device="cuda", dtype=torch.bfloat16)
        step(x)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=pools.pool(n) if adoption == "port" else None):
            out = step(x)
        graphs[n] = (g, x, out)
    if scope is not None:
        scope.__exit__(None, None, None)
    big = [size for entry in pools._keys.entries.values() for _, size in be.pool_active_blocks(entry.pool)
           if size >= 1 << 20]
    assert not big, f"a block of a library's per-stream state was born in a capture: {big}"
    for n, (g, x, out) in graphs.items():
        x.copy_(torch.randn_like(x))
        g.replay()
        torch.testing.assert_close(out, step(x))
    print("REPORT", pools.report())
    print("started")
''')


@pytest.mark.parametrize("adoption", ["scope", "port"])
@pytest.mark.parametrize("order", ["descending", "ascending"])
def test_an_engine_that_warms_up_on_its_own_stream_starts(tmp_path, order: str, adoption: str) -> None:
    """In a fresh process, as an engine starts: torch's capture stream never ran a GEMM before the first capture.

    The cuBLAS and cuBLASLt workspaces of that stream are made by hal before the capture begins, so they are
    not born in the first key's space (where the isolation check refuses every later graph that uses them).
    """
    script = tmp_path / "fresh_stream.py"
    script.write_text(FRESH_STREAM_SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(script), order, adoption], env=env, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0 and "started" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]


def test_a_warm_up_on_the_capture_stream_still_works(be: hal.Backend) -> None:
    """pools.warm_up runs the step on the stream torch.cuda.graph captures on (no longer needed for cuBLAS)."""
    step = make_step()
    with graphkit.graph_memory(be) as pools:
        graphs = engine_loop(step, SIZES[:3], lambda n, pool: pool, warm_up=pools.warm_up)
    check_replays(graphs, step)
    for graph, _, _ in graphs.values():
        graph.reset()
    del graphs
    gc.collect()
    pools.close()


@pytest.mark.slow
def test_ten_thousand_spaces_with_flat_physical_memory(be: hal.Backend) -> None:
    """Sealed spaces take the address space they use: 10,000 fit where device-sized ones stopped near 1,650."""
    g = be.granularity
    alloc = graphkit.SharedVMMAllocator(be)
    used0 = be.mem_info().used
    for i in range(10_000):
        alloc.switch_to_new_virtual_space()
        alloc.allocate(g if i % 10 else 4 * g)
    assert alloc.num_virtual_spaces == 10_000 and alloc.physical_bytes == 4 * g
    assert be.mem_info().used - used0 < 64 << 20  # page tables are not the cost
    alloc.close()


ROUTED_SCRIPT = textwrap.dedent('''
    import gc, torch, hal, graphkit
    be = hal.get_backend("cuda")
    w = torch.randn(256, 256, device="cuda")
    x = torch.zeros(8, 256, device="cuda")
    with graphkit.graph_memory(be) as pools:
        torch.tanh(x @ w)  # an engine's warm-up, on its own stream
        graphs = []
        for _ in range(2_000):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = torch.tanh(x @ w)
            graphs.append((graph, out))
    assert len(pools.keys) == 2_000, len(pools.keys)
    alloc = pools.allocator  # one granule shared, or each kept output's granule its key's alone
    assert alloc.shared_bytes <= be.granularity and alloc.survivor_bytes <= 2_000 * be.granularity, alloc
    graphs[-1][0].replay()
    torch.testing.assert_close(graphs[-1][1], torch.tanh(x @ w))
    for graph, _ in graphs:
        graph.reset()
    del graphs, out
    gc.collect()
    pools.close()
    be.close()
    print("sound")
''')


@pytest.mark.slow
def test_two_thousand_routed_captures(tmp_path) -> None:
    """In a process of its own, so that a crash stays in it."""
    script = tmp_path / "routed.py"
    script.write_text(ROUTED_SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "sound" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]


TP_SCRIPT = textwrap.dedent('''
    import os, sys, torch, torch.distributed as dist
    import hal, graphkit
    rank = int(sys.argv[1]); world = 2
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    gen = torch.Generator().manual_seed(0)
    w1 = (torch.randn(512, 1024, generator=gen) / 32).chunk(world, 0)[rank].cuda()   # column parallel
    w2 = (torch.randn(1024, 512, generator=gen) / 32).chunk(world, 1)[rank].cuda()   # row parallel
    def step(x):
        part = torch.relu(x @ w1.t()) @ w2.t()
        dist.all_reduce(part)                     # the collective inside the graph
        return part + x
    be = hal.get_backend("cuda", device=rank)
    sizes = [64, 32, 8, 1]
    x = torch.zeros(64, 1024, device="cuda")      # [n, 1024] @ w1.t() [1024, 256] @ w2.t() [256, 1024]
    step(x); torch.cuda.synchronize()             # NCCL communicator made outside any capture
    graphs = {}
    with graphkit.graph_memory(be) as pools:      # one GraphPools per rank
        for n in sizes:
            step(x[:n])  # the engine's own warm-up, on its own stream (hal prepares the capture stream's cuBLAS)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                out = step(x[:n])
            graphs[n] = (g, out)
    assert len(pools.keys) == len(sizes)
    for n, (g, out) in graphs.items():
        x.copy_(torch.randn(64, 1024, generator=torch.Generator().manual_seed(n)).cuda())
        g.replay(); torch.cuda.synchronize()
        torch.testing.assert_close(out, step(x[:n]), rtol=1e-4, atol=1e-4)
    for g, _ in graphs.values():
        g.reset()
    del graphs, out
    pools.close()
    dist.destroy_process_group()
    print(f"rank {rank} ok: {len(sizes)} sizes, replays equal eager")
''')


@pytest.mark.multi_gpu
def test_tensor_parallel_two_ranks_with_an_all_reduce_in_each_graph(tmp_path) -> None:
    script = tmp_path / "tp.py"
    script.write_text(TP_SCRIPT)
    results = run_ranks(script, timeout=120)  # every rank is killed at the deadline: a hung rank fails the test
    assert all(r.ok and f"rank {r.rank} ok" in r.output for r in results), explain(results)
