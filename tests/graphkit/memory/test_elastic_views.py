"""Which views of an elastic buffer are alive (``graphkit.memory.elastic_views``): a slice that outlives its view
still stops a shrink and a close, a whole-range view does not stop a shrink, and views made and dropped in a loop
do not pile up."""

from __future__ import annotations

import gc

import pytest
import torch

import graphkit
import hal
from tests.conftest import G


def test_a_surviving_slice_of_a_view_still_stops_a_shrink(be: hal.Backend) -> None:
    buf = graphkit.ElasticBuffer(be, max_bytes=16 * G, chunk_bytes=G)
    buf.resize(8 * G)
    tail = buf.view(torch.uint8, (8 * G,))[6 * G:]  # the view itself is dropped at once
    gc.collect()
    with pytest.raises(hal.InvalidStateError, match="live view"):
        buf.resize(2 * G)
    with pytest.raises(hal.InvalidStateError, match="alive"):
        buf.close()
    del tail
    buf.resize(2 * G)
    assert be.live.chunks == 2  # a standalone buffer gives what it unmaps back at once
    whole = buf.view(torch.uint8, (16 * G,), whole_range=True)
    buf.resize(G)  # a whole-range view reads only what is mapped: it does not stop a shrink
    del whole
    buf.close()
    assert be.live.zero


def test_views_made_in_a_loop_do_not_pile_up(be: hal.Backend) -> None:
    kv = graphkit.ElasticBuffer(be, max_bytes=64 * G)
    kv.resize(G)
    keep = kv.view(torch.float32, (4,))
    for _ in range(5000):
        v = kv.view(torch.float32, (16, 64))
        del v
    assert len(kv._views) <= 128  # dead entries are dropped as views are made
    with pytest.raises(hal.InvalidStateError, match="live view"):
        kv.resize(0)  # the live one is still known
    del keep
    kv.close()
