"""The host copy that memory made with ``backup=True`` keeps while it sleeps (``graphkit.memory.host_backup``):
made on a thread of its own as an elastic buffer grows, in a few pieces, before any pause, so that a pause only
copies."""

from __future__ import annotations

import torch

import graphkit
import hal
from tests.conftest import G


def test_a_backed_up_buffer_makes_its_host_copy_as_it_grows_and_a_pause_only_copies(be: hal.Backend,
                                                                                   monkeypatch) -> None:
    """ElasticBuffer(backup=True) makes its host buffers on a thread of its own after growth, before any pause;
    the first pause makes none (no host memory on the pause path), growth by granules adds few pieces, and the
    bytes come back bit-exact across pieces."""
    saver = graphkit.MemorySaver(be)
    kv = graphkit.ElasticBuffer(be, max_bytes=64 * G, saver=saver, tag="kv", backup=True)
    for granules in range(1, 41):
        kv.resize(granules * G)
    kv._backup.wait()
    assert kv.host_bytes >= kv.footprint_bytes == 40 * G  # before any pause
    assert len(kv._backup.pieces) <= 12  # a few pieces, not one per granule
    report = next(r for r in saver.report() if r.tag == "kv")
    assert report.host_bytes == kv.host_bytes and report.pin_s > 0
    data = torch.randint(0, 1 << 30, (40 * G // 8,))
    kv.view(torch.int64, (data.numel(),)).copy_(data)
    made: list[int] = []
    real_empty = torch.empty

    def watched(*args, **kwargs):  # host buffers made from here on
        made.append(1)
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", watched)
    saver.pause("kv")
    monkeypatch.setattr(torch, "empty", real_empty)
    assert not made and kv.paused
    saver.resume("kv")
    assert torch.equal(kv.view(torch.int64, (data.numel(),)), data)
    kv.close()
    saver.close()
    assert be.live.zero, be.live
