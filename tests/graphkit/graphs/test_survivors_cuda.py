"""Isolation by construction on CUDA: a graph reads another key's kept output through an address it loads from
device memory, where no scan of kernel arguments can see it, and replays right under the scope."""

from __future__ import annotations

import pytest
import torch

import graphkit
import hal

pytestmark = pytest.mark.cuda

triton = pytest.importorskip("triton", reason="the pointer-chasing kernel is written in Triton")
tl = pytest.importorskip("triton.language")


@triton.jit
def _double_through_pointer(ptrs, out, n, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
    """out = 2 * (the float32 tensor whose address is the int64 held at ``ptrs``)."""
    src = tl.load(ptrs).to(tl.pointer_type(tl.float32))
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(out + offsets, tl.load(src + offsets, mask=mask) * 2, mask=mask)


def _double_at(ptrs: torch.Tensor, n: int) -> torch.Tensor:
    out = torch.empty(n, device="cuda")
    _double_through_pointer[(triton.cdiv(n, 1024),)](ptrs, out, n, BLOCK=1024)
    return out


@pytest.mark.parametrize("outputs", ["kept", "replay"])
def test_a_graph_that_loads_another_keys_output_address_from_device_memory_replays_right(outputs: str) -> None:
    be = hal.get_backend("cuda")
    n = 1 << 16
    x = torch.zeros(n, device="cuda")
    ptrs = torch.zeros(1, dtype=torch.int64, device="cuda")  # made outside graphkit: the pointer lives here
    torch.cuda.synchronize()
    _double_at(ptrs.copy_(torch.tensor([x.data_ptr()])), n)  # compile and warm up outside any capture
    torch.cuda.synchronize()
    with graphkit.graph_memory(be, outputs=outputs) as pools:
        producer, consumer = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.cuda.graph(producer):
            kept = torch.sin(x) + 1  # key 1's output, kept by the engine
        ptrs.fill_(kept.data_ptr())  # the consumer finds it only through device memory
        with torch.cuda.graph(consumer):
            scratch = torch.full((4 * n,), 7.0, device="cuda")  # key 2's own memory: the shared chunks at offset 0
            result = _double_at(ptrs, n) + scratch[:n] * 0
        del scratch
        wrong = 0
        for _ in range(3):
            x.copy_(torch.randn(n, device="cuda"))
            producer.replay()
            consumer.replay()
            torch.cuda.synchronize()
            wrong += not torch.allclose(result, 2 * (torch.sin(x) + 1), atol=1e-5)
        assert (pools.allocator.survivor_bytes > 0) == (outputs == "kept")
        # kept (default): the output has bytes of its own; declared replay-scoped, the consumer's memory clobbers it
        assert bool(wrong) == (outputs == "replay"), f"{wrong} of 3 replays wrong with outputs={outputs!r}"
        producer.reset()
        consumer.reset()
        del kept, result
    pools.close()
    be.close()
