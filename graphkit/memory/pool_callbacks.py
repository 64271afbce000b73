"""The callbacks a backend's pool calls to allocate from, and free to, one virtual space of an allocator."""

from __future__ import annotations

import logging
from collections.abc import Callable

import hal
from hal.types import fmt_bytes

log = logging.getLogger("graphkit.memory.allocator")


class PoolCallbacks:
    """Makes ``(alloc, free)`` pairs for :meth:`hal.Backend.create_pool` and keeps the last error an ``alloc`` raised.

    ``alloc`` raises the allocator's error (e.g. :class:`hal.DeviceOutOfMemoryError`)
    after logging it and keeping it in :attr:`last_error`; the backend's glue
    turns that into the framework's own out-of-memory error, with this reason
    attached, and never lets it reach native code. ``free`` never raises.

    :param allocate: the allocator's ``allocate(nbytes, alignment, space_id)``.
    :param deallocate: the allocator's ``deallocate(ptr)``.
    """

    def __init__(self, allocate: Callable[[int, int, int], int], deallocate: Callable[[int], None]) -> None:
        self.allocate = allocate
        self.deallocate = deallocate
        self.last_error: str | None = None

    def bound_to(self, space_id: int) -> tuple[Callable[[int], int], Callable[[int, int], None]]:
        """``(alloc, free)`` bound to the space ``space_id``."""

        def alloc(nbytes: int) -> int:
            try:
                return self.allocate(nbytes, hal.ALLOCATION_ALIGNMENT, space_id)
            except Exception as exc:
                self.last_error = str(exc)
                log.error("graph pool allocation of %s failed: %s", fmt_bytes(nbytes), str(exc))
                raise

        def free(ptr: int, nbytes: int) -> None:
            try:
                self.deallocate(ptr)
            except Exception as exc:  # noqa: BLE001  # pragma: no cover - deallocate does not raise; a free must not raise into torch
                log.error("graph pool free failed: %s", str(exc))

        return alloc, free
