"""graphkit.memory.sharing.ImportedSpaces: a process captures into spaces over chunks another process exported.

The peer backend here stands for the other process (a fake chunk is a memfd: the
import maps the very same pages); examples/turns runs it in two real processes.
"""

from __future__ import annotations

import ctypes
import socket
from typing import Any

import pytest
import torch

import graphkit
import hal
from graphkit.memory.sharing import ImportedSpaces, export_handles, receive_spaces, send_range
from tests.conftest import G


@pytest.fixture
def peer() -> Any:
    backend = hal.get_backend("fake", granularity=G)
    yield backend
    backend.close()
    assert backend.live.zero


@pytest.fixture
def exported(be: hal.Backend) -> Any:
    """Two chunks of an allocator, the first space's start written with 7.0s, exported whole."""
    alloc = graphkit.SharedVMMAllocator(be, reserve_bytes=8 * G)
    alloc.switch_to_new_virtual_space()
    ptr = alloc.allocate(2 * G)
    seen = torch.frombuffer((ctypes.c_char * 64).from_address(ptr), dtype=torch.float32)
    seen.fill_(7.0)
    with export_handles(be, alloc.chunks, G, 0, 2 * G) as out:
        out.seen = seen  # type: ignore[attr-defined]  # the exporter's view of its first 16 floats
        yield out
    del seen, out.seen  # type: ignore[attr-defined]
    alloc.deallocate(ptr)
    alloc.close()


def capture(peer: hal.Backend, pool: Any, fn: Any) -> tuple[Any, torch.Tensor]:
    graph = peer.create_graph()
    with torch.no_grad(), peer.capture(graph, pool=pool):
        out = fn()
    return graph, out


def test_graphs_of_every_key_use_the_exporters_bytes_and_the_importer_creates_none(exported: Any,
                                                                                   peer: hal.Backend) -> None:
    used = peer.mem_info().used
    spaces = ImportedSpaces(peer, exported.fds, G)
    x = torch.ones(16)
    assert torch.equal(exported.seen, torch.full((16,), 7.0))
    first, y_first = capture(peer, spaces.pool("a"), lambda: x * 3)  # fake runs a capture once
    assert torch.equal(exported.seen, torch.full((16,), 3.0))  # written into the exporter's chunk
    second, y_second = capture(peer, spaces.pool("b"), lambda: x * 5)
    assert spaces.pool("a") is spaces.pool("a") and spaces.keys == ["a", "b"]
    assert y_first.data_ptr() != y_second.data_ptr()  # two spaces, one offset, the same bytes
    peer.replay(first)
    assert torch.equal(y_second, torch.full((16,), 3.0)) and torch.equal(exported.seen, y_second)
    peer.replay(second)
    assert torch.equal(y_first, torch.full((16,), 5.0)) and torch.equal(exported.seen, y_first)
    assert spaces.used_bytes("a") >= 64 and spaces.used_bytes("missing") == 0
    assert peer.mem_info().used == used and peer.live.chunks == 2  # imported once, mapped in both spaces
    assert peer.live.mappings == 4
    del y_first, y_second
    for graph in (first, second):
        peer.release_graph(graph)
    spaces.close()
    spaces.close()  # idempotent
    assert peer.live.zero
    with pytest.raises(hal.InvalidStateError, match="closed"):
        spaces.pool("a")


def test_a_capture_past_the_imported_chunks_fails_naming_the_fix(exported: Any, peer: hal.Backend) -> None:
    with ImportedSpaces(peer, exported.fds, G) as spaces:
        x = torch.ones(G)  # 4 granules of float32: more than the two chunks
        graph = peer.create_graph()
        with pytest.raises(Exception, match=r"the imported chunks hold 128\.0 KiB") as info:
            with torch.no_grad(), peer.capture(graph, pool=spaces.pool("big")):
                x * 2
        assert isinstance(info.value, (hal.HalError, MemoryError, RuntimeError))
        peer.release_graph(graph)
        small, y = capture(peer, spaces.pool("small"), lambda: x[:16] + 1)  # the spaces stay usable
        peer.replay(small)
        assert torch.equal(y, torch.full((16,), 2.0))
        del y
        peer.release_graph(small)
    assert peer.live.zero


@pytest.mark.parametrize("hook", ["import_phy_mem_handle", "map", "create_vir_ptr"])
def test_a_failed_driver_call_leaves_nothing_behind(exported: Any, peer: hal.Backend, hook: str) -> None:
    if hook == "import_phy_mem_handle":
        peer.faults.fail(hook, nth=2)
        with pytest.raises(hal.DriverError, match="injected"):
            ImportedSpaces(peer, exported.fds, G)
        assert peer.live.zero
        return
    spaces = ImportedSpaces(peer, exported.fds, G)
    peer.faults.fail(hook, nth=2 if hook == "map" else 1)
    with pytest.raises(hal.DriverError, match="injected"):
        spaces.pool("a")
    live = peer.live
    assert (live.ranges, live.mappings, live.pools, live.chunks) == (0, 0, 0, 2)
    spaces.pool("a")  # the retry works
    spaces.close()
    assert peer.live.zero


def test_a_failed_unmap_at_close_is_finished_by_the_next_close(exported: Any, peer: hal.Backend) -> None:
    spaces = ImportedSpaces(peer, exported.fds, G)
    spaces.pool("a")
    peer.faults.fail("unmap")
    with pytest.raises(hal.DriverError, match="injected"):
        spaces.close()
    assert peer.live.chunks == 2  # the handles stay until every space is gone
    spaces.close()
    assert peer.live.zero


def test_layouts_are_checked(exported: Any, peer: hal.Backend) -> None:
    with pytest.raises(hal.InvalidArgumentError, match="need 0 <= offset < chunk_bytes"):
        ImportedSpaces(peer, [], G)
    with pytest.raises(hal.InvalidArgumentError, match="is not an exported chunk"):
        ImportedSpaces(peer, exported.fds, 2 * G)  # the wrong chunk size
    assert peer.live.zero


def test_received_over_a_socket(exported: Any, peer: hal.Backend) -> None:
    left, right = socket.socketpair(socket.AF_UNIX)
    with left, right:
        send_range(left, exported)
        with receive_spaces(right, peer) as spaces:
            assert spaces.size == 2 * G and peer.live.chunks == 2
            x = torch.ones(4)
            graph, y = capture(peer, spaces.pool(1), lambda: x * 2)
            peer.replay(graph)
            assert torch.equal(y, torch.full((4,), 2.0))
            del y
            peer.release_graph(graph)
    assert peer.live.zero


def test_closing_under_a_live_output_says_so(exported: Any, peer: hal.Backend, caplog) -> None:
    spaces = ImportedSpaces(peer, exported.fds, G)
    x = torch.ones(4)
    graph, y = capture(peer, spaces.pool("kept"), lambda: x * 2)
    peer.release_graph(graph)
    spaces.close()
    assert "segment(s) of key 'kept' still hold tensors" in caplog.text
    del y  # never read: its memory is unmapped
    assert peer.live.zero


def test_close_waits_for_the_device_before_it_unmaps(exported: Any, peer: hal.Backend) -> None:
    """A wait that fails leaves everything mapped (queued replays may still use it); the next close finishes."""
    spaces = ImportedSpaces(peer, exported.fds, G)
    spaces.pool("a")
    peer.faults.fail("synchronize")
    with pytest.raises(hal.DriverError, match="injected"):
        spaces.close()
    live = peer.live
    assert (live.mappings, live.ranges, live.pools) == (2, 1, 1)
    spaces.close()
    assert peer.live.zero
