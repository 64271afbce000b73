"""Every path that unmaps or releases device memory waits for the kernels still queued over it (CUDA).

Each path runs in a child process: kernels that pass over 1 GiB twenty times are queued on the memory, then the
path is taken at once (no synchronize of ours). Unmapped under them, the device faults and the child dies
("an illegal memory access"); ordered after them, it exits 0 and the data the kernels wrote is complete where the
memory survives. One child per path, so a fault cannot poison the next test's context.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests.paths import ROOT

pytestmark = pytest.mark.cuda

PRELUDE = """
import gc, torch, hal, graphkit
be = hal.get_backend("cuda")
GIB = 1 << 30
PASSES = 20

def queue(t):
    for _ in range(PASSES):
        t.add_(1)   # ~20 passes over the tensor still queued when the path is taken
"""

PATHS = {
    # MemorySaver: a region's segments torn down by close() (c01), by pause(), by resume's rollback-free path
    "saver.close": """
        saver = graphkit.MemorySaver(be)
        with saver.region("t"):
            data = torch.zeros(GIB, dtype=torch.uint8, device="cuda")
        queue(data)
        del data
        saver.close()
    """,
    "saver.pause": """
        saver = graphkit.MemorySaver(be)
        with saver.region("t", backup=True):
            data = torch.zeros(GIB // 4, dtype=torch.int32, device="cuda")
        queue(data)
        saver.pause("t")
        saver.resume("t")
        assert int(data[0]) == PASSES and int(data[-1]) == PASSES, "the backup missed queued writes"
        del data
        saver.close()
    """,
    "elastic.shrink": """
        buf = graphkit.ElasticBuffer(be, max_bytes=2 * GIB)
        buf.resize(GIB)
        view = buf.view(torch.uint8, (GIB,))
        queue(view)
        del view
        buf.resize(0)
        buf.close()
    """,
    "elastic.close": """
        buf = graphkit.ElasticBuffer(be, max_bytes=2 * GIB)
        buf.resize(GIB)
        view = buf.view(torch.uint8, (GIB,))
        queue(view)
        del view
        buf.close()
    """,
    "elastic.pause": """
        saver = graphkit.MemorySaver(be)
        buf = graphkit.ElasticBuffer(be, max_bytes=2 * GIB, saver=saver, tag="kv", backup=True)
        buf.resize(GIB)
        view = buf.view(torch.int32, (GIB // 4,))
        view.zero_()
        queue(view)
        saver.pause("kv")
        saver.resume("kv")
        assert int(view[0]) == PASSES and int(view[-1]) == PASSES, "the backup missed queued writes"
        del view
        buf.close()
        saver.close()
    """,
    "reservation.close": """
        res = graphkit.ElasticReservation(be, reserve_bytes=2 * GIB)
        buf = res.buffer(GIB)
        buf.resize(GIB)
        view = buf.view(torch.uint8, (GIB,))
        queue(view)
        del view, buf
        gc.collect()
        res.close()
    """,
    "pools.release": """
        pools = graphkit.GraphPools(be)
        x = torch.zeros(GIB // 4, dtype=torch.int32, device="cuda")
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            y = x + 1; y.mul_(2); del y       # warm-up, as engines do
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=pools.pool(8)):
            y = x + 1
            for _ in range(4):
                y.mul_(2)                     # graph memory written by every replay
            x.copy_(y)
        del y
        for _ in range(PASSES):
            g.replay()
        g.reset()                             # the graph goes; its queued replays still run
        pools.release(8)
        pools.close()
    """,
    "pools.close": """
        pools = graphkit.GraphPools(be)
        x = torch.zeros(GIB // 4, dtype=torch.int32, device="cuda")
        g = torch.cuda.CUDAGraph()
        y = x + 1; del y
        with torch.cuda.graph(g, pool=pools.pool(8)):
            y = x + 1
            for _ in range(4):
                y.mul_(2)
            x.copy_(y)
        del y
        for _ in range(PASSES):
            g.replay()
        del g
        pools.close()
    """,
    "runner.close": """
        W = torch.full((4096, 4096), 1e-4, device="cuda")
        def step(x):
            for _ in range(8):
                x = torch.relu(x @ W)
            return x
        runner = graphkit.GraphRunner(step, sizes=[1024, 2048, 4096], backend=be, kind="vmm")
        runner.capture(x=torch.zeros(4096, 4096, device="cuda"))
        x = torch.randn(4096, 4096, device="cuda")
        for _ in range(PASSES):
            runner(x=x)
        runner.close()
    """,
    "graph_memory.exit": """
        x = torch.zeros(GIB // 4, dtype=torch.int32, device="cuda")
        y = x + 1; del y
        graphs = []
        with graphkit.graph_memory(be):
            for n in (1, 2):
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    y = x + n
                    for _ in range(4):
                        y.mul_(2)
                    x.copy_(y)
                del y
                graphs.append(g)
            for _ in range(PASSES):
                graphs[0].replay(); graphs[1].replay()
            graphs.clear()   # each space goes with its graph, under the queued replays
    """,
}


@pytest.mark.parametrize("path", sorted(PATHS))
def test_the_path_waits_for_queued_kernels(path: str) -> None:
    code = PRELUDE + textwrap.dedent(PATHS[path]) + "\ntorch.cuda.synchronize()\nprint('ok')\n"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    tail = "\n".join((p.stdout + p.stderr).strip().splitlines()[-8:])
    assert p.returncode == 0 and p.stdout.strip().endswith("ok"), f"{path}: the child died or failed:\n{tail}"


def test_c01_reproducer_passes() -> None:
    """The reproducer of the defect: MemorySaver.close() right after queued kernels."""
    repro = ROOT.parent / "shared" / "repro" / "c01_close_unmaps_under_inflight_kernels.py"
    if not repro.exists():
        pytest.skip(f"{repro} is not beside this checkout")
    p = subprocess.run([sys.executable, str(repro)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 0, p.stdout + p.stderr
