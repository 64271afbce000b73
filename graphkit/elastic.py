"""Elastic device buffers: reserve the maximum once, back it with physical chunks as it grows.

A KV cache that follows the load: one contiguous virtual range whose
address never moves (kernels and captured graphs keep using it), mapped
granule by granule at its end as it grows, unmapped as it shrinks. Growth
copies nothing.

>>> kv = graphkit.ElasticBuffer(be, max_bytes=64 << 30)
>>> kv.resize(2 << 30)                       # map 2 GiB at the start of the range
>>> cache = kv.view(torch.bfloat16, (n, 16, 8, 128))
>>> kv.resize(4 << 30)                       # same kv.ptr, cache's data untouched

Many ranges, vAttention style: an :class:`ElasticPool` carves ranges out of
one reservation and keeps a free list of pre-created chunks, so growth costs
a map call, not a driver allocation.
"""

from __future__ import annotations

import functools
import logging
import threading
import weakref
from typing import Any

import torch

import hal
from graphkit.allocator import _Arena, _Undo
from hal.types import fmt_bytes, round_up

log = logging.getLogger("graphkit.elastic")


def _positive(value: Any, name: str, call: str, backend: str, zero: bool = False) -> int:
    if (not isinstance(value, int) or isinstance(value, bool) or value < 0 or (value == 0 and not zero)
            or value >= 1 << 64):
        raise hal.InvalidArgumentError(f"{name}={value!r} must be a{'n' if zero else ' positive'} int"
                                       f"{' >= 0' if zero else ''} of bytes", backend=backend, call=call)
    return value


class ElasticPool:
    """One reservation carved into elastic ranges, and physical chunks they share through a free list.

    :param backend: a :class:`hal.Backend` (default ``hal.get_backend()``, then owned).
    :param reserve_bytes: virtual bytes for all the ranges together.
    :param precreate_bytes: physical memory created up front into the free
        list (growth then costs a map call); more can be added with
        :meth:`precreate`, and :meth:`trim` releases what is free.
    """

    def __init__(self, backend: hal.Backend | None = None, reserve_bytes: int = 0, *,
                 precreate_bytes: int = 0) -> None:
        self._owns_backend = backend is None
        self.backend = be = backend if backend is not None else hal.get_backend(requires=("graphs",))
        _positive(reserve_bytes, "reserve_bytes", "ElasticPool", be.name)
        _positive(precreate_bytes, "precreate_bytes", "ElasticPool", be.name, zero=True)
        self.granularity = g = be.granularity
        self.reserve_bytes = round_up(reserve_bytes, g)
        self._lock = threading.RLock()
        self.base = be.create_vir_ptr(self.reserve_bytes)
        self._arena = _Arena(self.base, self.reserve_bytes)
        self._free: list[Any] = []  # pre-created chunks, mapped nowhere
        self._buffers: weakref.WeakSet[ElasticBuffer] = weakref.WeakSet()
        self.created = 0  # chunks created over the pool's life (growth that paid a driver allocation)
        self._closed = False
        try:
            self.precreate(precreate_bytes)
        except BaseException:
            be.release_vir_ptr(self.base, self.reserve_bytes)
            raise

    @property
    def free_bytes(self) -> int:
        """Physical bytes pre-created and not mapped anywhere."""
        return len(self._free) * self.granularity

    def precreate(self, nbytes: int) -> None:
        """Create chunks for ``nbytes`` into the free list (all or nothing)."""
        with self._lock:
            self._check_open("precreate")
            undo = _Undo()
            made = []
            try:
                for _ in range(-(-nbytes // self.granularity)):
                    handle = self.backend.create_phy_mem_handle(self.granularity)
                    undo.push("release", functools.partial(self.backend.release_phy_mem_handle, handle))
                    made.append(handle)
            except BaseException:
                undo.run()
                raise
            self._free.extend(made)
            self.created += len(made)

    def trim(self) -> int:
        """Release the free list's chunks; return the bytes released."""
        with self._lock:
            released = 0
            while self._free:
                self.backend.release_phy_mem_handle(self._free[-1])
                self._free.pop()
                released += self.granularity
            return released

    def buffer(self, max_bytes: int, **options: Any) -> ElasticBuffer:
        """A new elastic range of up to ``max_bytes`` out of this pool's reservation."""
        return ElasticBuffer(self.backend, max_bytes, pool=self, **options)

    def _carve(self, size: int) -> int:
        with self._lock:
            self._check_open("buffer")
            start = self._arena.take(size)
            if start is None:
                raise hal.DeviceOutOfMemoryError(
                    f"no {fmt_bytes(size)} range left in the pool's reservation of {fmt_bytes(self.reserve_bytes)}",
                    backend=self.backend.name, call="ElasticPool.buffer")
            return start

    def _take_chunk(self, undo: _Undo) -> Any:
        if self._free:
            handle = self._free.pop()
            undo.push("back to the free list", lambda: self._free.append(handle))
            return handle
        handle = self.backend.create_phy_mem_handle(self.granularity)
        self.created += 1
        undo.push("release", lambda: self.backend.release_phy_mem_handle(handle))
        return handle

    def _check_open(self, call: str) -> None:
        if self._closed:
            raise hal.InvalidStateError("the pool is closed", backend=self.backend.name, call=f"ElasticPool.{call}")

    def close(self) -> None:
        """Close every buffer, release the free list and the reservation. Idempotent."""
        with self._lock:
            if self._closed:
                return
            for buf in list(self._buffers):
                buf.close()
            self.trim()
            self.backend.release_vir_ptr(self.base, self.reserve_bytes)
            self._closed = True
            if self._owns_backend:
                self.backend.close()

    def __enter__(self) -> ElasticPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _ViewToken:
    """Owned by the storage of one view: alive while the view or any slice of it is."""

    __slots__ = ("__weakref__", "buffer")

    def __init__(self, buffer: ElasticBuffer) -> None:
        self.buffer = buffer


class ElasticBuffer:
    """A virtual range of ``max_bytes`` whose prefix is backed by physical memory as it grows.

    :param backend: a :class:`hal.Backend` (default ``hal.get_backend()``, then owned).
    :param max_bytes: the most it can grow to (rounded up to the granularity).
    :param pool: carve the range out of this :class:`ElasticPool` and grow
        from its free list (default: a reservation of its own).
    :param saver: a :class:`graphkit.MemorySaver` to pause and resume with,
        under ``tag`` (default ``"kv_cache"``), with ``backup`` or not.

    Shrinking below a live view (or a slice of one) raises
    :class:`hal.InvalidStateError`: the view would read unmapped memory.
    Drop the view first. Views made with ``whole_range=True`` promise to
    read only what is mapped, so they do not stop a shrink; any live view
    stops :meth:`close`.
    """

    def __init__(self, backend: hal.Backend | None = None, max_bytes: int = 0, *, pool: ElasticPool | None = None,
                 saver: Any = None, tag: str = "kv_cache", backup: bool = False) -> None:
        if pool is not None and backend is not None and pool.backend is not backend:
            raise hal.InvalidArgumentError("pool= belongs to another backend", backend=backend.name,
                                           call="ElasticBuffer")
        be = pool.backend if pool is not None else (
            backend if backend is not None else hal.get_backend(requires=("graphs",)))  # views are tensors
        _positive(max_bytes, "max_bytes", "ElasticBuffer", be.name)
        self._own_pool = pool is None
        self.pool = pool if pool is not None else ElasticPool(be, max_bytes)
        if self._own_pool and backend is None:
            self.pool._owns_backend = True
        self.backend = be
        self.granularity = g = be.granularity
        self.capacity = round_up(max_bytes, g)
        self.ptr = self.pool._carve(self.capacity)
        self._chunks: list[Any] = []  # chunk i mapped at ptr + i * granularity
        self._stray: list[tuple[int, Any]] = []  # mappings a failed rollback could not undo yet
        self._lock = threading.RLock()
        self._views: list[tuple[weakref.ref, int]] = []  # (view, end offset)
        self._paused_chunks: int | None = None
        self._host: torch.Tensor | None = None
        self.backup = backup
        self.saver = saver
        self._closed = False
        self.pool._buffers.add(self)
        if saver is not None:
            saver.adopt(self, tag)

    # -- figures ------------------------------------------------------------------------

    @property
    def mapped_bytes(self) -> int:
        """Bytes backed by physical memory now (a prefix of the range)."""
        return len(self._chunks) * self.granularity

    physical_bytes = mapped_bytes

    @property
    def footprint_bytes(self) -> int:
        """Bytes it holds while awake (what a pause releases)."""
        return (self._paused_chunks if self._paused_chunks is not None else len(self._chunks)) * self.granularity

    @property
    def paused(self) -> bool:
        return self._paused_chunks is not None

    def __repr__(self) -> str:
        return (f"<graphkit.ElasticBuffer {self.backend.name} at {self.ptr:#x} mapped {fmt_bytes(self.mapped_bytes)} "
                f"of {fmt_bytes(self.capacity)}{' paused' if self.paused else ''}>")

    def _check(self, call: str, awake: bool = True) -> None:
        if self._closed:
            raise hal.InvalidStateError("the buffer is closed", backend=self.backend.name, call=f"ElasticBuffer.{call}")
        if awake and self._paused_chunks is not None:
            raise hal.InvalidStateError("the buffer is paused: resume it first", backend=self.backend.name,
                                        call=f"ElasticBuffer.{call}")

    # -- growing and shrinking ---------------------------------------------------------

    def resize(self, nbytes: int) -> None:
        """Map or unmap whole granules at the end so that ``nbytes`` are backed (rounded up).

        :raises hal.InvalidArgumentError: ``nbytes`` is not an int in ``[0, capacity]``.
        :raises hal.InvalidStateError: shrinking below a live view.
        """
        be = self.backend
        with self._lock:
            self._check("resize")
            _positive(nbytes, "nbytes", "ElasticBuffer.resize", be.name, zero=True)
            if nbytes > self.capacity:
                raise hal.InvalidArgumentError(f"nbytes={nbytes} exceeds the buffer's max_bytes {self.capacity}",
                                               backend=be.name, call="ElasticBuffer.resize")
            target = -(-nbytes // self.granularity)
            self._retry_strays()
            if self._stray:
                raise hal.InvalidStateError(f"{len(self._stray)} mapping(s) of a failed resize still cannot be "
                                            "undone", backend=be.name, call="ElasticBuffer.resize")
            if target > len(self._chunks):
                self._grow(target)
            elif target < len(self._chunks):
                self._shrink(target)

    def _grow(self, target: int) -> None:
        be, g = self.backend, self.granularity
        start = len(self._chunks)
        made: list[Any] = []
        with self.pool._lock:
            try:
                for index in range(start, target):
                    handle = self.pool._take_chunk(_Undo())
                    try:
                        be.map(self.ptr + index * g, g, handle)
                    except BaseException:
                        self.pool._free.append(handle)  # unmapped: back to the free list
                        raise
                    made.append(handle)
            except BaseException:
                # all or nothing: unmap what this call mapped; a chunk that will not unmap is kept
                # as a stray mapping and unmapped again at the next resize or close
                for index, handle in reversed(list(enumerate(made, start))):
                    self._unmap_or_keep(self.ptr + index * g, handle)
                raise
        self._chunks.extend(made)

    def _unmap_or_keep(self, ptr: int, handle: Any) -> None:
        try:
            self.backend.unmap(ptr, self.granularity)
        except hal.HalError as exc:
            log.error("elastic buffer: unmap at %#x failed (retried later): %s", ptr, str(exc))
            self._stray.append((ptr, handle))
            return
        self.pool._free.append(handle)

    def _retry_strays(self) -> None:
        strays, self._stray = self._stray, []
        for ptr, handle in strays:
            self._unmap_or_keep(ptr, handle)

    def _shrink(self, target: int) -> None:
        be, g = self.backend, self.granularity
        live = [end for ref, end in self._live_views() if end > target * g]  # whole-range views count 0
        if live:
            raise hal.InvalidStateError(
                f"a live view reaches {fmt_bytes(max(live))} into the buffer: shrinking to {fmt_bytes(target * g)} "
                "would leave it over unmapped memory; drop the view first", backend=be.name,
                call="ElasticBuffer.resize")
        undo = _Undo()
        try:
            for index in reversed(range(target, len(self._chunks))):
                handle = self._chunks[index]
                be.unmap(self.ptr + index * g, g)
                undo.push("remap", functools.partial(be.map, self.ptr + index * g, g, handle))
        except BaseException:
            undo.run()
            raise
        with self.pool._lock:
            self.pool._free.extend(reversed(self._chunks[target:]))  # reused by the next growth
        del self._chunks[target:]
        if self._own_pool:  # nobody else draws from this free list: give the memory back now
            self.pool.trim()

    def _live_views(self) -> list[tuple[weakref.ref, int]]:
        self._views = [(ref, end) for ref, end in self._views if ref() is not None]
        return self._views

    # -- framework views ------------------------------------------------------------------

    def view(self, dtype: torch.dtype, shape: tuple[int, ...] | list[int], offset: int = 0, *,
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
            itemsize = torch.empty((), dtype=dtype).element_size()
            if offset % itemsize:
                raise hal.InvalidArgumentError(f"offset={offset} is not a multiple of {dtype}'s {itemsize} bytes",
                                               backend=be.name, call="ElasticBuffer.view")
            count = 1
            for d in shape:
                count *= d
            end = offset + count * itemsize
            limit = self.capacity if whole_range else self.mapped_bytes
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
            self._views.append((weakref.ref(token), 0 if whole_range else end))
            return raw.view(dtype).view(tuple(shape))

    # -- sleep (through a MemorySaver) ---------------------------------------------------------

    def release_physical(self) -> int:
        """Back up (when made with ``backup``), unmap and release every chunk; the address stays. Idempotent."""
        be, g = self.backend, self.granularity
        with self._lock:
            self._check("pause", awake=False)
            if self._paused_chunks is not None:
                return 0
            size = self.mapped_bytes
            if self.backup and size:
                pin = be.torch_device().type != "cpu"
                if self._host is None or self._host.numel() < size:
                    self._host = torch.empty(size, dtype=torch.uint8, pin_memory=pin)
                self._host[:size].copy_(be.tensor_at(self.ptr, size), non_blocking=pin)
                be.synchronize()
            undo = _Undo()
            try:
                for index in reversed(range(len(self._chunks))):
                    handle = self._chunks[index]
                    be.unmap(self.ptr + index * g, g)
                    undo.push("remap", functools.partial(be.map, self.ptr + index * g, g, handle))
            except BaseException:
                undo.run()
                raise
            for handle in self._chunks:
                be.release_phy_mem_handle(handle)
            self._paused_chunks, self._chunks = len(self._chunks), []
            return size

    def restore_physical(self) -> None:
        """Map fresh chunks at the same addresses and restore the backup (all or nothing). Idempotent."""
        be, g = self.backend, self.granularity
        with self._lock:
            self._check("resume", awake=False)
            if self._paused_chunks is None:
                return
            undo = _Undo()
            made = []
            try:
                for index in range(self._paused_chunks):
                    handle = be.create_phy_mem_handle(g)
                    undo.push("release", functools.partial(be.release_phy_mem_handle, handle))
                    be.map(self.ptr + index * g, g, handle)
                    undo.push("unmap", functools.partial(be.unmap, self.ptr + index * g, g))
                    made.append(handle)
            except BaseException:
                undo.run()
                raise
            self._chunks, self._paused_chunks = made, None
            if self.backup and self._host is not None and self.mapped_bytes:
                be.tensor_at(self.ptr, self.mapped_bytes).copy_(self._host[: self.mapped_bytes], non_blocking=True)
                be.synchronize()

    # -- teardown ---------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Unmap everything (chunks go back to the pool's free list), give the range back. Idempotent.

        :raises hal.InvalidStateError: a view of the buffer is still alive.
        """
        be = self.backend
        with self._lock:
            if self._closed:
                return
            if self._live_views():
                raise hal.InvalidStateError(f"{len(self._views)} view(s) of the buffer are still alive: drop them "
                                            "before closing", backend=be.name, call="ElasticBuffer.close")
            if self._paused_chunks is None:
                self._shrink(0)
            self._retry_strays()
            if self.saver is not None:
                self.saver.forget(self)
            self._closed = True
            with self.pool._lock:
                self.pool._arena.give(self.ptr, self.capacity)
            self.pool._buffers.discard(self)
            if self._own_pool:
                self.pool.close()
            log.debug("elastic buffer at %#x closed", self.ptr)
            del be

    def __enter__(self) -> ElasticBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
