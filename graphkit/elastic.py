"""Elastic device buffers: reserve the maximum once, back it with physical chunks as it grows.

A KV cache that follows the load: one contiguous virtual range whose
address never moves (kernels and captured graphs keep using it), mapped
granule by granule at its end as it grows, unmapped as it shrinks. Growth
copies nothing.

>>> kv = graphkit.ElasticBuffer(be, max_bytes=64 << 30)
>>> kv.resize(2 << 30)                       # map 2 GiB at the start of the range
>>> cache = kv.view(torch.bfloat16, (n, 16, 8, 128))
>>> kv.resize(4 << 30)                       # same kv.ptr, cache's data untouched

Many ranges, vAttention style: an :class:`ElasticReservation` carves ranges out of
one reservation and keeps a free list of pre-created chunks, so growth costs
a map call, not a driver allocation.
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
from graphkit.allocator import Arena
from graphkit.closing import Closable, raise_first_failure
from graphkit.deprecation import renamed
from graphkit.saver import MemorySaver
from graphkit.transaction import Transaction, map_run, release_or_keep, retry_releases, unmap_run
from hal.types import fmt_bytes, round_up

log = logging.getLogger("graphkit.elastic")


def _positive(value: Any, name: str, call: str, backend: str, zero: bool = False) -> int:
    if (not isinstance(value, int) or isinstance(value, bool) or value < 0 or (value == 0 and not zero)
            or value >= 1 << 64):
        raise hal.InvalidArgumentError(f"{name}={value!r} must be a{'n' if zero else ' positive'} int"
                                       f"{' >= 0' if zero else ''} of bytes below 2**64", backend=backend, call=call)
    return value


class _Orphan:
    """What a buffer dropped without ``close()`` left in its pool: given back at the pool's next safe point."""

    __slots__ = ("chunks", "holes", "max_bytes", "ptr", "stray")

    def __init__(self, ptr: int, max_bytes: int, chunks: list[Any], holes: set[int],
                 stray: list[tuple[int, Any]]) -> None:
        self.ptr, self.max_bytes, self.chunks, self.holes, self.stray = ptr, max_bytes, chunks, holes, stray


def _dropped(pool: ElasticReservation, orphan: _Orphan, own_pool: bool) -> None:
    """Finalizer of an :class:`ElasticBuffer` garbage-collected without ``close()``."""
    log.warning("an ElasticBuffer on %s at %#x was garbage-collected without close(): its %s go back to its "
                "pool (call close() when done with it)", pool.backend.name, orphan.ptr,
                fmt_bytes(sum(h is not None for h in orphan.chunks) * pool.granularity))
    pool._orphans.append(orphan)  # deque.append is atomic: safe from the garbage collector
    if not own_pool:
        return  # given back at the pool's next call (a safe point: this may run inside one of them)
    try:  # a pool of its own: nothing else can reach it, close it now
        pool.close()
    except hal.HalError as exc:
        log.error("closing a dropped ElasticBuffer's own pool failed: %s", str(exc))


class ElasticReservation(Closable):
    """One reservation carved into elastic ranges, and physical chunks they share through a free list.

    :param backend: a :class:`hal.Backend` (default ``hal.get_backend()``, then owned).
    :param reserve_bytes: virtual bytes for all the ranges together.
    :param precreate_bytes: physical memory created up front into the free
        list (growth then costs a map call); more can be added with
        :meth:`precreate`, and :meth:`trim` releases what is free.
    """

    def __init__(self, backend: hal.Backend | None = None, reserve_bytes: int = 0, *,
                 precreate_bytes: int = 0) -> None:
        if backend is not None and not isinstance(backend, hal.Backend):
            raise hal.InvalidArgumentError(f"backend={backend!r} must be a hal.Backend", call="ElasticReservation")
        self._owns_backend = backend is None
        self.backend = be = backend if backend is not None else hal.get_backend(requires=("graphs",))
        _positive(reserve_bytes, "reserve_bytes", "ElasticReservation", be.name)
        _positive(precreate_bytes, "precreate_bytes", "ElasticReservation", be.name, zero=True)
        self.granularity = g = be.granularity
        self.reserve_bytes = round_up(reserve_bytes, g)
        self._lock = threading.RLock()
        self._free: list[Any] = []  # pre-created chunks, mapped nowhere
        self._zombies: list[Any] = []  # chunks mapped nowhere whose release failed: released later
        self._orphans: deque[_Orphan] = deque()  # buffers dropped without close(): given back at a safe point
        self._buffers: weakref.WeakSet[ElasticBuffer] = weakref.WeakSet()
        self.created = 0  # chunks created over the pool's life (growth that paid a driver allocation)
        self._closed = False
        self._closing = False
        self.base = be.create_vir_ptr(self.reserve_bytes)
        self._arena = Arena(self.base, self.reserve_bytes)
        try:
            self.precreate(precreate_bytes)
        except BaseException:
            retry_releases(be, self._zombies)
            be.release_vir_ptr(self.base, self.reserve_bytes)
            raise

    @property
    def free_bytes(self) -> int:
        """Physical bytes pre-created and not mapped anywhere."""
        return len(self._free) * self.granularity

    @property
    def pending_release(self) -> int:
        """Chunks whose release failed and will be retried (at :meth:`trim` and :meth:`close`)."""
        return len(self._zombies)

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
                raise hal.DeviceOutOfMemoryError(f"nbytes={nbytes} is more than the pool's reservation of "
                                                 f"{fmt_bytes(self.reserve_bytes)} can ever map",
                                                 backend=self.backend.name, call="ElasticReservation.precreate")
            made: list[Any] = []
            with Transaction() as tx:
                for _ in range(count):
                    handle = self.backend.create_phy_mem_handle(self.granularity)
                    made.append(handle)
                    tx.append(functools.partial(self._release, handle))
                tx.commit()
            self._free.extend(made)
            self.created += len(made)

    def _release(self, handle: Any) -> None:
        release_or_keep(self.backend, handle, self._zombies)

    def trim(self) -> int:
        """Release the free list's chunks; return the bytes released.

        A chunk whose release fails is kept and released at the next
        ``trim()`` or ``close()`` (see :attr:`pending_release`).
        """
        with self._lock:
            released = 0
            if not self._closed:
                self._settle()
            retry_releases(self.backend, self._zombies)
            free, self._free = self._free, []
            for handle in reversed(free):
                if release_or_keep(self.backend, handle, self._zombies):
                    released += self.granularity
            return released

    def buffer(self, max_bytes: int, **options: Any) -> ElasticBuffer:
        """A new elastic range of up to ``max_bytes`` out of this pool's reservation."""
        return ElasticBuffer(self.backend, max_bytes, pool=self, **options)

    def _carve(self, size: int) -> int:
        with self._lock:
            self._check_open("buffer")
            self._settle()
            start = self._arena.take(size)
            if start is None:
                raise hal.DeviceOutOfMemoryError(
                    f"no {fmt_bytes(size)} range left in the pool's reservation of {fmt_bytes(self.reserve_bytes)}",
                    backend=self.backend.name, call="ElasticReservation.buffer")
            return start

    def _take_chunk(self) -> Any:
        """A chunk for growth: from the free list, else a new one (the caller puts it back on failure)."""
        if self._free:
            return self._free.pop()
        handle = self.backend.create_phy_mem_handle(self.granularity)
        self.created += 1
        return handle

    def _settle(self) -> None:
        """Give back what buffers dropped without close() left (a safe point: the pool's lock is held)."""
        for _ in range(len(self._orphans)):
            orphan = self._orphans.popleft()
            if not self._reclaim(orphan):
                self._orphans.append(orphan)

    def _reclaim(self, orphan: _Orphan) -> bool:
        g = self.granularity
        done = True
        for ptr, handle in list(orphan.stray):
            try:
                self.backend.unmap(ptr, g)
            except hal.HalError as exc:
                log.error("a dropped buffer's mapping at %#x would not unmap (retried later): %s", ptr, str(exc))
                done = False
                continue
            orphan.stray.remove((ptr, handle))
            self._free.append(handle)
        for index in reversed(range(len(orphan.chunks))):
            handle = orphan.chunks[index]
            if index not in orphan.holes:
                try:
                    self.backend.unmap(orphan.ptr + index * g, g)
                except hal.HalError as exc:
                    log.error("a dropped buffer's chunk would not unmap (retried later): %s", str(exc))
                    done = False
                    continue
                orphan.holes.add(index)
            if handle is not None:
                orphan.chunks[index] = None
                self._free.append(handle)
        if done:
            self._arena.give(orphan.ptr, orphan.max_bytes)
        return done

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
        for buf in buffers:  # outside the pool's lock: a buffer takes its own lock, then the pool's
            try:
                buf.close()
            except hal.HalError as exc:
                errors.append(exc)
        with self._lock:
            if self._closed:
                return
            self._settle()
            self.trim()
            left = [b for b in self._buffers if not b.closed]
            if not left and not self._orphans:
                try:
                    self.backend.release_vir_ptr(self.base, self.reserve_bytes)
                except hal.HalError as exc:
                    errors.append(exc)
            elif not errors:
                errors.append(hal.InvalidStateError(
                    f"{len(left) + len(self._orphans)} buffer(s) still hold mapped memory in the pool",
                    backend=self.backend.name, call="ElasticReservation.close"))
            if not errors and self._zombies:
                errors.append(hal.InvalidStateError(f"{len(self._zombies)} chunk(s) could not be released yet",
                                                    backend=self.backend.name, call="ElasticReservation.close"))
            raise_first_failure(log, errors, "ElasticReservation.close")
            self._closed = True
            if self._owns_backend:
                self.backend.close()


class _ViewToken:
    """Owned by the storage of one view: alive while the view or any slice of it is."""

    __slots__ = ("__weakref__", "buffer")

    def __init__(self, buffer: ElasticBuffer) -> None:
        self.buffer = buffer


class ElasticBuffer(Closable):
    """A virtual range of ``max_bytes`` whose prefix is backed by physical memory as it grows.

    :param backend: a :class:`hal.Backend` (default ``hal.get_backend()``, then owned).
    :param max_bytes: the most it can grow to (rounded up to the granularity).
    :param pool: carve the range out of this :class:`ElasticReservation` and grow
        from its free list (default: a reservation of its own).
    :param saver: a :class:`graphkit.MemorySaver` to pause and resume with,
        under ``tag`` (default ``"kv_cache"``), with ``backup`` or not.

    Shrinking below a live view (or a slice of one) raises
    :class:`hal.InvalidStateError`: the view would read unmapped memory.
    Drop the view first. Views made with ``whole_range=True`` promise to
    read only what is mapped, so they do not stop a shrink; any live view
    stops :meth:`close`. A buffer garbage-collected without ``close()``
    gives its memory back to its pool, with a warning.
    """

    def __init__(self, backend: hal.Backend | None = None, max_bytes: int = 0, *,
                 pool: ElasticReservation | None = None, saver: MemorySaver | None = None, tag: str = "kv_cache",
                 backup: bool = False) -> None:
        if pool is not None and not isinstance(pool, ElasticReservation):
            raise hal.InvalidArgumentError(f"pool={pool!r} must be an ElasticReservation",
                                           backend=getattr(backend, "name", None), call="ElasticBuffer")
        if backend is not None and not isinstance(backend, hal.Backend):
            raise hal.InvalidArgumentError(f"backend={backend!r} must be a hal.Backend", call="ElasticBuffer")
        if pool is not None and backend is not None and pool.backend is not backend:
            raise hal.InvalidArgumentError("pool= belongs to another backend", backend=backend.name,
                                           call="ElasticBuffer")
        if saver is not None and not isinstance(saver, MemorySaver):
            raise hal.InvalidArgumentError(f"saver={saver!r} must be a graphkit.MemorySaver",
                                           backend=getattr(backend, "name", None), call="ElasticBuffer")
        if saver is not None:
            saver.check_adoptable(tag, "ElasticBuffer")
        be = pool.backend if pool is not None else (
            backend if backend is not None else hal.get_backend(requires=("graphs",)))  # views are tensors
        _positive(max_bytes, "max_bytes", "ElasticBuffer", be.name)
        self._own_pool = pool is None
        self.pool = pool if pool is not None else ElasticReservation(be, max_bytes)
        if self._own_pool and backend is None:
            self.pool._owns_backend = True
        self.backend = be
        self.granularity = g = be.granularity
        self.max_bytes = round_up(max_bytes, g)
        try:
            self.ptr = self.pool._carve(self.max_bytes)
        except BaseException:
            if self._own_pool:
                self.pool.close()
            raise
        # these three are mutated in place, never rebound: the finalizer of a dropped buffer holds them
        self._chunks: list[Any] = []  # chunk i of the prefix (None: released while paused)
        self._holes: set[int] = set()  # indices of the prefix not mapped now (paused, or a failed rollback)
        self._stray: list[tuple[int, Any]] = []  # mappings past the prefix a failed rollback could not undo yet
        self._lock = threading.RLock()
        self._views: list[tuple[weakref.ref, int]] = []  # (view, end offset)
        self._prune_at = 64
        self._sleeping = False  # released by a pause: nothing may touch it until restore_physical()
        self._backed_up = False  # the host copy holds this sleep's data
        self._host: torch.Tensor | None = None
        self.backup = backup
        self.saver = saver
        self.tag = tag
        self._closed = False
        self._finalizer = weakref.finalize(self, _dropped, self.pool,
                                           _Orphan(self.ptr, self.max_bytes, self._chunks, self._holes, self._stray),
                                           self._own_pool)
        self._finalizer.atexit = False  # at exit the process gives everything back anyway
        self.pool._buffers.add(self)
        if saver is not None:
            try:
                saver.adopt(self, tag)
            except BaseException:
                self._finalizer.detach()
                self.close()
                raise

    # -- figures ------------------------------------------------------------------------

    @property
    def mapped_bytes(self) -> int:
        """Bytes backed by physical memory now (a prefix of the range)."""
        return (len(self._chunks) - len(self._holes)) * self.granularity

    physical_bytes = mapped_bytes

    @property
    def footprint_bytes(self) -> int:
        """Bytes it holds while awake (what a pause releases)."""
        return len(self._chunks) * self.granularity

    @property
    def paused(self) -> bool:
        """Whether part of its prefix is released or unmapped (nothing may read it until it is restored)."""
        return self._sleeping or bool(self._holes)

    @property
    def capacity(self) -> int:
        """Deprecated spelling of :attr:`max_bytes` (the range's size, rounded to the granularity)."""
        renamed("ElasticBuffer.capacity", "max_bytes")
        return self.max_bytes

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

    def resize(self, nbytes: int) -> None:
        """Map or unmap whole granules at the end so that ``nbytes`` are backed (rounded up).

        All or nothing.

        :raises hal.InvalidArgumentError: ``nbytes`` is not an int in ``[0, max_bytes]``.
        :raises hal.InvalidStateError: shrinking below a live view; the buffer is paused.
        """
        be = self.backend
        with self._lock:
            self._check("resize", awake=False)
            if self._sleeping:
                self._check("resize")
            _positive(nbytes, "nbytes", "ElasticBuffer.resize", be.name, zero=True)
            if nbytes > self.max_bytes:
                raise hal.InvalidArgumentError(f"nbytes={nbytes} exceeds the buffer's max_bytes {self.max_bytes}",
                                               backend=be.name, call="ElasticBuffer.resize")
            self._heal("resize")
            target = -(-nbytes // self.granularity)
            if target > len(self._chunks):
                self._grow(target)
            elif target < len(self._chunks):
                self._shrink(target)

    def _heal(self, call: str) -> None:
        """Finish what a failed rollback left: unmap stray mappings, map holes back (raises if it cannot)."""
        self._retry_strays()
        if self._holes and not self._sleeping:
            with Transaction() as tx:
                self._fill_holes(tx)
                tx.commit()
        if self._stray:
            raise hal.InvalidStateError(f"{len(self._stray)} mapping(s) of a failed resize still cannot be "
                                        "undone", backend=self.backend.name, call=f"ElasticBuffer.{call}")

    def _map_at(self, index: int) -> None:
        g = self.granularity
        self.backend.map(self.ptr + index * g, g, self._chunks[index])

    def _unmap_at(self, index: int) -> None:
        g = self.granularity
        self.backend.unmap(self.ptr + index * g, g)

    def _fill_holes(self, tx: Transaction) -> None:
        map_run(self.backend, self.ptr, self.granularity, self._chunks, tx, indices=list(self._holes),
                on_map=self._holes.discard, on_unmap=self._holes.add)

    def _grow(self, target: int) -> None:
        g = self.granularity
        made: list[Any] = []
        with self.pool._lock, Transaction() as tx:
            for index in range(len(self._chunks), target):
                ptr = self.ptr + index * g
                handle = self.pool._take_chunk()
                try:
                    self.backend.map(ptr, g, handle)
                except BaseException:
                    self.pool._free.append(handle)  # mapped nowhere: back to the free list
                    raise
                made.append(handle)
                tx.append(functools.partial(self._unmap_to_free, ptr, handle))
            tx.commit()
        self._chunks.extend(made)

    def _unmap_to_free(self, ptr: int, handle: Any) -> None:
        """Undo of a growth step: unmap, chunk back to the free list; a mapping that will not go is kept and retried."""
        stray = (ptr, handle)
        try:
            self.backend.unmap(ptr, self.granularity)
        except hal.HalError:
            if stray not in self._stray:
                self._stray.append(stray)
            raise
        if stray in self._stray:  # an earlier try recorded it
            self._stray.remove(stray)
        self.pool._free.append(handle)

    def _retry_strays(self) -> None:
        for ptr, handle in list(self._stray):
            try:
                self.backend.unmap(ptr, self.granularity)
            except hal.HalError as exc:
                log.error("elastic buffer: unmap at %#x failed (retried later): %s", ptr, str(exc))
                continue
            self._stray.remove((ptr, handle))
            with self.pool._lock:
                self.pool._free.append(handle)

    def _shrink(self, target: int) -> None:
        be, g = self.backend, self.granularity
        live = [end for ref, end in self._live_views() if end > target * g]  # whole-range views count 0
        if live:
            raise hal.InvalidStateError(
                f"a live view reaches {fmt_bytes(max(live))} into the buffer: shrinking to {fmt_bytes(target * g)} "
                "would leave it over unmapped memory; drop the view first", backend=be.name,
                call="ElasticBuffer.resize")
        with Transaction() as tx:
            self._unmap_from(target, tx)
            tx.commit()
        freed = self._chunks[target:]
        del self._chunks[target:]
        self._holes.difference_update(range(target, target + len(freed)))
        with self.pool._lock:
            self.pool._free.extend(reversed(freed))  # reused by the next growth
            if self._own_pool:  # nobody else draws from this free list: give the memory back now (never raises)
                self.pool.trim()

    def _unmap_from(self, first: int, tx: Transaction) -> None:
        """Unmap granules ``first ..`` of the prefix, last first; each is mapped back on rollback."""
        unmap_run(self.backend, self.ptr, self.granularity, self._chunks, tx,
                  indices=[i for i in range(first, len(self._chunks)) if i not in self._holes],
                  on_unmap=self._holes.add, on_map=self._holes.discard)

    def _live_views(self) -> list[tuple[weakref.ref, int]]:
        self._views = [(ref, end) for ref, end in self._views if ref() is not None]
        self._prune_at = max(64, 2 * len(self._views))
        return self._views

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
            if not isinstance(dtype, torch.dtype):
                raise hal.InvalidArgumentError(f"dtype={dtype!r} must be a torch.dtype", backend=be.name,
                                               call="ElasticBuffer.view")
            if not isinstance(shape, (tuple, list)) or any(not isinstance(d, int) or isinstance(d, bool) or d < 0
                                                            for d in shape):
                raise hal.InvalidArgumentError(f"shape={shape!r} must be a tuple of ints >= 0", backend=be.name,
                                               call="ElasticBuffer.view")
            _positive(offset, "offset", "ElasticBuffer.view", be.name, zero=True)
            try:
                itemsize = torch.empty((), dtype=dtype).element_size()
            except (RuntimeError, TypeError) as exc:
                raise hal.InvalidArgumentError(f"dtype={dtype} cannot view raw memory: {exc}", backend=be.name,
                                               call="ElasticBuffer.view") from None
            if offset % itemsize:
                raise hal.InvalidArgumentError(f"offset={offset} is not a multiple of {dtype}'s {itemsize} bytes",
                                               backend=be.name, call="ElasticBuffer.view")
            count = 1
            for d in shape:
                count *= d
            end = offset + count * itemsize
            limit = self.max_bytes if whole_range else self.mapped_bytes
            if end > limit:
                raise hal.InvalidArgumentError(
                    f"shape={tuple(shape)} of {dtype} at offset {offset} needs {end} bytes; "
                    f"{'the buffer holds' if whole_range else 'only'} {limit} are "
                    f"{'reserved' if whole_range else 'mapped (resize first)'}", backend=be.name,
                    call="ElasticBuffer.view")
            # the tensor's storage owns the token, and every view or slice of it shares that storage:
            # the token lives exactly as long as any of them, and keeps the buffer alive
            token = _ViewToken(self)
            raw = be.tensor_at(self.ptr + offset, end - offset, owner=token)
            try:
                tensor = raw.view(dtype).view(tuple(shape))
            except RuntimeError as exc:
                raise hal.InvalidArgumentError(f"dtype={dtype} cannot view raw memory: {exc}", backend=be.name,
                                               call="ElasticBuffer.view") from None
            if len(self._views) >= self._prune_at:  # drop dead entries now and then: the list stays short
                self._live_views()
            self._views.append((weakref.ref(token), 0 if whole_range else end))
            return tensor

    # -- sleep (through a MemorySaver) ---------------------------------------------------------

    def release_physical(self) -> int:
        """Back up (when made with ``backup``), unmap and release every chunk; the address stays. Idempotent.

        Returns the bytes released. A failed unmap maps back what this call
        unmapped (what will not map back leaves the buffer :attr:`paused`); a
        chunk whose release fails is kept and released later.
        """
        be = self.backend
        with self._lock:
            self._check("pause", awake=False)
            if self._sleeping and not self.mapped_bytes and all(h is None for h in self._chunks):
                return 0
            size = self.footprint_bytes
            if self.backup and size and not self._backed_up:
                if self._holes:
                    raise hal.InvalidStateError("part of the buffer is unmapped (a failed rollback): "
                                                "restore_physical() it before a pause can back it up",
                                                backend=be.name, call="ElasticBuffer.pause")
                pin = be.torch_device().type != "cpu"
                if self._host is None or self._host.numel() < size:
                    self._host = torch.empty(size, dtype=torch.uint8, pin_memory=pin)
                self._host[:size].copy_(be.tensor_at(self.ptr, size), non_blocking=pin)
                be.synchronize()
                self._backed_up = True
            was = self._sleeping
            self._sleeping = True
            try:
                with Transaction() as tx:
                    self._unmap_from(0, tx)
                    tx.commit()
            except BaseException:
                self._sleeping = was
                if not was and not self._holes:
                    self._backed_up = False  # awake again as it was
                raise
            released = 0
            for index, handle in enumerate(self._chunks):
                if handle is not None:
                    self._chunks[index] = None
                    if release_or_keep(be, handle, self.pool._zombies):
                        released += self.granularity
            return released

    def restore_physical(self, restore: bool = True) -> None:
        """Map fresh chunks at the same addresses and restore the backup (all or nothing). Idempotent.

        ``restore=False`` leaves the fresh memory as it is (the caller overwrites it).
        """
        be, g = self.backend, self.granularity
        with self._lock:
            self._check("resume", awake=False)
            if not self.paused:
                return
            self._retry_strays()
            with Transaction() as tx:
                for index, handle in enumerate(self._chunks):
                    if handle is None:
                        self._chunks[index] = be.create_phy_mem_handle(g)
                        tx.append(functools.partial(self._drop_chunk, index))
                self._fill_holes(tx)
                if restore and self.backup and self._backed_up and self._chunks:
                    size = self.footprint_bytes
                    assert self._host is not None
                    be.tensor_at(self.ptr, size).copy_(self._host[:size], non_blocking=True)
                    be.synchronize()
                tx.commit()
            self._sleeping = False
            self._backed_up = False

    def _drop_chunk(self, index: int) -> None:
        """Undo of a chunk made by a restore: released, unless a mapping that would not go still uses it."""
        if index not in self._holes:
            return
        handle, self._chunks[index] = self._chunks[index], None
        release_or_keep(self.backend, handle, self.pool._zombies)

    # -- teardown ---------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Unmap everything (chunks go back to the pool's free list), give the range back. Idempotent.

        Goes on past failures and raises the first; ``close()`` again finishes.

        :raises hal.InvalidStateError: a view of the buffer is still alive.
        """
        be = self.backend
        with self._lock:
            if self._closed:
                if self._own_pool and not self.pool.closed:
                    self.pool.close()
                return
            if self._live_views():
                raise hal.InvalidStateError(f"{len(self._views)} view(s) of the buffer are still alive: drop them "
                                            "before closing", backend=be.name, call="ElasticBuffer.close")
            errors: list[BaseException] = []
            self._retry_strays()
            for index in reversed(range(len(self._chunks))):
                handle = self._chunks[index]
                if index not in self._holes:
                    try:
                        self._unmap_at(index)
                    except hal.HalError as exc:
                        errors.append(exc)
                        continue
                    self._holes.add(index)
                if handle is not None:
                    self._chunks[index] = None
                    with self.pool._lock:
                        self.pool._free.append(handle)
            if self._stray and not errors:
                errors.append(hal.InvalidStateError(f"{len(self._stray)} mapping(s) would not unmap",
                                                    backend=be.name, call="ElasticBuffer.close"))
            if errors:
                log.error("ElasticBuffer.close: %d unmap(s) failed; close() again to finish: %s", len(errors),
                          str(errors[0]))
                raise errors[0]
            del self._chunks[:]
            self._holes.clear()
            self._finalizer.detach()
            if self.saver is not None:
                self.saver.forget(self)
            self._closed = True
            with self.pool._lock:
                self.pool._arena.give(self.ptr, self.max_bytes)
                self.pool._buffers.discard(self)
            log.debug("elastic buffer at %#x closed", self.ptr)
            if self._own_pool:
                self.pool.close()


def __getattr__(name: str) -> Any:
    if name == "ElasticPool":
        renamed("graphkit.ElasticPool", "graphkit.ElasticReservation")
        return ElasticReservation
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
