"""graphkit memory seen by another process: export the chunks behind an address range, map them in a peer.

A peer that reads or writes one rank's buffers directly (a custom all-reduce,
a transfer engine) needs the physical memory behind them mapped in its own
process. The runtime's own IPC (``cudaIpcGetMemHandle``) refuses memory mapped
through the driver's virtual memory API, which is all of graphkit's; the way
that works is the VMM one: export every chunk behind the range as a file
descriptor, send the descriptors over a Unix socket, import them in the peer
and map them there side by side:

>>> exported = pools.allocator.export(out.data_ptr(), out.nbytes)   # rank 0
>>> send_range(sock, exported); exported.close()
>>> peer = receive_range(sock, hal.get_backend("cuda", device=1))  # rank 1
>>> peer.tensor()  # the same bytes, read over the link between the devices

What a peer maps is the chunks, not the addresses: every space of the
allocator maps the same chunks, so the peer sees whatever graph of the pools
replayed last. A chunk lives while any process holds it; after the
allocator's memory is released and restored (sleep and wake) it has new
chunks: the peer's mapping keeps the old ones alive and sees none of the new
bytes, so export again after every wake. The backend must have the
``"memory_sharing"`` capability (``cuda``: chunks created with a POSIX file
descriptor handle type, the default where the device supports it; ``fake``).

A process can also *capture* into another's chunks: :class:`ImportedSpaces`
imports them once and gives a framework pool per key over a fresh range
that maps them all, as the spaces of one allocator do. Graphs of both
processes then share the bytes (two engines taking turns on one device pay
the graph memory once), so no two of them may run at the same time.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import socket
import struct
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import hal
from graphkit.memory.backing import wait_for_device
from graphkit.memory.closing import Closable, close_step, raise_first_failure
from hal.transaction import Transaction
from hal.types import fmt_bytes, round_up

log = logging.getLogger(__name__)

#: the most descriptors one message carries (Linux's SCM_MAX_FD is 253)
FDS_PER_MESSAGE = 253


@dataclass
class ExportedRange(Closable):
    """What a peer needs to map ``nbytes`` of memory: one descriptor per chunk, in address order.

    The range starts ``offset`` bytes into the first chunk; each chunk is
    ``chunk_bytes`` long. The descriptors are this object's: :meth:`close`
    closes them (once they were sent, the peer holds its own).
    """

    fds: tuple[int, ...]
    chunk_bytes: int
    offset: int
    nbytes: int
    closed: bool = False

    def layout(self) -> dict[str, int]:
        """The plain numbers a peer needs besides the descriptors (JSON-able)."""
        return {"chunks": len(self.fds), "chunk_bytes": self.chunk_bytes, "offset": self.offset,
                "nbytes": self.nbytes}

    def close(self) -> None:
        """Close the descriptors (idempotent)."""
        if self.closed:
            return
        self.closed = True
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)


def export_handles(backend: hal.Backend, handles: Sequence[Any], chunk_bytes: int, offset: int,
                   nbytes: int) -> ExportedRange:
    """Export ``handles`` (chunks in address order) as a range of ``nbytes`` from ``offset``; all or nothing."""
    fds: list[int] = []
    with Transaction() as tx:  # the descriptors made so far are closed when one export fails
        for handle in handles:
            fds.append(backend.export_phy_mem_handle(handle))
            tx.append(functools.partial(os.close, fds[-1]))
        tx.commit()
    return ExportedRange(tuple(fds), chunk_bytes, offset, nbytes)


class ImportedRange(Closable):
    """Chunks another process exported, mapped side by side in a range of this process.

    ``ptr`` is the first byte of the exported range (``offset`` bytes into the
    reservation). Built all or nothing; :meth:`close` unmaps, releases the
    imported handles and frees the range (the descriptors stay the caller's).
    """

    def __init__(self, backend: hal.Backend, fds: Sequence[int], chunk_bytes: int, offset: int,
                 nbytes: int) -> None:
        _check_layout(backend, fds, chunk_bytes, offset, nbytes, "ImportedRange")
        self.backend = backend
        self.chunk_bytes = chunk_bytes
        self.size = len(fds) * chunk_bytes
        self._held: dict[int, Any] = {}  # chunk index -> imported handle, until released
        self._mapped: set[int] = set()  # chunk indices mapped, until unmapped
        self._closed = False
        with Transaction() as tx:
            base = self.base = backend.create_vir_ptr(self.size)
            tx.append(functools.partial(backend.release_vir_ptr, base, self.size))
            for i, fd in enumerate(fds):
                handle = backend.import_phy_mem_handle(fd, chunk_bytes)
                tx.append(functools.partial(backend.release_phy_mem_handle, handle))
                backend.map(base + i * chunk_bytes, chunk_bytes, handle)
                tx.append(functools.partial(backend.unmap, base + i * chunk_bytes, chunk_bytes))
                self._held[i] = handle
                self._mapped.add(i)
            tx.commit()
        self.ptr = base + offset
        self.nbytes = nbytes

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"at {self.ptr:#x}"
        return f"<ImportedRange {self.nbytes} bytes in {self.size // self.chunk_bytes} chunk(s) {state}>"

    def tensor(self) -> Any:
        """A ``torch.uint8`` tensor over the range (it keeps this object alive); view it as you need."""
        if self._closed:
            raise hal.InvalidStateError("the imported range is closed", backend=self.backend.name, call="tensor")
        return self.backend.tensor_at(self.ptr, self.nbytes, owner=self)

    def close(self) -> None:
        """Unmap the chunks (after the device's queued work: kernels of this process may still read the range),
        release the imported handles, free the range; goes on past failures. Idempotent."""
        if self._closed:
            return
        errors: list[BaseException] = []
        if self._mapped and not close_step(errors, wait_for_device, self.backend):
            raise_first_failure(log, errors, "ImportedRange.close")
        for i, handle in list(self._held.items()):
            if i in self._mapped:
                if not close_step(errors, self.backend.unmap, self.base + i * self.chunk_bytes, self.chunk_bytes):
                    continue
                self._mapped.discard(i)
            if close_step(errors, self.backend.release_phy_mem_handle, handle):
                del self._held[i]
        if not errors:
            close_step(errors, self.backend.release_vir_ptr, self.base, self.size)
        raise_first_failure(log, errors, "ImportedRange.close")
        self._closed = True


@dataclass
class _ImportedSpace:
    """One range over every imported chunk, its bump pointer and the framework pool over it."""

    key: Hashable
    base: int
    offset: int = 0
    live: int = 0  # blocks handed out and not freed yet
    pool: Any = None
    mapped: int = 0  # chunks mapped so far (all of them once it is made)


class ImportedSpaces(Closable):
    """Chunks another process exported, imported once, under as many virtual spaces as this process captures into.

    Each space maps every chunk side by side, at the same offsets as every
    other space: a graph captured into :meth:`pool` ``(key)`` uses the
    exporter's bytes, as graphs of one :class:`graphkit.GraphPools` use each
    other's. This process creates no chunk. Graphs of both processes must
    take turns (an inter-process lock around each step): a replay overwrites
    what any other graph over the chunks left there, outputs included, so
    read a step's outputs before the turn ends. Allocations bump through a
    key's space; past the imported chunks they fail with
    :class:`hal.DeviceOutOfMemoryError` (the exporter holds too little: let
    the engine with the larger graphs export, or precreate more there).

    :param fds: the exported chunks, in order (the descriptors stay the caller's).
    """

    def __init__(self, backend: hal.Backend, fds: Sequence[int], chunk_bytes: int) -> None:
        _check_layout(backend, fds, chunk_bytes, 0, None, "ImportedSpaces")
        self.backend = backend
        self.chunk_bytes = chunk_bytes
        self.size = len(fds) * chunk_bytes
        self._handles: list[Any] = []
        self._spaces: dict[Hashable, _ImportedSpace] = {}
        self._closed = False
        with Transaction() as tx:
            for fd in fds:
                handle = backend.import_phy_mem_handle(fd, chunk_bytes)
                tx.append(functools.partial(backend.release_phy_mem_handle, handle))
                self._handles.append(handle)
            tx.commit()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._spaces)} space(s)"
        return f"<ImportedSpaces {fmt_bytes(self.size)} in {len(self._handles)} chunk(s), {state}>"

    @property
    def keys(self) -> list[Hashable]:
        return list(self._spaces)

    def used_bytes(self, key: Hashable) -> int:
        """Bytes handed out in ``key``'s space."""
        return self._spaces[key].offset if key in self._spaces else 0

    def pool(self, key: Hashable) -> Any:
        """The framework pool of ``key`` (what :meth:`hal.Backend.capture` takes): the same pool for the same key;
        the first call makes a fresh range with every chunk mapped, all or nothing."""
        if self._closed:
            raise hal.InvalidStateError("the imported spaces are closed", backend=self.backend.name,
                                        call="ImportedSpaces.pool")
        space = self._spaces.get(key)
        if space is None:
            space = self._spaces[key] = self._open(key)
        return space.pool

    def _open(self, key: Hashable) -> _ImportedSpace:
        be, g = self.backend, self.chunk_bytes
        with Transaction() as tx:
            space = _ImportedSpace(key, be.create_vir_ptr(self.size))
            tx.append(functools.partial(be.release_vir_ptr, space.base, self.size))
            for handle in self._handles:
                be.map(space.base + space.mapped * g, g, handle)
                tx.append(functools.partial(be.unmap, space.base + space.mapped * g, g))
                space.mapped += 1
            space.pool = be.create_pool(*self._callbacks(space))
            tx.commit()
        return space

    def _callbacks(self, space: _ImportedSpace) -> tuple[Callable[[int], int], Callable[[int, int], None]]:
        """Bump allocation in ``space``; ``alloc`` raises past the chunks (the backend's glue turns it into the
        framework's out-of-memory error), ``free`` only counts and never raises."""
        def alloc(nbytes: int) -> int:
            start = round_up(space.offset, hal.ALLOCATION_ALIGNMENT)
            if start + nbytes > self.size:
                message = (f"key {space.key!r} needs {fmt_bytes(start + nbytes)} of graph memory; the imported "
                           f"chunks hold {fmt_bytes(self.size)}: export from the engine with the larger graphs, "
                           "or precreate more chunks there before exporting")
                log.error("%s", message)
                raise hal.DeviceOutOfMemoryError(message, backend=self.backend.name, call="ImportedSpaces.pool")
            space.offset = start + nbytes
            space.live += 1
            return space.base + start

        def free(ptr: int, nbytes: int) -> None:
            space.live -= 1

        return alloc, free

    def close(self) -> None:
        """Release the pools, unmap and free every range, release the imported handles; goes on past failures.

        Reset the graphs captured into the pools (and drop their outputs) first. Waits for the device's queued
        work before unmapping. Idempotent; after a failure, ``close()`` again finishes the job.
        """
        if self._closed:
            return
        errors: list[BaseException] = []
        be, g = self.backend, self.chunk_bytes
        if be.closed:  # its close released every pool, mapping, range and chunk
            self._spaces.clear()
            self._handles.clear()
        elif self._spaces and not close_step(errors, wait_for_device, be):  # queued replays may use the ranges
            raise_first_failure(log, errors, "ImportedSpaces.close")
        for key, space in list(self._spaces.items()):
            if space.pool is not None and close_step(errors, be.release_pool, space.pool):
                space.pool = None
                if space.live > 0:  # the pool gave back every segment no tensor holds
                    log.warning("ImportedSpaces.close: %d segment(s) of key %r still hold tensors: they must not "
                                "be touched after this", space.live, key)
            while space.pool is None and space.mapped and close_step(
                    errors, be.unmap, space.base + (space.mapped - 1) * g, g):
                space.mapped -= 1
            if space.pool is None and not space.mapped and close_step(errors, be.release_vir_ptr, space.base,
                                                                      self.size):
                del self._spaces[key]
        while not self._spaces and self._handles and close_step(errors, be.release_phy_mem_handle,
                                                                self._handles[-1]):
            self._handles.pop()
        raise_first_failure(log, errors, "ImportedSpaces.close")
        self._closed = True


def _check_layout(backend: object, fds: object, chunk_bytes: object, offset: object, nbytes: object,
                  call: str) -> None:
    """The arguments of an imported range or imported spaces (``nbytes`` None: every chunk whole), checked before
    anything is made; a hal error naming them otherwise."""
    if not isinstance(backend, hal.Backend):
        raise hal.InvalidArgumentError(f"backend={backend!r} must be a hal.Backend (hal.get_backend(...))", call=call)
    if not isinstance(fds, Sequence) or isinstance(fds, (str, bytes)) or not all(
            isinstance(fd, int) and not isinstance(fd, bool) and fd >= 0 for fd in fds):
        raise hal.InvalidArgumentError(f"fds={fds!r} must be a sequence of file descriptors (ints >= 0), one per "
                                       "exported chunk", backend=backend.name, call=call)
    chunks = len(fds)
    if nbytes is None and isinstance(chunk_bytes, int):
        nbytes = chunks * chunk_bytes
    values = {"chunk_bytes": chunk_bytes, "offset": offset, "nbytes": nbytes, "chunks": chunks}
    ints = {k: v for k, v in values.items() if isinstance(v, int) and not isinstance(v, bool) and v >= 0}
    bad = [f"{k}={v!r}" for k, v in values.items() if k not in ints]
    if not bad and (chunks == 0 or ints["nbytes"] == 0 or ints["chunk_bytes"] == 0
                    or ints["offset"] >= ints["chunk_bytes"]
                    or ints["offset"] + ints["nbytes"] > chunks * ints["chunk_bytes"]):
        bad = [f"{k}={v}" for k, v in values.items()]
    if bad:
        raise hal.InvalidArgumentError(f"{', '.join(bad)}: need 0 <= offset < chunk_bytes and 0 < nbytes <= "
                                       "chunks * chunk_bytes - offset", backend=backend.name, call=call)


# -- over a Unix socket ------------------------------------------------------------------------------


def send_range(sock: socket.socket, exported: ExportedRange) -> None:
    """Send ``exported`` over a connected Unix socket: its layout, then its descriptors (the peer gets its own)."""
    header = json.dumps(exported.layout()).encode()
    sock.sendall(struct.pack("!I", len(header)) + header)
    for start in range(0, len(exported.fds), FDS_PER_MESSAGE):
        socket.send_fds(sock, [b"f"], list(exported.fds[start:start + FDS_PER_MESSAGE]))


def receive_range(sock: socket.socket, backend: hal.Backend) -> ImportedRange:
    """Receive what :func:`send_range` sent and map it with ``backend``; the received descriptors are closed."""
    return _receive(sock, backend, lambda fds, layout: ImportedRange(backend, fds, layout["chunk_bytes"],
                                                                     layout["offset"], layout["nbytes"]))


def receive_spaces(sock: socket.socket, backend: hal.Backend) -> ImportedSpaces:
    """Receive what :func:`send_range` sent as :class:`ImportedSpaces` over its whole chunks (the range's offset
    and length do not matter); the received descriptors are closed."""
    return _receive(sock, backend, lambda fds, layout: ImportedSpaces(backend, fds, layout["chunk_bytes"]))


_R = TypeVar("_R")


def _receive(sock: socket.socket, backend: hal.Backend, make: Callable[[list[int], dict[str, int]], _R]) -> _R:
    """The layout and the descriptors :func:`send_range` sent, handed to ``make``; the descriptors closed after."""
    fds: list[int] = []
    try:
        length = struct.unpack("!I", _receive_exactly(sock, 4, fds))[0]
        layout = _layout(backend, _receive_exactly(sock, length, fds))
        while len(fds) < layout["chunks"]:
            _receive_exactly(sock, 1, fds)
        if len(fds) != layout["chunks"]:
            raise hal.InvalidArgumentError(f"received {len(fds)} descriptors for {layout['chunks']} chunks",
                                           backend=backend.name, call="receive_range")
        return make(fds, layout)
    finally:
        for fd in fds:
            os.close(fd)


def _layout(backend: hal.Backend, header: bytes) -> dict[str, int]:
    """The layout :func:`send_range` sent, checked to be one."""
    try:
        layout = json.loads(header)
    except ValueError:
        layout = None
    keys = {"chunks", "chunk_bytes", "offset", "nbytes"}
    if not isinstance(layout, dict) or set(layout) != keys or not all(isinstance(v, int) for v in layout.values()):
        raise hal.InvalidArgumentError(f"the peer sent {header[:200]!r}, not the layout of an exported range",
                                       backend=backend.name, call="receive_range")
    return layout


def _receive_exactly(sock: socket.socket, nbytes: int, fds: list[int]) -> bytes:
    """``nbytes`` bytes from ``sock`` (never more: the next message's descriptors stay with it); descriptors
    that come with them are appended to ``fds``."""
    data = b""
    while len(data) < nbytes:
        chunk, got, _, _ = socket.recv_fds(sock, nbytes - len(data), FDS_PER_MESSAGE)
        fds.extend(got)
        if not chunk:
            raise ConnectionError(f"the socket closed after {len(data)} of {nbytes} bytes")
        data += chunk
    return data


__all__ = ["ExportedRange", "ImportedRange", "ImportedSpaces", "export_handles", "receive_range", "receive_spaces",
           "send_range"]
