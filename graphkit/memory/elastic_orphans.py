"""Elastic buffers garbage-collected without ``close()``: their ranges go back to the reservation later.

The garbage collector may run the finalizer in the middle of any call of the
reservation, so the finalizer only queues the range; the reservation gives
queued ranges back at its next safe point (its lock held, nothing half done).
"""

from __future__ import annotations

import logging
import weakref
from collections import deque
from collections.abc import Callable

import hal
from graphkit.memory.elastic_chunks import RangeChunks
from hal.types import fmt_bytes

log = logging.getLogger("graphkit.memory.elastic")


class Orphans:
    """Ranges of buffers dropped without ``close()``, waiting for their reservation's next safe point."""

    def __init__(self) -> None:
        self._queue: deque[RangeChunks] = deque()

    def __len__(self) -> int:
        return len(self._queue)

    def watch(self, buffer: object, chunks: RangeChunks,
              close_reservation: Callable[[], None] | None) -> weakref.finalize:
        """Queue ``chunks`` if ``buffer`` is garbage-collected without ``close()`` (``detach()`` the result on close).

        ``close_reservation``: the buffer's own reservation's ``close``,
        called then too (nothing else can reach that reservation).
        """
        finalizer = weakref.finalize(buffer, self._dropped, chunks, close_reservation)
        finalizer.atexit = False  # at exit the process gives everything back anyway
        return finalizer

    def _dropped(self, chunks: RangeChunks, close_reservation: Callable[[], None] | None) -> None:
        log.warning("an ElasticBuffer on %s at %#x was garbage-collected without close(): its %s go back to its "
                    "reservation (call close() when done with it)", chunks.backend.name, chunks.ptr,
                    fmt_bytes(sum(h is not None for h in chunks.chunks) * chunks.granularity))
        self._queue.append(chunks)  # deque.append is atomic: safe from the garbage collector
        if close_reservation is None:
            return  # given back at the reservation's next call (this may run inside one of them)
        try:  # a reservation of its own: nothing else can reach it, close it now
            close_reservation()
        except hal.HalError as exc:
            log.error("closing a dropped ElasticBuffer's own reservation failed: %s", str(exc))

    def settle(self, give_back: Callable[[RangeChunks], bool]) -> None:
        """Call ``give_back`` on each queued range (at a safe point); those it could not finish stay queued."""
        for _ in range(len(self._queue)):
            chunks = self._queue.popleft()
            if not give_back(chunks):
                self._queue.append(chunks)
