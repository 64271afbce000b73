"""ElasticBuffer chunks on an NVIDIA GPU: a pause and a resume cost a driver call or two per chunk, data exact."""

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


@pytest.mark.parametrize("backup", [False, True])
def test_a_buffer_grown_in_four_steps_sleeps_in_four_chunks_on_the_gpu(be: hal.Backend, backup: bool) -> None:
    """256 MiB in four steps: four chunks; pause and resume make four driver calls of each kind, with kernels
    still queued on the buffer when the pause begins; the bytes (with backup) come back exact."""
    saver = graphkit.MemorySaver(be)
    kv = graphkit.ElasticBuffer(be, max_bytes=256 * MIB, saver=saver, tag="kv", backup=backup)
    for step in range(1, 5):
        kv.resize(64 * MIB * step)
    view = kv.view(torch.int32, (64 * MIB,))
    view.copy_(torch.arange(view.numel(), device="cuda", dtype=torch.int32))
    for _ in range(20):  # queued, not waited for: the pause must wait before it unmaps
        view.add_(1)
    calls = dict(be.accounting.calls)
    saver.pause("kv")
    paused = {h: be.accounting.calls[h] - calls.get(h, 0) for h in ("unmap", "release_phy_mem_handle")}
    assert paused == {"unmap": 4, "release_phy_mem_handle": 4}
    calls = dict(be.accounting.calls)
    saver.resume("kv")
    resumed = {h: be.accounting.calls[h] - calls.get(h, 0) for h in ("create_phy_mem_handle", "map")}
    assert resumed == {"create_phy_mem_handle": 4, "map": 4}
    if backup:
        assert torch.equal(view, torch.arange(view.numel(), device="cuda", dtype=torch.int32) + 20)
    view.fill_(3)
    torch.cuda.synchronize()
    assert int(view[-1]) == 3  # mapped and writable again
    del view
    kv.close()
    saver.close()
