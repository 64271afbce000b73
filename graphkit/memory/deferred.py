"""Deferred release: a space whose memory a tensor still uses is released only after its last block is freed."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import hal

if TYPE_CHECKING:
    from graphkit.memory.ranges import VirtualSpace

log = logging.getLogger("graphkit.memory.allocator")


class DeferredRelease:
    """Counts frees against the spaces' live allocations and releases the spaces marked ``dying`` once idle.

    A free may come from a framework's destructor at any moment (even from
    the garbage collector in the middle of another operation of the
    allocator), so :meth:`free` only counts; :meth:`reap`, run at the
    allocator's next operation, releases.

    :param spaces: the allocator's live spaces by id (the same dict, read here).
    :param release: releases one space by id (the allocator's ``release_virtual_space``).
    """

    def __init__(self, spaces: dict[int, VirtualSpace], release: Callable[[int], None]) -> None:
        self.spaces = spaces
        self.release = release

    def free(self, ptr: int) -> None:
        """Count one free in the space holding ``ptr`` (none: it went with its space)."""
        for space in self.spaces.values():
            if space.contains(ptr):
                space.live_allocations = max(space.live_allocations - 1, 0)
                return
        log.debug("deallocate(%#x): not in a live space (already released with its space)", ptr)

    def release_when_idle(self, space: VirtualSpace) -> bool:
        """Release ``space`` now if nothing in it is live (and reap), else mark it; return whether it went now."""
        if space.live_allocations == 0:
            self.release(space.id)
            self.reap()
            return True
        space.dying = True
        log.info("space %d still has %d live allocation(s): released when they are freed",
                 space.id, space.live_allocations)
        return False

    def reap(self) -> None:
        """Release the marked spaces that nothing uses any more (a failure is logged and retried next time)."""
        for space in [s for s in self.spaces.values() if s.dying and s.live_allocations == 0]:
            try:
                self.release(space.id)
            except hal.HalError as exc:
                log.error("deferred release of space %d failed (will retry): %s", space.id, str(exc))
