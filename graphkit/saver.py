"""MemorySaver: give device memory back while another job runs, return at the same addresses.

RL post-training runs the rollout engine and the trainer on the same
devices: the engine pauses, the trainer runs, the engine resumes with its
weights, KV cache and captured graphs intact. A pause unmaps and releases
the physical memory and keeps every virtual range; a resume maps new
memory at the same addresses, so pointers baked into graphs stay valid.

>>> saver = graphkit.MemorySaver(be)
>>> with saver.region("weights", backup=True):   # tensors made here live in graphkit memory
...     weights = load_weights()
>>> with saver.region("kv_cache"):
...     kv = torch.empty(...)
>>> pools = graphkit.GraphPools(be, saver=saver)   # graph memory sleeps too, tag "graphs"
>>> saver.pause()            # every tag; weights copied to host first
>>> saver.resume()           # same addresses; weights bit-exact; graphs replay as captured

What the library cannot see: a tensor of a paused region touched by user code
reads unmapped memory -- a device fault on a GPU, a segmentation fault on
``fake`` -- as with any sleep mode over virtual memory.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

import hal
from graphkit.allocator import SharedVMMAllocator, _Undo
from hal.types import fmt_bytes, round_up

log = logging.getLogger("graphkit.saver")

GRAPHS = "graphs"


@dataclass(eq=False)
class _Segment:
    """One segment handed to the framework: its own range and, while awake, its own chunk."""

    ptr: int
    size: int
    handle: Any = None  # its chunk; None once released while paused
    mapped: bool = True


@dataclass(eq=False)
class _Region:
    """The memory of one tag made through :meth:`MemorySaver.region`."""

    tag: str
    backup: bool
    pool: Any = None
    segments: dict[int, _Segment] = field(default_factory=dict)
    host: dict[int, torch.Tensor] = field(default_factory=dict)  # segment ptr -> backup, reused every pause


@dataclass
class TagReport:
    """The state of one tag."""

    tag: str
    paused: bool
    backup: bool
    bytes: int  # virtual bytes the tag covers (its physical memory while awake)
    host_bytes: int  # host memory holding its backup
    last_pause_s: float | None = None
    last_resume_s: float | None = None


class MemorySaver:
    """Tags of device memory that pause (release physical memory) and resume (at the same addresses).

    :param backend: a :class:`hal.Backend` (default ``hal.get_backend()``, then owned).
    :param pin_backups: keep backups in pinned host memory where the device
        has it (the copies then run at the bus's speed); ``False`` for
        pageable memory.
    """

    def __init__(self, backend: hal.Backend | None = None, *, pin_backups: bool = True) -> None:
        self._owns_backend = backend is None
        self.backend = backend if backend is not None else hal.get_backend(
            requires=("graphs", "custom_pool", "use_pool"))  # regions need pools the framework allocates from
        self.pin_backups = pin_backups
        self._lock = threading.RLock()
        self._regions: dict[str, _Region] = {}
        self._allocators: dict[str, list[Any]] = {}  # tag -> graphkit objects that sleep (allocators, buffers)
        self._paused: set[str] = set()
        self._times: dict[str, tuple[float | None, float | None]] = {}
        self._zombies: list[Any] = []  # chunks whose release failed in a rollback: released later
        self._closed = False

    # -- tags -------------------------------------------------------------------------------

    def _bad(self, message: str, call: str) -> hal.InvalidArgumentError:
        return hal.InvalidArgumentError(message, backend=self.backend.name, call=f"MemorySaver.{call}")

    def _check_tag(self, tag: Any, call: str) -> str:
        if not isinstance(tag, str) or not tag:
            raise self._bad(f"tag={tag!r} must be a non-empty str", call)
        return tag

    @contextlib.contextmanager
    def region(self, tag: str, backup: bool = False) -> Iterator[None]:
        """Framework allocations made inside the block (this thread) live in memory of ``tag``.

        :param backup: copy the tag's bytes to the host on pause and back on
            resume (weights); without it a resumed tag holds garbage (a KV
            cache, activations).
        :raises hal.UnsupportedError: the backend cannot direct the
            framework's allocations to a pool (capability ``"use_pool"``,
            e.g. torch_mlu); graphkit's own memory still sleeps there.
        """
        tag = self._check_tag(tag, "region")
        with self._lock:
            self._check_open("region")
            if tag in self._allocators:
                raise self._bad(f"tag={tag!r} already holds graph memory; use another tag", "region")
            if not self.backend.supports("use_pool") or not self.backend.supports("custom_pool"):
                raise hal.UnsupportedError(
                    "regions need pools over allocator callbacks that the framework allocates from "
                    "(capabilities 'custom_pool' and 'use_pool')", backend=self.backend.name, call="MemorySaver.region")
            region = self._regions.get(tag)
            if region is None:
                region = self._regions[tag] = _Region(tag, backup)
                region.pool = self.backend.create_pool(lambda n: self._alloc(region, n),
                                                       lambda p, n: self._free(region, p))
            elif region.backup != backup:
                raise self._bad(f"tag={tag!r} was made with backup={region.backup}", "region")
            if tag in self._paused:
                raise hal.InvalidStateError(f"tag {tag!r} is paused: resume it before allocating in it",
                                            backend=self.backend.name, call="MemorySaver.region")
        with self.backend.use_pool(region.pool):
            yield

    def _alloc(self, region: _Region, nbytes: int) -> int:
        """A segment of its own for the framework: a range, one chunk, mapped (all or nothing)."""
        be = self.backend
        with self._lock:
            if region.tag in self._paused:
                raise hal.InvalidStateError(f"tag {region.tag!r} is paused", backend=be.name, call="MemorySaver")
            size = round_up(max(nbytes, 1), be.granularity)
            self._retry_zombies()
            undo = _Undo()
            try:
                ptr = be.create_vir_ptr(size)
                undo.push("release range", lambda: be.release_vir_ptr(ptr, size))
                handle = be.create_phy_mem_handle(size)
                undo.push("release chunk", lambda: self._release_or_keep(handle))
                be.map(ptr, size, handle)
            except BaseException:
                undo.run()
                raise
            region.segments[ptr] = _Segment(ptr, size, handle, mapped=True)
            return ptr

    def _release_or_keep(self, handle: Any) -> None:
        """Release a chunk mapped nowhere; one whose release fails is kept and retried later, never lost."""
        try:
            self.backend.release_phy_mem_handle(handle)
        except hal.HalError:
            self._zombies.append(handle)
            raise

    def _retry_zombies(self) -> None:
        zombies, self._zombies = self._zombies, []
        for handle in zombies:
            try:
                self.backend.release_phy_mem_handle(handle)
            except hal.HalError as exc:
                log.warning("a chunk could not be released yet (will retry): %s", str(exc))
                self._zombies.append(handle)

    def _free(self, region: _Region, ptr: int) -> None:
        be = self.backend
        with self._lock:
            segment = region.segments.pop(ptr, None)
            region.host.pop(ptr, None)
            if segment is None or be.closed:
                return
            if segment.mapped:
                be.unmap(segment.ptr, segment.size)
            if segment.handle is not None:
                be.release_phy_mem_handle(segment.handle)
            be.release_vir_ptr(segment.ptr, segment.size)

    def adopt(self, allocator: Any, tag: str = GRAPHS) -> None:
        """Put graphkit's own memory under ``tag``: a :class:`SharedVMMAllocator` (graph memory, no
        backup) or an :class:`graphkit.ElasticBuffer` (backed up if it was made with ``backup``)."""
        tag = self._check_tag(tag, "adopt")
        with self._lock:
            self._check_open("adopt")
            if tag in self._regions:
                raise self._bad(f"tag={tag!r} is a region; graph memory needs a tag of its own", "adopt")
            if tag in self._paused and not allocator.paused:
                allocator.release_physical()
            self._allocators.setdefault(tag, []).append(allocator)

    def forget(self, allocator: Any) -> None:
        """Stop managing ``allocator`` (its owner closes it)."""
        with self._lock:
            for _tag, allocators in list(self._allocators.items()):
                if allocator in allocators:
                    allocators.remove(allocator)

    def check_awake(self, tag: str, call: str) -> None:
        """Raise :class:`hal.InvalidStateError` when ``tag`` is paused (before a replay or an allocation)."""
        if tag in self._paused:
            raise hal.InvalidStateError(f"tag {tag!r} is paused: resume it first", backend=self.backend.name,
                                        call=call)

    @property
    def tags(self) -> list[str]:
        return [*self._regions, *self._allocators]

    def is_paused(self, tag: str) -> bool:
        return tag in self._paused

    def _select(self, tags: tuple[str, ...], call: str) -> list[str]:
        known = self.tags
        unknown = [t for t in tags if t not in known]
        if unknown:
            raise self._bad(f"tags {unknown!r} are unknown (known: {known!r})", call)
        return list(tags) if tags else known

    # -- pause and resume --------------------------------------------------------------------

    def pause(self, *tags: str) -> int:
        """Release the physical memory of ``tags`` (all when none), backing up those made with backup.

        Idempotent per tag. Returns the bytes released. Framework tensors of
        a paused tag must not be touched until it resumes.
        """
        with self._lock:
            self._check_open("pause")
            released = 0
            self.backend.synchronize()
            selected = self._select(tags, "pause")
            if GRAPHS in selected and GRAPHS not in self._paused:
                _warn_nccl_graph_register()
            for tag in selected:
                if tag in self._paused:
                    continue
                t0 = time.perf_counter()
                if tag in self._regions:
                    released += self._pause_region(self._regions[tag])
                else:
                    for alloc in self._allocators[tag]:
                        released += alloc.release_physical()
                self._paused.add(tag)
                self._times[tag] = (time.perf_counter() - t0, self._times.get(tag, (None, None))[1])
                log.info("paused %r: %s released", tag, fmt_bytes(released))
            return released

    def _pause_region(self, region: _Region) -> int:
        be = self.backend
        segments = [s for s in region.segments.values() if s.mapped]
        if region.backup:  # every copy first, then every unmap: a copy must never race its unmap
            pin = self.pin_backups and be.torch_device().type != "cpu"
            for s in segments:
                host = region.host.get(s.ptr)
                if host is None or host.numel() != s.size:
                    host = region.host[s.ptr] = torch.empty(s.size, dtype=torch.uint8, pin_memory=pin)
                host.copy_(be.tensor_at(s.ptr, s.size), non_blocking=pin)
            be.synchronize()
        undo = _Undo()
        try:
            for s in segments:
                be.unmap(s.ptr, s.size)
                s.mapped = False

                def remap(s: _Segment = s) -> None:
                    be.map(s.ptr, s.size, s.handle)
                    s.mapped = True
                undo.push("remap", remap)
        except BaseException:
            undo.run()
            raise
        released = 0
        for s in segments:
            try:
                be.release_phy_mem_handle(s.handle)
            except hal.HalError as exc:  # unmapped already: the chunk is kept and mapped again on resume
                log.error("pause %r: a chunk could not be released (kept for the resume): %s", region.tag, str(exc))
                continue
            s.handle = None
            released += s.size
        return released

    def resume(self, *tags: str) -> None:
        """Map new physical memory at the same addresses for ``tags`` (all when none); restore backups.

        Idempotent per tag. All or nothing per tag: a failure (out of
        memory, a driver fault) releases what it made, the tag stays paused,
        and resume can be called again.
        """
        with self._lock:
            self._check_open("resume")
            for tag in self._select(tags, "resume"):
                if tag not in self._paused:
                    continue
                t0 = time.perf_counter()
                if tag in self._regions:
                    self._resume_region(self._regions[tag])
                else:
                    done: list[SharedVMMAllocator] = []
                    try:
                        for alloc in self._allocators[tag]:
                            alloc.restore_physical()
                            done.append(alloc)
                    except BaseException:
                        for alloc in done:
                            alloc.release_physical()
                        raise
                self._paused.discard(tag)
                self._times[tag] = (self._times.get(tag, (None, None))[0], time.perf_counter() - t0)
            self.backend.synchronize()

    def _resume_region(self, region: _Region) -> None:
        be = self.backend
        undo = _Undo()
        try:
            for s in region.segments.values():
                if s.mapped:
                    continue
                if s.handle is None:  # released at the pause: a fresh chunk
                    handle = be.create_phy_mem_handle(s.size)

                    def release_chunk(s: _Segment = s, h: Any = handle) -> None:
                        be.release_phy_mem_handle(h)
                        s.handle = None
                    undo.push("release chunk", release_chunk)
                    s.handle = handle
                be.map(s.ptr, s.size, s.handle)
                s.mapped = True

                def unmap(s: _Segment = s) -> None:
                    be.unmap(s.ptr, s.size)
                    s.mapped = False
                undo.push("unmap", unmap)
            if region.backup:
                for s in region.segments.values():
                    host = region.host.get(s.ptr)
                    if host is not None:
                        be.tensor_at(s.ptr, s.size).copy_(host, non_blocking=True)
                be.synchronize()
        except BaseException:
            undo.run()
            raise

    # -- figures and teardown -----------------------------------------------------------------

    def report(self) -> list[TagReport]:
        """Each tag: paused or not, its bytes, its host backup, the last pause and resume seconds."""
        with self._lock:
            out = []
            for tag in self.tags:
                pause_s, resume_s = self._times.get(tag, (None, None))
                if tag in self._regions:
                    region = self._regions[tag]
                    size = sum(s.size for s in region.segments.values())
                    host = sum(h.numel() for h in region.host.values())
                    out.append(TagReport(tag, tag in self._paused, region.backup, size, host, pause_s, resume_s))
                else:
                    sleepers = self._allocators[tag]
                    size = sum(a.footprint_bytes for a in sleepers)
                    backup = any(getattr(a, "backup", False) for a in sleepers)
                    out.append(TagReport(tag, tag in self._paused, backup, size, 0, pause_s, resume_s))
            return out

    def _check_open(self, call: str) -> None:
        if self._closed:
            raise hal.InvalidStateError("the MemorySaver is closed", backend=self.backend.name,
                                        call=f"MemorySaver.{call}")

    def close(self) -> None:
        """Resume nothing; release the regions' pools (their memory goes when the framework frees it). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for region in self._regions.values():
                self.backend.release_pool(region.pool)
            self._retry_zombies()
            self._allocators.clear()
            if self._owns_backend:
                self.backend.close()

    def __enter__(self) -> MemorySaver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _nccl_graph_register_hazard() -> str | None:
    """Why sleeping graph memory may break NCCL collectives captured in graphs, or None.

    With ``NCCL_GRAPH_REGISTER`` on (NCCL's default), a collective captured in
    a graph registers its buffers by virtual address and keeps the physical
    pages they had at capture; a resume maps other pages at that address.
    """
    import os

    if os.environ.get("NCCL_GRAPH_REGISTER", "1") == "0":
        return None
    try:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return None
        uses_nccl = "nccl" in str(dist.get_backend()).lower()
    except (ImportError, RuntimeError, ValueError):
        return None
    if not uses_nccl:
        return None
    return ("pausing graph memory while torch.distributed uses NCCL with NCCL_GRAPH_REGISTER on: collectives "
            "captured in these graphs may keep moving data through the pages released now; set "
            "NCCL_GRAPH_REGISTER=0 before the graphs are captured (as vLLM does for its sleep mode)")


_nccl_warned = False


def _warn_nccl_graph_register() -> None:
    """Log the NCCL graph-registration hazard once per process, where it applies."""
    global _nccl_warned
    why = None if _nccl_warned else _nccl_graph_register_hazard()
    if why is not None:
        _nccl_warned = True
        log.warning("%s", why)
