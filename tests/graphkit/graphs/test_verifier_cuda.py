"""The verifier on CUDA: a kernel's by-value scalar equal to another key's live address is a suspect the replays
dismiss; a kernel that reads that memory through a pointer argument is confirmed and refused."""

from __future__ import annotations

import pytest
import torch

import graphkit
import hal

pytestmark = pytest.mark.cuda


def test_a_scalar_argument_equal_to_another_keys_address_is_dismissed_and_a_real_read_is_refused() -> None:
    be = hal.get_backend("cuda")
    n = 1 << 12
    x = torch.randn(n, device="cuda")
    ids = torch.zeros(n, dtype=torch.int64, device="cuda")
    (x * 2 + 1, ids + (1 << 40), x + x)  # the kernels' first runs outside any capture
    torch.cuda.synchronize()
    with graphkit.graph_memory(be, verify=True, outputs="replay") as pools:
        producer = torch.cuda.CUDAGraph()
        with torch.cuda.graph(producer):
            kept = x * 2 + 1  # key 1's output, replay-scoped: on the shared chunks
        planted = torch.cuda.CUDAGraph()
        with torch.cuda.graph(planted):
            carried = ids + kept.data_ptr()  # the address rides in the kernel's by-value scalar, never read
        stats = pools.verify_stats
        assert stats.suspects >= 1 and stats.dismissed == stats.suspects and stats.confirmed == 0
        planted.replay()
        torch.cuda.synchronize()
        assert torch.equal(carried, ids + kept.data_ptr())
        reading = torch.cuda.CUDAGraph()
        with pytest.raises(graphkit.IsolationError, match="confirmed by a replay"), torch.cuda.graph(reading):
            kept + x  # reads key 1's output through a pointer argument
        assert stats.confirmed >= 1 and stats.confirm_seconds > 0
        del carried, kept
