"""Every rank's graph buffers mapped in every other rank (graphkit.memory.peers), on fake, two processes.

A fake chunk is a memfd: the forked ranks below really map each other's bytes. Each rank runs the same
steps, as the ranks of an engine do; the tokens go between them over a socket pair (the engine's all-gather).
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import socket
import struct
import time
import traceback
from collections.abc import Callable, Iterator

import pytest

import graphkit
import hal
from graphkit.memory.peers import TOKEN_BYTES, PeerMemory, is_token
from tests.conftest import G

N = 3 * G // 2  # a buffer across two granules


def gather(sock: socket.socket, rank: int, data: bytes) -> list[bytes]:
    """The two ranks' ``data``, in rank order (what an engine's all-gather gives)."""
    sock.sendall(struct.pack("!I", len(data)) + data)
    length = struct.unpack("!I", _exactly(sock, 4))[0]
    other = _exactly(sock, length)
    return [data, other] if rank == 0 else [other, data]


def _exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        got = sock.recv(n - len(data))
        if not got:
            raise ConnectionError("the other rank went away")
        data += got
    return data


def text(ptr: int, n: int = 8) -> bytes:
    return ctypes.string_at(ptr, n)


def write(ptr: int, data: bytes) -> None:
    ctypes.memmove(ptr, data, len(data))


def rank_steps(rank: int, sock: socket.socket) -> None:
    """One rank: two keys over the same chunks, a survivor swap, a sleep; every peer address checked."""
    peer = 1 - rank
    sync: Callable[[], None] = lambda: gather(sock, rank, b".") and None  # noqa: E731 - a barrier
    be = hal.get_backend("fake", granularity=G)
    alloc = graphkit.SharedVMMAllocator(be, reserve_bytes=64 * G)
    saver = graphkit.MemorySaver(be)
    saver.adopt(alloc)
    peers = PeerMemory(alloc, timeout=30)
    peers.adopt(saver)
    first = alloc.switch_to_new_virtual_space()
    alloc.allocate(100)
    x1 = alloc.allocate(N)  # key 1's buffer
    alloc.switch_to_new_virtual_space()
    alloc.allocate(100)
    x2 = alloc.allocate(N)  # key 2's, at the same offset of its space: the same chunks
    assert x1 != x2
    write(x1, b"head%d..." % rank)
    write(x1 + N - 8, b"tail%d..." % rank)
    assert text(x2) == b"head%d..." % rank

    # 1. a peer's buffers of both keys: one address, on one mapping of the peer's shared chunks
    token = peers.publish([(x1, N), (x2, N)])
    assert is_token(token) and len(token) == TOKEN_BYTES
    addresses = [peers.resolve(t) for t in gather(sock, rank, token)]
    assert addresses[rank] == [x1, x2]
    there = addresses[peer]
    assert there[0] == there[1] and there[0] not in (x1, x2)
    assert text(there[0]) == b"head%d..." % peer and text(there[0] + N - 8) == b"tail%d..." % peer
    write(there[0] + 16, b"from%d..." % rank)  # in place, both ways
    sync()
    assert text(x2 + 16) == b"from%d..." % peer

    # 2. what a peer maps stays under the buffers: key 1's survivor is held off (its granules stay shared) ...
    alloc.keep_private(first, [(x1, N)])
    write(x1, b"kept%d..." % rank)
    assert text(x2) == b"kept%d..." % rank
    # ... and a third key's survivor on the same granules gets a copy of its own, the shared chunks staying
    third = alloc.switch_to_new_virtual_space()
    alloc.allocate(100)
    x3 = alloc.allocate(N)
    alloc.keep_private(third, [(x3, N)])
    assert text(x3) == b"kept%d..." % rank  # the bytes it showed, copied
    write(x3, b"priv%d..." % rank)
    write(x2, b"shar%d..." % rank)
    assert text(x1) == b"shar%d..." % rank
    tokens = gather(sock, rank, peers.publish([(x3, N), (x2, N)]))
    swapped = [peers.resolve(t) for t in tokens][peer]
    assert swapped[1] == there[1] and swapped[0] != swapped[1]  # a range of its own for the copy
    sync()
    assert text(swapped[0]) == b"priv%d..." % peer and text(swapped[1]) == b"shar%d..." % peer
    assert peers.mapped() == {"peers": 1, "shared": 2, "own": 2}

    # 3. sleep: every imported chunk released with the rank's own; on resume, new chunks at the same addresses.
    # Rank 1 pauses late: rank 0's resume must wait for rank 1's pause and resume, not map the chunks it has now.
    sync()
    if rank == 1:
        time.sleep(0.5)
    saver.pause()
    assert peers.paused and be.live.chunks == 0, be.live
    with pytest.raises(hal.InvalidStateError, match="paused"):
        peers.resolve(tokens[peer])
    saver.resume()  # waits for the peer's resume
    write(x3, b"wok1%d..." % rank)
    write(x2, b"wok2%d..." % rank)
    sync()
    assert text(swapped[0]) == b"wok1%d..." % peer and text(swapped[1]) == b"wok2%d..." % peer
    sync()

    peers.close()
    peers.close()
    saver.close()
    alloc.close()
    be.close()
    assert be.live.zero, be.live


def _run_rank(rank: int, sock: socket.socket) -> None:
    try:
        sock.settimeout(60)
        rank_steps(rank, sock)
    except BaseException:  # noqa: BLE001 - reported through stderr and the exit code
        traceback.print_exc()
        os._exit(1)
    os._exit(0)


def test_two_ranks_map_each_others_buffers_through_swaps_and_sleep() -> None:
    ctx = multiprocessing.get_context("fork")
    a, b = socket.socketpair(socket.AF_UNIX)
    ranks = [ctx.Process(target=_run_rank, args=(rank, s)) for rank, s in enumerate((a, b))]
    for p in ranks:
        p.start()
    try:
        for p in ranks:
            p.join(120)
    finally:
        for p in ranks:
            p.kill()
        a.close()
        b.close()
    assert [p.exitcode for p in ranks] == [0, 0]


# -- one process ----------------------------------------------------------------------------------------------


@pytest.fixture
def alloc(be: hal.Backend) -> Iterator[graphkit.SharedVMMAllocator]:
    with graphkit.SharedVMMAllocator(be, reserve_bytes=64 * G) as allocator:
        yield allocator


@pytest.fixture
def peers(alloc: graphkit.SharedVMMAllocator) -> Iterator[PeerMemory]:
    with PeerMemory(alloc, timeout=5) as memory:
        yield memory


def test_a_ranks_own_token_resolves_to_its_own_addresses(alloc: graphkit.SharedVMMAllocator,
                                                        peers: PeerMemory) -> None:
    alloc.switch_to_new_virtual_space()
    ptrs = [alloc.allocate(100), alloc.allocate(2 * G)]
    assert peers.resolve(peers.publish([(ptrs[0], 100), (ptrs[1], 2 * G)])) == ptrs


def test_what_cannot_be_published_or_resolved_is_refused_by_name(alloc: graphkit.SharedVMMAllocator,
                                                                 peers: PeerMemory) -> None:
    alloc.switch_to_new_virtual_space()
    ptr = alloc.allocate(100)
    with pytest.raises(hal.InvalidArgumentError, match="buffers="):
        peers.publish([(ptr, 0)])
    with pytest.raises(hal.InvalidArgumentError, match="no live space"):
        peers.publish([(ptr + (1 << 40), 8)])
    with pytest.raises(hal.InvalidArgumentError, match="token="):
        peers.resolve(b"not a token")
    gone = b"GKPM" + bytes(16) + bytes(4)  # a listener nobody runs
    with pytest.raises(hal.InvalidStateError, match="did not answer") as info:
        peers.resolve(gone)
    assert info.value.backend == "fake"
    with pytest.raises(hal.InvalidArgumentError, match="allocator="):
        PeerMemory(object())  # type: ignore[arg-type]
    with pytest.raises(hal.InvalidArgumentError, match="timeout="):
        PeerMemory(alloc, timeout=0)


def test_close_stops_answering_and_refuses_later_calls(alloc: graphkit.SharedVMMAllocator) -> None:
    alloc.switch_to_new_virtual_space()
    ptr = alloc.allocate(100)
    one, other = PeerMemory(alloc, timeout=2), PeerMemory(alloc, timeout=2)
    token = one.publish([(ptr, 100)])
    assert other.resolve(token)[0] != ptr  # the other maps the chunk again, as a peer would
    one.close()
    with pytest.raises(hal.InvalidStateError, match="did not answer"):
        other.resolve(token)
    with pytest.raises(hal.InvalidStateError, match="closed"):
        one.publish([(ptr, 100)])
    other.close()


def test_a_refused_publish_pins_nothing_and_close_unpins(alloc: graphkit.SharedVMMAllocator) -> None:
    first = alloc.switch_to_new_virtual_space()
    x = alloc.allocate(100)
    alloc.switch_to_new_virtual_space()
    alloc.allocate(100)  # a second space over the same chunk
    peers = PeerMemory(alloc, timeout=2)
    with pytest.raises(hal.InvalidArgumentError, match="no live space"):
        peers.publish([(x, 100), (x + (1 << 40), 8)])
    peers.publish([(x, 100)])
    alloc.keep_private(first, [(x, 100)])
    assert alloc.chunks_behind(x, 100).shared == (True,)  # pinned: the survivor is held off
    peers.close()
    alloc.keep_private(first, [(x, 100)])
    assert alloc.chunks_behind(x, 100).shared == (False,)  # unpinned: the survivor took its granule
