"""Elastic device buffers: reserve the maximum once, back it with physical chunks as it grows.

A KV cache that follows the load: one contiguous virtual range whose
address never moves (kernels and captured graphs keep using it), mapped
at its end as it grows, unmapped as it shrinks. Growth copies nothing.
Each growth step maps its new bytes as one physical chunk where it can (of
at most ``chunk_bytes``), so a pause and a resume cost a driver call or two
per chunk, not per granule; a shrink gives back whole chunks only.

>>> kv = graphkit.ElasticBuffer(be, max_bytes=64 << 30)
>>> kv.resize(2 << 30)                       # map 2 GiB at the start of the range
>>> cache = kv.view(torch.bfloat16, (n, 16, 8, 128))
>>> kv.resize(4 << 30)                       # same kv.ptr, cache's data untouched

Many ranges, vAttention style: an :class:`ElasticReservation` carves ranges out of
one reservation and keeps a free list of pre-created chunks, so growth costs
a map call, not a driver allocation. A buffer garbage-collected without
``close()`` leaves its range to the reservation: the garbage collector may run
the finalizer in the middle of any call of the reservation, so the finalizer
only queues the range, and the reservation gives queued ranges back at its
next safe point (its lock held, nothing half done).
"""

from __future__ import annotations

import functools
import logging
import threading
import weakref
from collections import deque
from typing import Any

import torch

import hal
from graphkit.memory.closing import Closable, after_backend, close_step, raise_first_failure
from graphkit.memory.elastic_chunks import FreeChunks, RangeChunks
from graphkit.memory.elastic_views import LiveViews, ViewToken
from graphkit.memory.host_backup import HostBacked, HostBackup
from graphkit.memory.keeper import Keeper
from graphkit.memory.ranges import Arena
from hal.transaction import Transaction
from hal.types import fmt_bytes, round_up

log = logging.getLogger(__name__)


def _positive(value: Any, name: str, call: str, backend: str, zero: bool = False) -> int:
    if (not isinstance(value, int) or isinstance(value, bool) or value < 0 or (value == 0 and not zero)
            or value >= 1 << 64):
        raise hal.InvalidArgumentError(f"{name}={value!r} must be a{'n' if zero else ' positive'} int"
                                       f"{' >= 0' if zero else ''} of bytes below 2**64", backend=backend, call=call)
    return value


class ElasticReservation(Closable):
    """One reservation carved into elastic ranges, and physical chunks they share through a free list.

    :param backend: a :class:`hal.Backend` (default ``hal.get_backend()``, then owned).
    :param reserve_bytes: virtual bytes for all the ranges together.
    :param precreate_bytes: physical memory created up front into the free
        list (growth then costs a map call); more can be added with
        :meth:`precreate`, and :meth:`trim` releases what is free.
    :param owns_backend: close ``backend`` with the reservation.
    """

    def __init__(self, backend: hal.Backend | None = None, reserve_bytes: int = 0, *,
                 precreate_bytes: int = 0, owns_backend: bool = False) -> None:
        if backend is not None and not isinstance(backend, hal.Backend):
            raise hal.InvalidArgumentError(f"backend={backend!r} must be a hal.Backend", call="ElasticReservation")
        self._owns_backend = backend is None or owns_backend
        self.backend = be = backend if backend is not None else hal.get_backend(requires=("graphs",))
        _positive(reserve_bytes, "reserve_bytes", "ElasticReservation", be.name)
        _positive(precreate_bytes, "precreate_bytes", "ElasticReservation", be.name, zero=True)
        self.granularity = g = be.granularity
        self.reserve_bytes = round_up(reserve_bytes, g)
        self._free = FreeChunks(be)
        self._lock = self._free.lock  # one lock for the free list, the ranges and the buffers
        self._dropped: deque[RangeChunks] = deque()  # ranges of buffers dropped without close(): given back later
        self._buffers: weakref.WeakSet[ElasticBuffer] = weakref.WeakSet()
        self._closed = False
        self._closing = False
        with Transaction() as tx:  # chunks that would not precreate: the range goes, pending releases are retried
            self.base = be.create_vir_ptr(self.reserve_bytes)
            tx.append(functools.partial(be.release_vir_ptr, self.base, self.reserve_bytes))
            tx.append(self._free.retry)
            self._reserved = True  # the virtual range is still held
            self._arena = Arena(self.base, self.reserve_bytes)
            self.precreate(precreate_bytes)
            tx.commit()

    _free: FreeChunks

    @property
    def free_bytes(self) -> int:
        """Physical bytes pre-created and not mapped anywhere."""
        return self._free.free_bytes

    @property
    def created(self) -> int:
        """Chunks created over the reservation's life (growth that paid a driver allocation included)."""
        return self._free.created

    @property
    def pending_release(self) -> int:
        """Chunks whose release failed and will be retried (at :meth:`trim` and :meth:`close`)."""
        return len(self._free.pending)

    @property
    def closed(self) -> bool:
        return self._closed

    def precreate(self, nbytes: int) -> None:
        """Create chunks for ``nbytes`` into the free list (all or nothing)."""
        _positive(nbytes, "nbytes", "ElasticReservation.precreate", self.backend.name, zero=True)
        with self._lock:
            self._check_open("precreate")
            self._settle()
            count = -(-nbytes // self.granularity)
            if count * self.granularity > self.reserve_bytes:
                raise hal.DeviceOutOfMemoryError(f"nbytes={nbytes} is more than the reservation of "
                                                 f"{fmt_bytes(self.reserve_bytes)} can ever map",
                                                 backend=self.backend.name, call="ElasticReservation.precreate")
            self._free.create(count)

    def trim(self) -> int:
        """Release the free list's chunks; return the bytes released.

        A chunk whose release fails is kept and released at the next
        ``trim()`` or ``close()`` (see :attr:`pending_release`).
        """
        with self._lock:
            if not self._closed:
                self._settle()
            return self._free.trim()

    def buffer(self, max_bytes: int, **options: Any) -> ElasticBuffer:
        """A new elastic range of up to ``max_bytes`` out of this reservation."""
        return ElasticBuffer(self.backend, max_bytes, reservation=self, **options)

    # -- what a buffer uses -------------------------------------------------------------------

    def carve(self, size: int, host: HostBackup | None = None, chunk_bytes: int | None = None) -> RangeChunks:
        """A range of ``size`` bytes out of the reservation, nothing mapped yet (``host``: its backup;
        ``chunk_bytes``: the most a chunk made for its growth holds, default ``size``)."""
        with self._lock:
            self._check_open("buffer")
            self._settle()
            start = self._arena.take(size)
            if start is None:
                raise hal.DeviceOutOfMemoryError(
                    f"no {fmt_bytes(size)} range left in the reservation of {fmt_bytes(self.reserve_bytes)}",
                    backend=self.backend.name, call="ElasticReservation.buffer")
            return RangeChunks(self._free, start, size, host, chunk_bytes)

    def track(self, buffer: ElasticBuffer, chunks: RangeChunks, own: bool) -> weakref.finalize:
        """Close ``buffer`` with the reservation, and take its range back if it is garbage-collected without
        ``close()`` (``detach()`` the result when it closes). ``own``: the reservation is the buffer's own
        (nothing else can reach it: it closes then too)."""
        with self._lock:
            self._buffers.add(buffer)
        finalizer = weakref.finalize(buffer, self._dropped_buffer, chunks, own)
        finalizer.atexit = False  # at exit the process gives everything back anyway
        return finalizer

    def give_back(self, buffer: ElasticBuffer, chunks: RangeChunks) -> None:
        """The range of a buffer closed with nothing mapped in it goes back to the reservation."""
        with self._lock:
            self._arena.give(chunks.ptr, chunks.size)
            self._buffers.discard(buffer)

    def _dropped_buffer(self, chunks: RangeChunks, own: bool) -> None:
        log.warning("an ElasticBuffer on %s at %#x was garbage-collected without close(): its %s go back to its "
                    "reservation (call close() when done with it)", chunks.backend.name, chunks.ptr,
                    fmt_bytes(chunks.held_bytes))
        self._dropped.append(chunks)  # deque.append is atomic: safe from the garbage collector
        if not own:
            return  # given back at the reservation's next call (this may run inside one of them)
        try:  # a reservation of its own: nothing else can reach it, close it now
            self.close()
        except hal.HalError as exc:
            log.error("closing a dropped ElasticBuffer's own reservation failed: %s", str(exc))

    def _settle(self) -> None:
        """Give back what buffers dropped without close() left (a safe point: the reservation's lock is held);
        those that cannot be finished yet stay queued."""
        for _ in range(len(self._dropped)):
            chunks = self._dropped.popleft()
            errors = chunks.unmap_all()
            for exc in errors:
                log.error("a dropped buffer's chunk at %#x would not unmap (retried later): %s", chunks.ptr, str(exc))
            if errors or chunks.pending:
                self._dropped.append(chunks)
            else:
                self._arena.give(chunks.ptr, chunks.size)

    def _check_open(self, call: str) -> None:
        if self._closed or self._closing:
            raise hal.InvalidStateError("the reservation is closed", backend=self.backend.name,
                                        call=f"ElasticReservation.{call}")

    def close(self) -> None:
        """Close every buffer, release the free list and the reservation. Idempotent.

        Goes on past failures (a buffer that will not close, a chunk that
        will not release) and raises the first; ``close()`` again finishes.
        """
        with self._lock:
            if self._closed:
                return
            self._closing = True  # no new buffer from here on
            buffers = list(self._buffers)
        errors: list[BaseException] = []
        for buf in buffers:  # outside the reservation's lock: a buffer takes its own lock, then this one
            close_step(errors, buf.close)
        with self._lock:
            if self._closed:
                return
            if not after_backend(self.backend, log, "ElasticReservation"):  # else it released the range and chunks
                self._settle()
                self.trim()
                errors += self._leftovers(errors)
            raise_first_failure(log, errors, "ElasticReservation.close")
            self._closed = True
            if self._owns_backend:
                self.backend.close()

    def _leftovers(self, errors: list[BaseException]) -> list[BaseException]:
        """Release the reservation (once) if no buffer holds memory in it; else what is left, as one error."""
        left = [b for b in self._buffers if not b.closed]
        if left or self._dropped:
            return [] if errors else [hal.InvalidStateError(
                f"{len(left) + len(self._dropped)} buffer(s) still hold mapped memory in the reservation",
                backend=self.backend.name, call="ElasticReservation.close")]
        if self._reserved:
            try:
                self.backend.release_vir_ptr(self.base, self.reserve_bytes)
            except hal.HalError as exc:
                return [exc]
            self._reserved = False  # a close() again after a chunk that would not release must not free it twice
        if not errors and self._free.pending:
            return [hal.InvalidStateError(f"{len(self._free.pending)} chunk(s) could not be released yet",
                                          backend=self.backend.name, call="ElasticReservation.close")]
        return []


def _buffer_backend(backend: hal.Backend | None, reservation: Any, spelled: str, saver: Any,
                    tag: str) -> hal.Backend:
    """The backend of a new :class:`ElasticBuffer`, once its arguments are checked."""
    if reservation is not None and not isinstance(reservation, ElasticReservation):
        raise hal.InvalidArgumentError(f"{spelled}={reservation!r} must be an ElasticReservation",
                                       backend=getattr(backend, "name", None), call="ElasticBuffer")
    if backend is not None and not isinstance(backend, hal.Backend):
        raise hal.InvalidArgumentError(f"backend={backend!r} must be a hal.Backend", call="ElasticBuffer")
    if reservation is not None and backend is not None and reservation.backend is not backend:
        raise hal.InvalidArgumentError(f"{spelled}= belongs to another backend", backend=backend.name,
                                       call="ElasticBuffer")
    if saver is not None and not isinstance(saver, Keeper):
        raise hal.InvalidArgumentError(f"saver={saver!r} must be a graphkit.MemorySaver",
                                       backend=getattr(backend, "name", None), call="ElasticBuffer")
    if saver is not None:
        saver.check_adoptable(tag, "ElasticBuffer")
    if reservation is not None:
        return reservation.backend
    return backend if backend is not None else hal.get_backend(requires=("graphs",))  # views are tensors


def _view_end(backend: hal.Backend, dtype: Any, shape: Any, offset: Any) -> int:
    """Where a view of ``dtype`` and ``shape`` at byte ``offset`` ends, once the three are checked."""
    call = "ElasticBuffer.view"
    if not isinstance(dtype, torch.dtype):
        raise hal.InvalidArgumentError(f"dtype={dtype!r} must be a torch.dtype", backend=backend.name, call=call)
    if not isinstance(shape, (tuple, list)) or any(not isinstance(d, int) or isinstance(d, bool) or d < 0
                                                    for d in shape):
        raise hal.InvalidArgumentError(f"shape={shape!r} must be a tuple of ints >= 0", backend=backend.name,
                                       call=call)
    _positive(offset, "offset", call, backend.name, zero=True)
    try:
        itemsize = torch.empty((), dtype=dtype).element_size()
    except (RuntimeError, TypeError) as exc:
        raise hal.InvalidArgumentError(f"dtype={dtype} cannot view raw memory: {exc}", backend=backend.name,
                                       call=call) from None
    if offset % itemsize:
        raise hal.InvalidArgumentError(f"offset={offset} is not a multiple of {dtype}'s {itemsize} bytes",
                                       backend=backend.name, call=call)
    count = 1
    for d in shape:
        count *= d
    return offset + count * itemsize


class ElasticBuffer(Closable, HostBacked):
    """A virtual range of ``max_bytes`` whose prefix is backed by physical memory as it grows.

    :param backend: a :class:`hal.Backend` (default ``hal.get_backend()``, then owned).
    :param max_bytes: the most it can grow to (rounded up to the granularity).
    :param reservation: carve the range out of this :class:`ElasticReservation`
        and grow from its free list (default: a reservation of its own).
    :param saver: a :class:`graphkit.MemorySaver` to pause and resume with,
        under ``tag`` (default ``"kv_cache"``), with ``backup`` or not.
    :param chunk_bytes: the most bytes one physical chunk made for growth
        holds (rounded up to the granularity). A growth step maps its new
        bytes as chunks of this size (one chunk for a step that fits), and
        a pause or a resume costs a driver call or two per chunk. Default:
        ``max_bytes`` for a buffer with a reservation of its own (each step
        one chunk), the granularity for one carved from a shared
        :class:`ElasticReservation` (chunks of one size circulate through
        its free list). Pass the granularity to shrink granule by granule.

    A shrink gives back whole chunks: a chunk that holds bytes below the
    new size stays mapped whole, its bytes untouched (:attr:`mapped_bytes`
    can stay up to one chunk less a granule above the size asked; a
    later shrink below the chunk's start gives it back). Nothing is copied.

    Shrinking below a live view (or a slice of one) raises
    :class:`hal.InvalidStateError`: the view would read unmapped memory.
    Drop the view first. Views made with ``whole_range=True`` promise to
    read only what is mapped, so they do not stop a shrink; any live view
    stops :meth:`close`. A buffer garbage-collected without ``close()``
    gives its memory back to its reservation, with a warning.
    """

    def __init__(self, backend: hal.Backend | None = None, max_bytes: int = 0, *,
                 reservation: ElasticReservation | None = None, saver: Keeper | None = None,
                 tag: str = "kv_cache", backup: bool = False, chunk_bytes: int | None = None) -> None:
        if not isinstance(backup, bool):  # before anything is made
            raise hal.InvalidArgumentError(f"backup={backup!r} must be a bool", call="ElasticBuffer")
        be = _buffer_backend(backend, reservation, "reservation", saver, tag)
        _positive(max_bytes, "max_bytes", "ElasticBuffer", be.name)
        if chunk_bytes is not None:
            _positive(chunk_bytes, "chunk_bytes", "ElasticBuffer", be.name)
        self._backup = HostBackup(backup and be.torch_device().type != "cpu", grow=True, name="graphkit-elastic-backup")
        self._own_reservation = reservation is None
        self.reservation = reservation if reservation is not None else ElasticReservation(
            be, max_bytes, owns_backend=backend is None)
        self.backend = be
        self.granularity = be.granularity
        self.max_bytes = round_up(max_bytes, self.granularity)
        if chunk_bytes is None:
            chunk_bytes = self.max_bytes if self._own_reservation else self.granularity
        self.chunk_bytes = min(round_up(chunk_bytes, self.granularity), self.max_bytes)
        with Transaction() as tx:  # a range that cannot be carved: a reservation of its own goes
            if self._own_reservation:
                tx.append(self.reservation.close)
            self._chunks = self.reservation.carve(self.max_bytes, self._backup, self.chunk_bytes)
            tx.commit()
        self.ptr = self._chunks.ptr
        self._lock = threading.RLock()
        self._views = LiveViews()
        self.backup = backup
        self.saver = saver
        self.tag = tag
        self._closed = False
        self._finalizer = self.reservation.track(self, self._chunks, self._own_reservation)
        if saver is not None:
            with Transaction() as tx:  # a saver that refuses it: the buffer is closed at once
                tx.append(self._close_refused)
                saver.adopt(self, tag)
                tx.commit()

    def _close_refused(self) -> None:
        """Close a buffer its saver refused to adopt (no warning at garbage collection: it never lived)."""
        self._finalizer.detach()
        self.close()

    # -- figures ------------------------------------------------------------------------

    _chunks: RangeChunks

    @property
    def mapped_bytes(self) -> int:
        """Bytes backed by physical memory now (a prefix of the range)."""
        return self._chunks.mapped_bytes

    @property
    def footprint_bytes(self) -> int:
        """Bytes it holds while awake (what a pause releases)."""
        return self._chunks.footprint_bytes

    @property
    def paused(self) -> bool:
        """Whether part of its prefix is released or unmapped (nothing may read it until it is restored)."""
        return self._chunks.paused

    def __repr__(self) -> str:
        return (f"<graphkit.ElasticBuffer {self.backend.name} at {self.ptr:#x} mapped {fmt_bytes(self.mapped_bytes)} "
                f"of {fmt_bytes(self.max_bytes)}{' paused' if self.paused else ''}>")

    def _check(self, call: str, awake: bool = True) -> None:
        if self._closed:
            raise hal.InvalidStateError("the buffer is closed", backend=self.backend.name, call=f"ElasticBuffer.{call}")
        if awake and self.paused:
            how = ("resume its MemorySaver tag first" if self.saver is not None and not self.saver.closed
                   else "call restore_physical() first")
            raise hal.InvalidStateError(f"the buffer is paused: {how}", backend=self.backend.name,
                                        call=f"ElasticBuffer.{call}")

    # -- growing and shrinking ---------------------------------------------------------

    @property
    def chunk_count(self) -> int:
        """Physical chunks mapped now (each paused and resumed with one call or two)."""
        return len(self._chunks.places)

    def resize(self, nbytes: int) -> None:
        """Map or unmap chunks at the end so that ``nbytes`` are backed (rounded up to whole granules).

        Growth maps exactly up to ``nbytes``; a shrink unmaps the chunks that
        lie wholly past it (the one holding its last bytes stays whole).
        All or nothing.

        :raises hal.InvalidArgumentError: ``nbytes`` is not an int in ``[0, max_bytes]``.
        :raises hal.InvalidStateError: shrinking below a live view; the buffer is paused.
        """
        be = self.backend
        with self._lock:
            chunks = self._chunks
            if (type(nbytes) is int and 0 <= nbytes <= self.max_bytes and chunks.settled(-(-nbytes // self.granularity))
                    and not (self._closed or chunks.paused or chunks.pending)):
                return  # the size it has, nothing to heal: a decode loop asks this every step
            self._check("resize", awake=False)
            sleeping = chunks.sleeping
            if sleeping:
                self._check("resize")
            _positive(nbytes, "nbytes", "ElasticBuffer.resize", be.name, zero=True)
            if nbytes > self.max_bytes:
                raise hal.InvalidArgumentError(f"nbytes={nbytes} exceeds the buffer's max_bytes {self.max_bytes}",
                                               backend=be.name, call="ElasticBuffer.resize")
            chunks.heal("resize", sleeping)
            target = -(-nbytes // self.granularity)
            if target > chunks.granules:
                chunks.grow(target)
                if self.backup:  # the host copy's buffers, made now in the background: a pause then only copies
                    self._backup.prepare_in_background([(self.ptr, chunks.footprint_bytes)])
            elif chunks.kept(target) < chunks.granules:
                self._shrink(target)

    def _shrink(self, target: int) -> None:
        limit = self._chunks.kept(target) * self.granularity
        live = [end for end in self._views.ends() if end > limit]  # whole-range views count 0
        if live:
            raise hal.InvalidStateError(
                f"a live view reaches {fmt_bytes(max(live))} into the buffer: shrinking to {fmt_bytes(limit)} "
                "would leave it over unmapped memory; drop the view first", backend=self.backend.name,
                call="ElasticBuffer.resize")
        self._chunks.shrink(target)
        if self._own_reservation:  # nobody else draws from this free list: give the memory back now (never raises)
            self.reservation.trim()

    # -- framework views ------------------------------------------------------------------

    def view(self, dtype: torch.dtype, shape: tuple[int, ...] | list[int] | torch.Size, offset: int = 0, *,
             whole_range: bool = False) -> torch.Tensor:
        """A framework tensor of ``dtype`` and ``shape`` over the buffer at byte ``offset`` (no copy).

        It must lie in the mapped prefix; ``whole_range=True`` lets it span
        the whole reserved range for kernels that index only what is mapped
        (a block table into a growing KV cache): touching the rest is a
        device fault. The view keeps the buffer alive.
        """
        be = self.backend
        with self._lock:
            self._check("view")
            end = _view_end(be, dtype, shape, offset)
            limit = self.max_bytes if whole_range else self.mapped_bytes
            if end > limit:
                raise hal.InvalidArgumentError(
                    f"shape={tuple(shape)} of {dtype} at offset {offset} needs {end} bytes; "
                    f"{'the buffer holds' if whole_range else 'only'} {limit} are "
                    f"{'reserved' if whole_range else 'mapped (resize first)'}", backend=be.name,
                    call="ElasticBuffer.view")
            # the tensor's storage owns the token, and every view or slice of it shares that storage:
            # the token lives exactly as long as any of them, and keeps the buffer alive
            token = ViewToken(self)
            raw = be.tensor_at(self.ptr + offset, end - offset, owner=token)
            try:
                tensor = raw.view(dtype).view(tuple(shape))
            except RuntimeError as exc:
                raise hal.InvalidArgumentError(f"dtype={dtype} cannot view raw memory: {exc}", backend=be.name,
                                               call="ElasticBuffer.view") from None
            self._views.add(token, 0 if whole_range else end)
            return tensor

    # -- sleep (through a MemorySaver) ---------------------------------------------------------

    def release_physical(self, *, keep_backup: bool = False) -> int:
        """Back up (when made with ``backup``), unmap and release every chunk; the address stays. Idempotent.

        Returns the bytes released. A failed unmap maps back what this call
        unmapped (what will not map back leaves the buffer :attr:`paused`); a
        chunk whose release fails is kept and released later.

        :param keep_backup: the rollback of a failed resume: the backup of the
            last pause stays the one a resume restores (nothing is copied).
        """
        with self._lock:
            self._check("pause", awake=False)
            if self._chunks.sleeping and self._chunks.released:
                return 0
            return self._chunks.pause(self.backup, keep_backup)

    def restore_physical(self, restore: bool = True) -> None:
        """Map fresh chunks at the same addresses and restore the backup (all or nothing). Idempotent.

        ``restore=False`` leaves the fresh memory as it is (the caller overwrites it).
        """
        with self._lock:
            self._check("resume", awake=False)
            if self.paused:
                self._chunks.resume(restore and self.backup)

    # -- teardown ---------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Unmap everything (chunks go back to the reservation's free list), give the range back. Idempotent.

        Goes on past failures and raises the first; ``close()`` again finishes.

        :raises hal.InvalidStateError: a view of the buffer is still alive.
        """
        be = self.backend
        with self._lock:
            if self._closed:
                if self._own_reservation and not self.reservation.closed:
                    self.reservation.close()
                return
            gone = after_backend(be, log, "ElasticBuffer")  # its close released every chunk: nothing to unmap
            live = self._views.ends()
            if live and not gone:
                raise hal.InvalidStateError(f"{len(live)} view(s) of the buffer are still alive: drop them "
                                            "before closing", backend=be.name, call="ElasticBuffer.close")
            self._backup.wait()  # no thread of its own outlives it
            errors = [] if gone else self._chunks.unmap_all()
            if self._chunks.pending and not errors and not gone:
                errors.append(hal.InvalidStateError(f"{len(self._chunks.pending)} mapping(s) would not unmap",
                                                    backend=be.name, call="ElasticBuffer.close"))
            raise_first_failure(log, errors, "ElasticBuffer.close")
            self._finalizer.detach()
            if self.saver is not None:
                self.saver.forget(self)
            self._closed = True
            self.reservation.give_back(self, self._chunks)
            log.debug("elastic buffer at %#x closed", self.ptr)
            if self._own_reservation:
                self.reservation.close()
