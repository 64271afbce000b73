"""Sharing graphkit memory with another rank on NVIDIA GPUs, and the legacy IPC that refuses it.

* chunks made with ``shareable=True`` carry a POSIX file descriptor handle type,
  export and import again, and alias (one GPU); without it they carry none;
* ``cudaIpcGetMemHandle`` (what vLLM's and SGLang's custom all-reduce call on the
  buffers a graph uses) refuses graphkit memory, and the driver says so in advance
  (``CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE``), while it accepts memory of
  torch's own allocator (one GPU);
* rank 0 captures into graphkit memory and exports the chunks behind a graph's
  output; rank 1 receives the descriptors over a Unix socket, maps them on its
  own device and reads the output, writes into it, and sees the next replay (two GPUs).
  Nothing orders one process's device work after another's but the messages: the
  importer reads only after the exporter said its replay finished (it synchronizes
  before it says so).
"""

from __future__ import annotations

import gc
import os
import socket
import textwrap

import pytest
import torch

import graphkit
import hal
from tests.ranks import explain, rank_env, run_ranks

pytestmark = pytest.mark.cuda


def driver():
    from cuda.bindings import driver as d

    return d


def handle_types(be: hal.Backend, handle: object) -> int:
    """The handle types the driver says a chunk was created with."""
    d = driver()
    native = be.plugin._handles[handle]
    err, prop = d.cuMemGetAllocationPropertiesFromHandle(native)
    assert int(err) == 0, err
    return int(prop.requestedHandleTypes)


def test_exportable_chunks_only_where_asked_and_they_alias_once_imported() -> None:
    d = driver()
    posix_fd = int(d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
    with hal.get_backend("cuda") as plain:
        h = plain.create_phy_mem_handle(plain.granularity)
        assert handle_types(plain, h) == 0 and not plain.supports("memory_sharing")
        with pytest.raises(hal.UnsupportedError, match="shareable=True"):
            plain.export_phy_mem_handle(h)
    with hal.get_backend("cuda", shareable=True) as be:
        g = be.granularity
        assert be.supports("memory_sharing")
        h = be.create_phy_mem_handle(2 * g)
        assert handle_types(be, h) & posix_fd
        fd = be.export_phy_mem_handle(h)
        imported = be.import_phy_mem_handle(fd, 2 * g)
        os.close(fd)
        a, b = be.create_vir_ptr(2 * g), be.create_vir_ptr(2 * g)
        be.map(a, 2 * g, h)
        be.map(b, 2 * g, imported)
        ta, tb = be.tensor_at(a, 2 * g), be.tensor_at(b, 2 * g)
        ta.fill_(42)
        tb[-1] = 7
        torch.cuda.synchronize()
        assert int(tb[0]) == 42 and int(ta[-1]) == 7
        del ta, tb


def legacy_ipc(ptr: int) -> tuple[int, str]:
    """``(CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, what cudaIpcGetMemHandle answers)`` at ``ptr``."""
    from cuda.bindings import runtime

    d = driver()
    err, capable = d.cuPointerGetAttribute(d.CUpointer_attribute.CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE,
                                           ptr)
    assert int(err) == 0, err
    err, _ = runtime.cudaIpcGetMemHandle(ptr)
    runtime.cudaGetLastError()  # a refusal is also the runtime's last error, which torch's next launch check reads
    return int(capable), getattr(err, "name", str(err))


@pytest.mark.parametrize("shareable", [False, True])
def test_legacy_ipc_refuses_graphkit_memory(shareable: bool) -> None:
    """What a custom all-reduce's registration of graph buffers meets: see docs/engines.md, tensor parallelism."""
    be = hal.get_backend("cuda", shareable=shareable)
    x = torch.randn(256, 256, device="cuda")
    torch.tanh(x @ x)
    with graphkit.GraphPools(be) as pools:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pools.pool("step")):
            out = torch.tanh(x @ x)
        capable, answer = legacy_ipc(out.data_ptr())
        assert capable == 0 and answer != "cudaSuccess", (capable, answer)  # cudaErrorInvalidValue, "invalid argument"
        if torch.cuda.get_allocator_backend() == "native" and "expandable_segments:True" not in os.environ.get(
                "PYTORCH_CUDA_ALLOC_CONF", ""):
            own = torch.empty(96 << 20, dtype=torch.uint8, device="cuda")  # a segment of its own: its base
            assert legacy_ipc(own.data_ptr()) == (1, "cudaSuccess")  # torch's own memory: cudaMalloc'd
        graph.reset()
        del graph, out
        gc.collect()
    be.close()


SHARE_SCRIPT = textwrap.dedent('''
    import socket, sys, torch, hal, graphkit
    from graphkit.memory.sharing import receive_range, send_range
    rank = int(sys.argv[1]); sock = socket.socket(fileno=int(sys.argv[2 + rank]))
    torch.cuda.set_device(rank)

    def checksum(t):  # exact: the bits, summed as integers
        return int(t.view(torch.int32).to(torch.int64).sum())

    def receive(n):
        data = b""
        while len(data) < n:
            data += sock.recv(n - len(data)) or sys.exit(f"rank {rank}: the peer went away")
        return data

    if rank == 0:
        be = hal.get_backend("cuda", device=0, shareable=True)
        pools = graphkit.GraphPools(be)
        x, w = torch.randn(1536, 1024, device="cuda"), torch.randn(1024, 1024, device="cuda") / 32
        torch.tanh(x @ w)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pools.pool("step")):
            first = x[:3] * 2                          # so that the output starts inside a chunk
            out = torch.tanh(x @ w) + first.sum()
        graph.replay(); torch.cuda.synchronize()
        with pools.allocator.export(out.data_ptr(), out.nbytes) as exported:
            print("exported", exported.layout(), flush=True)
            assert len(exported.fds) >= 3, exported.layout()  # across chunks
            send_range(sock, exported)
        sock.sendall(str(checksum(out)).encode().ljust(32))
        assert receive(7) == b"written"
        assert (out[0, 0].item(), out[-1, -1].item()) == (123.0, -7.0), "rank 1's writes are not seen"
        x.copy_(torch.randn(1536, 1024, device="cuda")); graph.replay(); torch.cuda.synchronize()
        sock.sendall(str(checksum(out)).encode().ljust(32))
        assert receive(2) == b"ok"
        graph.reset(); del graph, out, first
        pools.close(); be.close()
    else:
        be = hal.get_backend("cuda", device=1)         # importing needs no shareable chunks of its own
        with receive_range(sock, be) as seen:
            t = seen.tensor().view(torch.float32).view(1536, 1024)
            assert t.device == torch.device("cuda", 1), t.device
            expected = int(receive(32))                # rank 0's replay is done once its checksum arrives
            assert checksum(t) == expected, "rank 1 does not read rank 0's output"
            t[0, 0], t[-1, -1] = 123.0, -7.0; torch.cuda.synchronize()
            before = checksum(t)
            sock.sendall(b"written")
            expected = int(receive(32))                # read only after rank 0 says its next replay is done
            seen_now = checksum(t)
            assert seen_now == expected, ("rank 1 does not see rank 0's next replay: "
                                          + ("it reads the bytes from before it" if seen_now == before else
                                             "it reads neither those bytes nor the ones from before it"))
            sock.sendall(b"ok")
            del t
        be.close()
    print(f"rank {rank} ok", flush=True)
''')


@pytest.mark.multi_gpu
def test_a_graph_output_is_read_and_written_by_the_other_rank(tmp_path) -> None:
    script = tmp_path / "share.py"
    script.write_text(SHARE_SCRIPT)
    left, right = socket.socketpair(socket.AF_UNIX)
    with left, right:
        fds = [left.fileno(), right.fileno()]
        results = run_ranks(script, timeout=90, env=rank_env(), args=[str(fd) for fd in fds],
                            pass_fds=[[fds[0]], [fds[1]]])
    assert all(r.ok and f"rank {r.rank} ok" in r.output for r in results), explain(results)
