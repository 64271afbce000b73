"""Sharing graphkit memory with another process: hal's export and import hooks, graphkit.memory.sharing, on fake.

A fake chunk is a memfd, so another process really maps the same bytes: the
peer here is a child process that receives the descriptors over a Unix
socket, as a tensor-parallel rank would.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import socket
from typing import Any

import pytest

import graphkit
import hal
from graphkit.memory.sharing import FDS_PER_MESSAGE, ImportedRange, ImportedSpaces, receive_range, send_range
from hal.backends.fake import FakeBackend
from tests.conftest import G


def open_fds() -> set[int]:
    return {int(name) for name in os.listdir("/proc/self/fd")}


@pytest.fixture
def peer() -> Any:
    """A second fake backend: the other process's view, in this one."""
    backend = hal.get_backend("fake", granularity=G)
    yield backend
    backend.close()
    assert backend.live.zero


# -- the hal contract ------------------------------------------------------------------------------


def test_an_exported_chunk_imported_elsewhere_is_the_same_memory(be: hal.Backend, peer: hal.Backend) -> None:
    free = peer.mem_info().free
    h = be.create_phy_mem_handle(2 * G)
    va = be.create_vir_ptr(2 * G)
    be.map(va, 2 * G, h)
    ctypes.memmove(va + G, b"rank 0", 6)
    fd = be.export_phy_mem_handle(h)
    imported = peer.import_phy_mem_handle(fd, 2 * G)
    os.close(fd)  # the importer holds its own
    assert peer.live.chunks == 1 and peer.mem_info().free == free  # held and counted, not charged to the peer
    pva = peer.create_vir_ptr(2 * G)
    peer.map(pva, 2 * G, imported)
    assert ctypes.string_at(pva + G, 6) == b"rank 0"
    be.unmap(va, 2 * G)
    be.release_phy_mem_handle(h)  # the exporter lets go; the importer's mapping keeps the chunk
    ctypes.memmove(pva, b"rank 1", 6)
    assert ctypes.string_at(pva, 6) == b"rank 1"
    peer.unmap(pva, 2 * G)
    peer.release_phy_mem_handle(imported)
    peer.release_vir_ptr(pva, 2 * G)


class VmmOnly(FakeBackend):
    """fake without the sharing hooks."""

    export_phy_mem_handle = None
    import_phy_mem_handle = None
    capabilities = None


@pytest.mark.parametrize("call", ["export_phy_mem_handle", "import_phy_mem_handle"])
def test_a_backend_without_the_hooks_refuses_naming_the_hook_and_the_capability(call: str) -> None:
    with hal.Backend("vmmonly", VmmOnly(granularity=G)) as be:
        h = be.create_phy_mem_handle(G)
        with pytest.raises(hal.UnsupportedError) as info:
            be.export_phy_mem_handle(h) if call.startswith("export") else be.import_phy_mem_handle(0, G)
        assert info.value.call == call and info.value.backend == "vmmonly"
        assert "it is part of the 'memory_sharing' capability" in str(info.value)
        assert not be.supports("memory_sharing")


def test_imports_are_checked(be: hal.Backend, tmp_path: Any) -> None:
    h = be.create_phy_mem_handle(G)
    fd = be.export_phy_mem_handle(h)
    read, write = os.pipe()
    try:
        with pytest.raises(hal.InvalidArgumentError, match=r"fake.import_phy_mem_handle: fd=.* is not an exported "
                                                           rf"chunk of size={2 * G}"):
            be.import_phy_mem_handle(fd, 2 * G)  # the wrong size
        with pytest.raises(hal.InvalidArgumentError, match="is not an exported chunk"):
            be.import_phy_mem_handle(read, G)  # not a chunk
        with pytest.raises(hal.DriverError, match=r"fake.import_phy_mem_handle: .*\[EBADF = 9\]"):
            be.import_phy_mem_handle(9999, G)  # no descriptor at all
        for bad in (-1, True, "3"):
            with pytest.raises(hal.InvalidArgumentError, match="must be a file descriptor"):
                be.import_phy_mem_handle(bad, G)  # type: ignore[arg-type]
    finally:
        for f in (fd, read, write):
            os.close(f)
    assert be.live.chunks == 1
    be.release_phy_mem_handle(h)
    with pytest.raises(hal.InvalidStateError, match=r"fake.export_phy_mem_handle: handle=.* is not live"):
        be.export_phy_mem_handle(h)


def test_close_releases_imported_chunks_and_a_failed_import_holds_nothing(be: hal.Backend, peer: hal.Backend) -> None:
    h = be.create_phy_mem_handle(G)
    fd = be.export_phy_mem_handle(h)
    peer.faults.fail("import_phy_mem_handle")
    with pytest.raises(hal.DriverError, match="injected"):
        peer.import_phy_mem_handle(fd, G)
    assert peer.live.zero
    peer.import_phy_mem_handle(fd, G)
    os.close(fd)
    before = open_fds()
    peer.close()
    assert peer.live.zero and len(before - open_fds()) == 1  # its descriptor of the chunk is closed


# -- graphkit: the chunks behind a range ------------------------------------------------------------


@pytest.fixture
def alloc(be: hal.Backend) -> Any:
    allocator = graphkit.SharedVMMAllocator(be, reserve_bytes=16 * G)
    yield allocator
    allocator.close()


def test_a_range_across_chunks_is_exported_with_its_offset(alloc: graphkit.SharedVMMAllocator,
                                                          peer: hal.Backend) -> None:
    alloc.switch_to_new_virtual_space()
    alloc.allocate(G + 1000)
    ptr = alloc.allocate(2 * G)  # starts inside chunk 1, ends inside chunk 3
    ctypes.memmove(ptr, b"first", 5)
    ctypes.memmove(ptr + 2 * G - 4, b"last", 4)
    with alloc.export(ptr, 2 * G) as exported:
        assert exported.layout() == {"chunks": 3, "chunk_bytes": G, "offset": ptr - alloc.spaces[1].base - G,
                                     "nbytes": 2 * G}
        with ImportedRange(peer, exported.fds, G, exported.offset, exported.nbytes) as seen:
            assert ctypes.string_at(seen.ptr, 5) == b"first" and ctypes.string_at(seen.ptr + 2 * G - 4, 4) == b"last"
            assert bytes(seen.tensor()[:5].tolist()) == b"first"
            assert peer.live.chunks == 3 and peer.live.mappings == 3
        assert peer.live.zero
    with pytest.raises(hal.InvalidStateError, match="closed"):
        seen.tensor()


def test_every_space_shares_what_was_exported(alloc: graphkit.SharedVMMAllocator, peer: hal.Backend) -> None:
    """The peer maps chunks, not addresses: what a graph of another space writes there, it sees."""
    alloc.switch_to_new_virtual_space()
    first = alloc.allocate(G)
    with alloc.export(first, G) as exported, ImportedRange(peer, exported.fds, G, 0, G) as seen:
        alloc.switch_to_new_virtual_space()
        second = alloc.allocate(G)
        assert second != first
        ctypes.memmove(second, b"space 2", 7)
        assert ctypes.string_at(seen.ptr, 7) == b"space 2"


def test_what_cannot_be_exported_is_refused(alloc: graphkit.SharedVMMAllocator, be: hal.Backend) -> None:
    alloc.switch_to_new_virtual_space()
    ptr = alloc.allocate(G // 2)
    cases = [(ptr, 0, "nbytes > 0"), (ptr, G + 1, r"granule\(s\) \[1\] of space 1, which are not mapped"),
             (ptr - G, G, "is in no live space"), ("ptr", G, "need an int address"),
             (ptr, alloc.spaces[1].size + 1, "runs past the end of space 1")]  # refused before any per-granule work
    for p, n, match in cases:
        with pytest.raises(hal.InvalidArgumentError, match=match):
            alloc.export(p, n)  # type: ignore[arg-type]
    be.faults.fail("export_phy_mem_handle", nth=2)
    alloc.allocate(G)
    before = open_fds()
    with pytest.raises(hal.DriverError, match="injected"):
        alloc.export(ptr, 2 * G)
    assert open_fds() == before  # the first chunk's descriptor was closed again
    alloc.release_physical()
    with pytest.raises(hal.InvalidStateError, match="export"):
        alloc.export(ptr, G)  # asleep: there are no chunks to export


def test_a_failed_import_leaves_nothing_mapped(alloc: graphkit.SharedVMMAllocator, peer: hal.Backend) -> None:
    alloc.switch_to_new_virtual_space()
    ptr = alloc.allocate(3 * G)
    with alloc.export(ptr, 3 * G) as exported:
        for hook in ("import_phy_mem_handle", "map"):
            peer.faults.fail(hook, nth=2)
            with pytest.raises(hal.DriverError, match="injected"):
                ImportedRange(peer, exported.fds, G, 0, 3 * G)
            assert peer.live.zero
        for fds, offset, nbytes in (([], 0, G), (exported.fds, G, G), (exported.fds, 0, 3 * G + 1)):
            with pytest.raises(hal.InvalidArgumentError, match="need 0 <= offset < chunk_bytes"):
                ImportedRange(peer, fds, G, offset, nbytes)
        with pytest.raises(hal.InvalidArgumentError, match=r"backend='fake' must be a hal.Backend"):
            ImportedRange("fake", exported.fds, G, 0, G)  # type: ignore[arg-type]
        with pytest.raises(hal.InvalidArgumentError, match=r"ImportedSpaces: backend='fake' must be a hal.Backend"):
            ImportedSpaces("fake", exported.fds, G)  # type: ignore[arg-type]
        for fds in (None, 5, "fds", [-1], [1.5]):
            for make in (lambda fds: ImportedRange(peer, fds, G, 0, G), lambda fds: ImportedSpaces(peer, fds, G)):
                with pytest.raises(hal.InvalidArgumentError, match=r"fds=.* must be a sequence of file descriptors"):
                    make(fds)
        with pytest.raises(hal.InvalidArgumentError, match="ImportedSpaces: chunk_bytes='G'"):
            ImportedSpaces(peer, exported.fds, "G")  # type: ignore[arg-type]
        assert peer.live.zero


def test_more_chunks_than_one_message_carries(be: hal.Backend, peer: hal.Backend) -> None:
    handles = [be.create_phy_mem_handle(G) for _ in range(FDS_PER_MESSAGE + 7)]
    exported = graphkit.memory.sharing.export_handles(be, handles, G, 0, len(handles) * G)
    left, right = socket.socketpair(socket.AF_UNIX)
    before = open_fds()
    with left, right, exported:
        send_range(left, exported)
        with receive_range(right, peer) as seen:
            assert seen.nbytes == len(handles) * G and peer.live.chunks == len(handles)
            assert len(open_fds() - before) == len(handles)  # the peer's own, none of the received ones
        assert open_fds() == before
        left.sendall(b"\x00\x00\x00\x02{}")
        with pytest.raises(hal.InvalidArgumentError, match="not the layout of an exported range"):
            receive_range(right, peer)
    for handle in handles:
        be.release_phy_mem_handle(handle)


def peer_process(sock: socket.socket) -> None:
    """The other rank: map what rank 0 sends, report what it reads, write into it."""
    try:
        with hal.get_backend("fake", granularity=G) as be, receive_range(sock, be) as seen:
            head, tail = ctypes.string_at(seen.ptr, 7), ctypes.string_at(seen.ptr + seen.nbytes - 4, 4)
            ctypes.memmove(seen.ptr + 8, b"from the peer", 13)
            sock.sendall(head + tail)
            sock.recv(1)  # until rank 0 has read what was written
    except BaseException as exc:  # noqa: BLE001 - reported to the test through the socket and the exit code
        sock.sendall(repr(exc).encode()[:200].ljust(11))
        os._exit(1)
    os._exit(0)


def test_another_process_reads_and_writes_an_exported_range(alloc: graphkit.SharedVMMAllocator) -> None:
    """A forked process (imports nothing new, so it starts at once) gets only the descriptors sent to it."""
    alloc.switch_to_new_virtual_space()
    alloc.allocate(100)
    ptr = alloc.allocate(2 * G)
    ctypes.memmove(ptr, b"rank 0!", 7)
    ctypes.memmove(ptr + 2 * G - 4, b"tail", 4)
    left, right = socket.socketpair(socket.AF_UNIX)
    with left, right:
        child = multiprocessing.get_context("fork").Process(target=peer_process, args=(right,))
        child.start()
        try:
            with alloc.export(ptr, 2 * G) as exported:
                send_range(left, exported)
            left.settimeout(60)
            assert left.recv(11) == b"rank 0!tail"
            assert ctypes.string_at(ptr + 8, 13) == b"from the peer"
            left.sendall(b".")
            child.join(60)
        finally:
            child.kill()
    assert child.exitcode == 0
