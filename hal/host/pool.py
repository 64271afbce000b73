"""A caching block allocator over segments, the way torch's device pools work.

Segments come from a source (the device's own allocator, or the allocator
callbacks of a custom pool). Every block is rounded up to
:data:`hal.types.ALLOCATION_ALIGNMENT` bytes; a segment is the block rounded
up to ``segment_size`` (the device's granularity). Blocks freed go back to
the pool's free list (best fit, neighbours coalesce) and are reused by later
allocations of the same pool, inside one capture and across captures: so a
pool shared by several captures reuses the dead intermediates of earlier
graphs, exactly the behaviour whose memory the benchmarks compare.
Segments go back to their source only when the pool is released; one that
still holds a live block then goes back when that block is freed.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable

from hal.errors import DeviceOutOfMemoryError, InvalidStateError
from hal.types import ALLOCATION_ALIGNMENT, fmt_bytes, round_up

BLOCK_ROUND = ALLOCATION_ALIGNMENT
"""Every block is a multiple of this (as in torch's caching allocator)."""


class BlockPool:
    """Best-fit caching allocator over segments obtained from ``source_alloc``.

    :param source_alloc: ``alloc(nbytes) -> address`` of a new segment; 0 or a
        raised error when there is no memory (the pool then raises
        :class:`hal.DeviceOutOfMemoryError`, keeping the reason).
    :param source_free: ``free(address, nbytes)``, called once per segment.
    :param segment_size: segments are multiples of it.
    :param name: for messages; ``backend`` names the backend in errors.
    """

    def __init__(
        self,
        source_alloc: Callable[[int], int],
        source_free: Callable[[int, int], None],
        segment_size: int = 2 << 20,
        name: str = "pool",
        backend: str = "host",
    ) -> None:
        self._alloc = source_alloc
        self._free = source_free
        self.segment_size = segment_size
        self.name = name
        self.backend = backend
        self._lock = threading.Lock()
        self.segments: dict[int, int] = {}  # base -> size
        self._free_blocks: list[tuple[int, int, int]] = []  # (size, ptr, segment base), sorted
        self._used: dict[int, tuple[int, int]] = {}  # ptr -> (size, segment base)
        self._released = False
        self.on_malloc: Callable[[int, int], None] | None = None
        """Told ``(address, nbytes)`` of each block handed out, after :meth:`malloc` (a device that runs behind
        the host counts the block as in use by queued work: :class:`hal.host.inflight.InFlight`)."""

    # -- allocation ---------------------------------------------------------

    def malloc(self, nbytes: int) -> int:
        """Return the address of a block of at least ``nbytes`` bytes."""
        size = round_up(max(nbytes, 1), BLOCK_ROUND)
        with self._lock:
            if self._released:
                raise InvalidStateError(f"{self.name}: the pool was released", backend=self.backend, call="malloc")
            i = bisect.bisect_left(self._free_blocks, (size, 0, 0))
            if i == len(self._free_blocks):
                seg_size = round_up(size, self.segment_size)
                try:
                    base = self._alloc(seg_size)
                except DeviceOutOfMemoryError:
                    raise
                except Exception as exc:
                    raise DeviceOutOfMemoryError(f"{self.name}: segment allocation failed: {exc}",
                                                 backend=self.backend, call="malloc") from exc
                if not base:
                    raise DeviceOutOfMemoryError(
                        f"{self.name}: no memory for a segment of {fmt_bytes(seg_size)} "
                        f"(block of {fmt_bytes(size)} requested)", backend=self.backend, call="malloc")
                self.segments[base] = seg_size
                bisect.insort(self._free_blocks, (seg_size, base, base))
                i = bisect.bisect_left(self._free_blocks, (size, 0, 0))
            bsize, ptr, seg = self._free_blocks.pop(i)
            if bsize > size:
                bisect.insort(self._free_blocks, (bsize - size, ptr + size, seg))
            self._used[ptr] = (size, seg)
        if self.on_malloc is not None:
            self.on_malloc(ptr, size)
        return ptr

    def free(self, ptr: int) -> None:
        """Give a block back; neighbours in the same segment coalesce."""
        with self._lock:
            size, seg = self._used.pop(ptr)
            if self._released:  # the pool is gone: free the segment once its last block is
                if not any(s == seg for _, s in self._used.values()):
                    self._free(seg, self.segments.pop(seg))
                return
            lo, hi = ptr, ptr + size
            keep = []
            for block in self._free_blocks:
                bsize, bptr, bseg = block
                if bseg == seg and (bptr + bsize == lo or bptr == hi):
                    lo, hi = min(lo, bptr), max(hi, bptr + bsize)
                else:
                    keep.append(block)
            bisect.insort(keep, (hi - lo, lo, seg))
            self._free_blocks = keep

    # -- queries ------------------------------------------------------------

    def active_blocks(self) -> list[tuple[int, int]]:
        """``(address, nbytes)`` of every block in use; ``nbytes`` is the rounded size."""
        with self._lock:
            return sorted((p, s) for p, (s, _) in self._used.items())

    @property
    def released(self) -> bool:
        """Whether :meth:`release` was called: graphs captured into the pool can no longer replay."""
        return self._released

    @property
    def reserved_bytes(self) -> int:
        """Bytes of the segments the pool holds."""
        return sum(self.segments.values())

    def release(self) -> None:
        """Return every segment to its source; idempotent.

        Segments holding blocks still in use (a tensor outlived the pool) are
        returned when their last block is freed, as torch does.
        """
        with self._lock:
            if self._released:
                return
            self._released = True
            busy = {seg for _, seg in self._used.values()}
            idle = {base: size for base, size in self.segments.items() if base not in busy}
            for base in idle:
                del self.segments[base]
            self._free_blocks.clear()
        for base, size in idle.items():
            self._free(base, size)
