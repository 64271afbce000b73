"""Every rank's graph buffers mapped in every other rank, through POSIX file descriptors.

A custom all-reduce that reads graph buffers in place (vLLM's, and FlashInfer's and SGLang's ports of it) needs,
for each buffer a graph hands it, the address *in this process* of the same buffer on every rank. Engines get
them with the runtime's legacy IPC (``cudaIpcGetMemHandle``), which the driver refuses on memory mapped through
its virtual memory API: all of graphkit's. :class:`PeerMemory` gets them from the chunks instead:

1. :meth:`PeerMemory.publish` (each rank, its own buffers) notes which chunk lies under each granule of each
   buffer -- the shared chunk of that index, which every space of the allocator maps at the same offset, or a
   chunk of the space's own (memory that outlived its capture) -- and returns a short token.
2. The tokens reach every rank by whatever the engine uses (its process group; the registration of FlashInfer's
   and vLLM's kernels all-gathers "IPC handles", which :mod:`graphkit.graphs.allreduce` fills with them).
3. :meth:`PeerMemory.resolve` (each rank, each peer's token) asks the peer's listener -- an abstract Unix socket
   served by a thread of the peer's process -- for the noted chunks it does not map yet, receives them as file
   descriptors, imports and maps them. A peer's shared chunks are mapped side by side, each once, in one range per
   peer (chunk ``i`` at ``mirror + i * granule``): a buffer on them is at ``mirror + its offset in its space``,
   whichever key captured it. A buffer that touches chunks of a space's own gets a range of its own.

What each path waits for. A token resolved again after a chunk under it changed (a survivor swap) maps the new
chunk where the old one was, after the device's queued work. Adopted by a :class:`~graphkit.MemorySaver`
(:meth:`PeerMemory.adopt`, after the allocator), ``pause()`` waits for the queued work, then unmaps and
releases every chunk imported from the peers, and ``resume()`` asks every peer for its new chunks -- waiting,
up to ``timeout``, until that peer has resumed -- and maps them at the same addresses, so what a kernel was told
stays true. Sleep is collective: a rank's graph memory is freed once every rank has paused (each holds the
others' chunks until its own pause), and every rank resumes, as engines do.

Linux only (abstract Unix sockets, ``SCM_RIGHTS``); the ranks must run on one host.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import socket
import struct
import threading
import time
import uuid
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import hal
from graphkit.memory.allocator import ChunksBehind, SharedVMMAllocator
from graphkit.memory.backing import Chunk, wait_for_device
from graphkit.memory.closing import Closable, close_step, raise_first_failure
from graphkit.memory.sharing import FDS_PER_MESSAGE
from hal.transaction import Transaction

log = logging.getLogger(__name__)

#: seconds a request waits for a peer: to answer, and to have resumed its memory
DEFAULT_TIMEOUT = 60.0

#: a token: magic, listener id (16 bytes), set number
_TOKEN = struct.Struct("!4s16sI")
_MAGIC = b"GKPM"
TOKEN_BYTES = _TOKEN.size


def is_token(data: bytes) -> bool:
    """Whether ``data`` starts with a token of :meth:`PeerMemory.publish`."""
    return len(data) >= TOKEN_BYTES and data[:4] == _MAGIC


def _socket_name(listener: bytes) -> str:
    return "\0graphkit-peers-" + listener.hex()


# -- messages: a length-prefixed JSON header, then file descriptors -----------------------------------------------


def _send(sock: socket.socket, message: dict[str, Any], fds: Sequence[int] = ()) -> None:
    header = json.dumps(message).encode()
    sock.sendall(struct.pack("!I", len(header)) + header)
    for start in range(0, len(fds), FDS_PER_MESSAGE):
        socket.send_fds(sock, [b"f"], list(fds[start:start + FDS_PER_MESSAGE]))


def _receive(sock: socket.socket, fds: list[int], count_fds: bool = False) -> dict[str, Any]:
    """One message; descriptors that come with it are appended to ``fds`` (the caller closes them): as many as
    its header's ``"fds"`` says when ``count_fds``."""
    length = struct.unpack("!I", _exactly(sock, 4, fds))[0]
    message = json.loads(_exactly(sock, length, fds))
    if not isinstance(message, dict):
        raise ConnectionError(f"a peer sent {message!r}, not a message")
    while count_fds and len(fds) < int(message.get("fds", 0)):
        _exactly(sock, 1, fds)
    return message


def _exactly(sock: socket.socket, nbytes: int, fds: list[int]) -> bytes:
    data = b""
    while len(data) < nbytes:
        chunk, got, _, _ = socket.recv_fds(sock, nbytes - len(data), FDS_PER_MESSAGE)
        fds.extend(got)
        if not chunk:
            raise ConnectionError(f"the peer closed the connection after {len(data)} of {nbytes} bytes")
        data += chunk
    return data


# -- this rank's side: what it published, served to the peers --------------------------------------------------


@dataclass
class _Buffer:
    """One published buffer: its address here and what lies under it."""

    ptr: int
    nbytes: int
    behind: ChunksBehind


class _Listener:
    """The thread that answers the peers: a published set's layout, and descriptors of the chunks it names."""

    def __init__(self, owner: PeerMemory) -> None:
        self.id = uuid.uuid4().bytes
        self._owner = weakref.ref(owner)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(_socket_name(self.id))
        self._sock.listen(64)
        self._thread = threading.Thread(target=self._serve, name="graphkit-peers", daemon=True)
        self._thread.start()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:  # closed: the thread ends
                return
            threading.Thread(target=self._answer, args=(conn,), name="graphkit-peers-answer", daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        with conn:
            try:
                request = _receive(conn, [])
                owner = self._owner()
                if owner is None:
                    raise hal.InvalidStateError("the peer memory is closed", call="PeerMemory")
                reply, fds = owner.answer(request)
            except Exception as exc:  # noqa: BLE001 - not an undo: any failure goes back to the asking peer
                log.debug("peer request failed: %s", exc)
                with contextlib.suppress(OSError):
                    _send(conn, {"error": f"{type(exc).__name__}: {exc}"})
                return
            try:
                _send(conn, reply, fds)
            except OSError as exc:
                log.debug("a peer went away before its answer: %s", exc)
            finally:
                for fd in fds:
                    os.close(fd)


# -- the peers' side: what this process maps of another rank ----------------------------------------------------


@dataclass
class _Held:
    """One imported chunk, mapped at ``addr`` (``handle`` None: released by a pause, to map again on resume)."""

    chunk: int  # the peer's id of the chunk
    addr: int
    handle: Any = None


@dataclass
class _Peer:
    """What this process maps of one peer: its shared chunks in one range, and ranges of their own."""

    listener: bytes
    granularity: int = 0
    pauses: int = -1  # the peer's pauses when its chunks mapped here were exported
    mirror: int = 0  # base of the range for the peer's shared chunks (0: not reserved yet)
    mirror_bytes: int = 0
    shared: dict[int, _Held] = field(default_factory=dict)  # granule index -> the chunk mapped there
    runs: dict[tuple[int, ...], tuple[int, list[_Held]]] = field(default_factory=dict)  # chunks -> (base, held)

    def held(self) -> list[_Held]:
        return [*self.shared.values(), *(h for _, run in self.runs.values() for h in run)]


class PeerMemory(Closable):
    """This rank's graph buffers for its peers, and its peers' buffers mapped here (see the module's text).

    :param allocator: the allocator whose memory this rank publishes (``pools.allocator`` of its
        :class:`graphkit.GraphPools`); its backend maps what the peers publish.
    :param timeout: seconds to wait for a peer, to answer and to have resumed.
    """

    def __init__(self, allocator: SharedVMMAllocator, *, timeout: float = DEFAULT_TIMEOUT) -> None:
        if not isinstance(allocator, SharedVMMAllocator):
            raise hal.InvalidArgumentError(f"allocator={allocator!r} must be a graphkit.SharedVMMAllocator "
                                           "(pools.allocator of vmm GraphPools)", call="PeerMemory")
        if not allocator.backend.supports("memory_sharing"):
            raise hal.UnsupportedError(f"backend {allocator.backend.name!r} cannot export chunks to another "
                                       "process (capability 'memory_sharing'): make the pools over a backend whose "
                                       "chunks are shareable (cuda: hal.get_backend('cuda', shareable=True); "
                                       "docs/engines.md says what it changes for NCCL)",
                                       backend=allocator.backend.name, call="PeerMemory")
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not timeout > 0:
            raise hal.InvalidArgumentError(f"timeout={timeout!r} must be a positive number of seconds",
                                           backend=allocator.backend.name, call="PeerMemory")
        self.allocator = allocator
        self.backend = allocator.backend
        self.timeout = float(timeout)
        self._lock = threading.RLock()  # what this process maps of its peers
        self._published = threading.Lock()  # what it published: the listener answers under this lock alone, so
        # that two ranks resolving each other at once never wait on each other
        self._sets: list[list[_Buffer]] = []
        self._ids: weakref.WeakKeyDictionary[Chunk, int] = weakref.WeakKeyDictionary()
        self._chunks: dict[int, weakref.ref[Chunk]] = {}
        self._peers: dict[bytes, _Peer] = {}
        self._paused = False
        self._closed = False
        self._listener = _Listener(self)

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._sets)} set(s), {len(self._peers)} peer(s)"
        return f"<PeerMemory {self.backend.name} {state}>"

    # -- this rank's buffers ------------------------------------------------------------------------------------

    def publish(self, buffers: Sequence[tuple[int, int]]) -> bytes:
        """Note what lies under each ``(ptr, nbytes)`` of this rank's graph memory; return the token the peers
        resolve (:data:`TOKEN_BYTES` long). Call it again after a capture changed what lies there."""
        self._check_open("publish")
        checked = _checked_buffers(buffers, self.backend.name)
        with self._published:
            published: list[_Buffer] = []
            with Transaction() as tx:  # pinned: what the peers will map stays under the buffers while this lives
                for ptr, nbytes in checked:
                    published.append(_Buffer(ptr, nbytes, self.allocator.chunks_behind(ptr, nbytes, pin=True)))
                    tx.append(functools.partial(self.allocator.unpin, published[-1].behind))
                tx.commit()
            for buffer in published:
                for chunk in buffer.behind.chunks:
                    self._id(chunk)
            self._sets.append(published)
            return _TOKEN.pack(_MAGIC, self._listener.id, len(self._sets) - 1)

    def _id(self, chunk: Chunk) -> int:
        number = self._ids.get(chunk)
        if number is None:
            number = self._ids[chunk] = len(self._chunks)
            self._chunks[number] = weakref.ref(chunk)
        return number

    def answer(self, request: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        """A peer's request, answered (the listener's thread calls it): ``{"set": n}``: the layout of a published
        set; ``{"chunks": [ids]}``: descriptors of those chunks as they are now, once this rank's memory is awake."""
        if "set" in request:
            with self._published:
                number = int(request["set"])
                if not 0 <= number < len(self._sets):
                    raise hal.InvalidArgumentError(f"no published set {number}", call="PeerMemory.answer")
                layout = [{"offset": b.behind.offset, "first": b.behind.first,
                           "chunks": [self._id(c) for c in b.behind.chunks], "shared": list(b.behind.shared)}
                          for b in self._sets[number]]
            return {"granularity": self.allocator.granularity, "mirror_bytes": self.allocator.reserve_bytes,
                    "buffers": layout}, []
        deadline = time.monotonic() + float(request.get("timeout", self.timeout))
        after = int(request.get("after", -1))  # the asker mapped chunks of that pause: it wants the ones after it
        while (self.allocator.paused or self.allocator.pauses <= after) and not self.allocator.closed:
            if time.monotonic() >= deadline:  # every rank pauses, then resumes, together
                raise hal.InvalidStateError(
                    f"this rank's graph memory is {'paused' if self.allocator.paused else 'awake'} after "
                    f"{self.allocator.pauses} pause(s); the asking peer waits for a resume after pause {after + 1}: "
                    "pause every rank, then resume every rank", backend=self.backend.name, call="PeerMemory")
            time.sleep(0.005)
        fds: list[int] = []
        with Transaction() as tx:  # the descriptors made so far are closed when one export fails
            for number in request["chunks"]:
                with self._published:
                    ref = self._chunks.get(int(number))
                chunk = ref() if ref is not None else None
                if chunk is None:
                    raise hal.InvalidStateError(f"chunk {number} is gone (its space was released): publish the "
                                                "buffers again", backend=self.backend.name, call="PeerMemory")
                fds.append(self.allocator.export_chunk(chunk))
                tx.append(functools.partial(os.close, fds[-1]))
            tx.commit()
        return {"fds": len(fds), "granularity": self.allocator.granularity, "pauses": self.allocator.pauses}, fds

    # -- the peers' buffers ---------------------------------------------------------------------------------------

    def resolve(self, token: bytes) -> list[int]:
        """The addresses in this process of the buffers a rank published under ``token``, in its order: this
        rank's own as they are; a peer's mapped here (the chunks it noted, imported once each)."""
        self._check_open("resolve")
        if not isinstance(token, (bytes, bytearray)) or not is_token(bytes(token)):
            raise hal.InvalidArgumentError(f"token={token!r} is not a token of PeerMemory.publish()",
                                           backend=self.backend.name, call="resolve")
        _, listener, number = _TOKEN.unpack(bytes(token[:TOKEN_BYTES]))
        if listener == self._listener.id:
            with self._published:
                if number >= len(self._sets):
                    raise hal.InvalidArgumentError(f"no published set {number}", backend=self.backend.name,
                                                   call="resolve")
                return [b.ptr for b in self._sets[number]]
        with self._lock:
            if self._paused:
                raise hal.InvalidStateError("the peer memory is paused: resume it first", backend=self.backend.name,
                                            call="resolve")
            peer = self._peers.setdefault(listener, _Peer(listener))
            layout = self._ask(peer, {"set": number})
            return self._map(peer, layout)

    def _ask(self, peer: _Peer, request: dict[str, Any], fds: list[int] | None = None) -> dict[str, Any]:
        """``request`` sent to ``peer``'s listener, its answer received (descriptors into ``fds``)."""
        request = {**request, "timeout": self.timeout}
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(self.timeout + 5)
            try:
                sock.connect(_socket_name(peer.listener))
                _send(sock, request)
                answer = _receive(sock, fds if fds is not None else [], count_fds=True)
            except OSError as exc:
                raise hal.InvalidStateError(
                    f"peer {peer.listener.hex()[:8]} did not answer ({exc}): its process ended, closed its "
                    f"PeerMemory, or took longer than timeout={self.timeout:g} s (every rank must take part: "
                    "register and resume on every rank together)", backend=self.backend.name,
                    call="PeerMemory") from exc
        if "error" in answer:
            raise hal.InvalidStateError(f"peer {peer.listener.hex()[:8]} refused: {answer['error']}",
                                        backend=self.backend.name, call="PeerMemory")
        return answer

    def _map(self, peer: _Peer, layout: dict[str, Any]) -> list[int]:
        """Map what ``layout``'s buffers need of ``peer`` and return their addresses here."""
        g = int(layout["granularity"])
        if g != self.allocator.granularity:
            raise hal.UnsupportedError(f"the peer's chunks are {g} bytes, this backend's {self.allocator.granularity}:"
                                       " map them on devices of one kind", backend=self.backend.name, call="resolve")
        peer.granularity = g
        wanted: list[tuple[_Held | None, int, Any]] = []  # (held now, chunk id, where: (kind, key, index))
        addresses: list[int] = []
        for buffer in layout["buffers"]:
            chunks, first = [int(c) for c in buffer["chunks"]], int(buffer["first"])
            if all(buffer["shared"]):
                if not peer.mirror:
                    peer.mirror_bytes = int(layout["mirror_bytes"])
                    peer.mirror = self.backend.create_vir_ptr(peer.mirror_bytes)
                for i, chunk in enumerate(chunks, first):
                    held = peer.shared.get(i)
                    if held is None or held.chunk != chunk or held.handle is None:
                        wanted.append((held, chunk, ("shared", i)))
                addresses.append(peer.mirror + int(buffer["offset"]))
            else:
                key = tuple(chunks)
                if key not in peer.runs:
                    peer.runs[key] = (self.backend.create_vir_ptr(len(key) * g), [])
                base, run = peer.runs[key]
                wanted.extend((None, chunk, ("run", key, k)) for k, chunk in enumerate(key) if k >= len(run))
                addresses.append(base + int(buffer["offset"]) - first * g)
        self._fetch(peer, wanted)
        return addresses

    def _fetch(self, peer: _Peer, wanted: list[tuple[_Held | None, int, Any]]) -> None:
        """Import the chunks ``wanted`` names from ``peer`` and map each where it goes; a chunk mapped there
        before is unmapped first, after the device's queued work."""
        wanted = list({w[2]: w for w in wanted}.values())
        if not wanted:
            return
        g = peer.granularity
        stale = [held for held, _, _ in wanted if held is not None and held.handle is not None]
        if stale:
            wait_for_device(self.backend)  # a kernel queued here may still read the old chunk
            for held in stale:
                self._drop(held)
        fds: list[int] = []
        try:
            answer = self._ask(peer, {"chunks": [chunk for _, chunk, _ in wanted]}, fds)
            peer.pauses = max(peer.pauses, int(answer["pauses"]))
            with Transaction() as tx:
                for (_, chunk, where), fd in zip(wanted, fds, strict=True):
                    if where[0] == "shared":
                        held = _Held(chunk, peer.mirror + where[1] * g)
                    else:
                        held = _Held(chunk, peer.runs[where[1]][0] + where[2] * g)
                    self._attach(held, fd, g, tx)
                    place = peer.shared if where[0] == "shared" else peer.runs[where[1]][1]
                    _put(place, where[1] if where[0] == "shared" else len(place), held, tx)
                tx.commit()
        finally:
            for fd in fds:
                os.close(fd)

    def _attach(self, held: _Held, fd: int, g: int, tx: Transaction) -> None:
        """Import ``fd`` and map it at ``held.addr``; undone by ``tx``."""
        handle = self.backend.import_phy_mem_handle(fd, g)
        tx.append(functools.partial(self.backend.release_phy_mem_handle, handle))
        self.backend.map(held.addr, g, handle)
        tx.append(functools.partial(self.backend.unmap, held.addr, g))
        held.handle = handle
        tx.append(functools.partial(setattr, held, "handle", None))

    def _drop(self, held: _Held) -> None:
        """Unmap and release one imported chunk (the caller waited for the device)."""
        g = self.allocator.granularity
        self.backend.unmap(held.addr, g)
        handle, held.handle = held.handle, None
        self.backend.release_phy_mem_handle(handle)

    def mapped(self) -> dict[str, int]:
        """What this process maps of its peers: ``peers``, ``shared`` (chunks in the peers' shared ranges, each
        once), ``own`` (chunks of a space's own, in ranges of their own)."""
        with self._lock:
            return {"peers": len(self._peers), "shared": sum(len(p.shared) for p in self._peers.values()),
                    "own": sum(len(run) for p in self._peers.values() for _, run in p.runs.values())}

    # -- sleep (a member of a MemorySaver tag) -----------------------------------------------------------------

    def adopt(self, saver: Any, tag: str | None = None) -> None:
        """Make ``saver``'s ``tag`` (default: graphs) pause and resume what this process maps of its peers with
        the rest of its memory; adopt it after the allocator, so that a resume maps the peers' chunks last."""
        if tag is None:
            saver.adopt(self)
        else:
            saver.adopt(self, tag)

    backup = False  # nothing to copy: the bytes are the peers'

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def footprint_bytes(self) -> int:
        """0: the peers' chunks are theirs (this process holds them, the peers' devices count them)."""
        return 0

    def release_physical(self, *, keep_backup: bool = False) -> int:
        """Unmap and release every chunk imported from the peers, after the device's queued work; the ranges stay
        reserved. Returns 0 (the bytes are the peers')."""
        with self._lock:
            self._check_open("release_physical")
            held = [h for peer in self._peers.values() for h in peer.held() if h.handle is not None]
            if held:
                wait_for_device(self.backend)
            for h in held:
                self._drop(h)
            self._paused = True
            return 0

    def restore_physical(self, restore: bool = True) -> None:
        """Ask every peer for its chunks again (each answers once its memory is resumed) and map them at the same
        addresses. All or nothing per peer; a failure leaves this paused, to resume again."""
        with self._lock:
            self._check_open("restore_physical")
            for peer in self._peers.values():
                wanted = [h for h in peer.held() if h.handle is None]
                if not wanted:
                    continue
                fds: list[int] = []
                try:  # the peer's chunks of after its own pause: it answers once it paused and resumed
                    answer = self._ask(peer, {"chunks": [h.chunk for h in wanted], "after": peer.pauses}, fds)
                    peer.pauses = int(answer["pauses"])
                    with Transaction() as tx:
                        for h, fd in zip(wanted, fds, strict=True):
                            self._attach(h, fd, peer.granularity, tx)
                        tx.commit()
                finally:
                    for fd in fds:
                        os.close(fd)
            self._paused = False

    # -- close ----------------------------------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self, call: str) -> None:
        if self._closed:
            raise hal.InvalidStateError("the peer memory is closed", backend=self.backend.name, call=call)

    def close(self) -> None:
        """Stop answering the peers; unmap and release every imported chunk (after the device's queued work) and
        free the ranges. Goes on past failures; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._listener.close()
            errors: list[BaseException] = []
            if self.backend.closed:  # its close released every mapping, range and chunk
                self._peers.clear()
            elif any(h.handle is not None for p in self._peers.values() for h in p.held()):
                close_step(errors, wait_for_device, self.backend)
            g = self.allocator.granularity
            for key, peer in list(self._peers.items()):
                for h in peer.held():
                    if h.handle is not None:
                        close_step(errors, self._drop, h)
                if any(h.handle is not None for h in peer.held()):
                    continue
                if peer.mirror and close_step(errors, self.backend.release_vir_ptr, peer.mirror, peer.mirror_bytes):
                    peer.mirror = 0
                for run_key, (base, _) in list(peer.runs.items()):
                    if close_step(errors, self.backend.release_vir_ptr, base, len(run_key) * g):
                        del peer.runs[run_key]
                if not peer.mirror and not peer.runs:
                    del self._peers[key]
            with self._published:
                for buffer in (b for published in self._sets for b in published):
                    close_step(errors, self.allocator.unpin, buffer.behind)
                self._sets.clear()
            raise_first_failure(log, errors, "PeerMemory.close")
            self._closed = True


def _put(place: dict[int, _Held] | list[_Held], key: int, held: _Held, tx: Transaction) -> None:
    """``held`` recorded at ``key`` of ``place`` (a peer's shared chunks, or a run's list); undone by ``tx``."""
    if isinstance(place, dict):
        place[key] = held
        tx.append(functools.partial(place.pop, key, None))  # type: ignore[arg-type]
    else:
        place.append(held)
        tx.append(functools.partial(place.pop, -1))  # type: ignore[arg-type]


def _checked_buffers(buffers: object, backend: str) -> list[tuple[int, int]]:
    """``publish()``'s argument: a sequence of ``(ptr, nbytes)`` pairs of ints, ``nbytes > 0``."""
    ok = isinstance(buffers, Sequence) and not isinstance(buffers, (str, bytes)) and all(
        isinstance(b, Sequence) and len(b) == 2 and all(isinstance(v, int) and not isinstance(v, bool) for v in b)
        and b[1] > 0 for b in buffers)
    if not ok:
        raise hal.InvalidArgumentError(f"buffers={buffers!r} must be a sequence of (ptr, nbytes) pairs of ints, "
                                       "nbytes > 0", backend=backend, call="publish")
    return [(int(p), int(n)) for p, n in buffers]  # type: ignore[attr-defined]


__all__ = ["DEFAULT_TIMEOUT", "TOKEN_BYTES", "PeerMemory", "is_token"]
