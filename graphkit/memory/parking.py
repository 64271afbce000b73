"""Parking: at close, spaces a tensor still uses stay reserved over one scratch chunk instead of being unmapped."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING

import hal
from hal.types import fmt_bytes

if TYPE_CHECKING:
    from graphkit.memory.ranges import VirtualSpace

log = logging.getLogger("graphkit.memory.allocator")


class Parking:
    """The spaces parked by ``close(park_live=True)``: reading a tensor in them gives garbage instead of a fault.

    Parked memory (one granule, and the ranges) is given back only by
    :meth:`hal.Backend.close`.
    """

    def __init__(self, backend: hal.Backend) -> None:
        self.backend = backend
        self.spaces: list[VirtualSpace] = []
        self.bytes = 0  # address space left over the scratch chunk

    def __contains__(self, space: VirtualSpace) -> bool:
        return space in self.spaces

    @property
    def arena_ids(self) -> set[int]:
        """Ids of the arenas the parked spaces lie in (they stay reserved)."""
        return {id(s.arena) for s in self.spaces}

    def park_busy(self, spaces: Iterable[VirtualSpace], park_live: bool, errors: list[BaseException]) -> None:
        """At close: park the mapped spaces with live allocations if ``park_live``, else warn about them.

        Nothing happens once spaces are parked (a second close).
        """
        if self.spaces:
            return
        busy = [s for s in spaces if s.live_allocations and s.mapped]
        if busy and not park_live:
            log.warning("closing with allocations still live in space(s) %s: tensors still using them "
                        "must not be touched after this", [s.id for s in busy])
        if busy and park_live:
            self.spaces = self._park(busy, errors)

    def _park(self, busy: list[VirtualSpace], errors: list[BaseException]) -> list[VirtualSpace]:
        """Map one scratch chunk over every granule of the busy spaces in place of the real chunks."""
        g = self.backend.granularity
        try:
            scratch = self.backend.create_phy_mem_handle(g)
        except hal.HalError as exc:
            log.warning("closing with allocations still live in space(s) %s and no memory for a scratch chunk: "
                        "tensors still using them must not be touched after this", [s.id for s in busy])
            errors.append(exc)
            return []
        for space in busy:
            for index in range(space.mapped):
                ptr = space.base + index * g
                try:
                    if index not in space.holes:
                        self.backend.unmap(ptr, g)
                        space.holes.add(index)
                    self.backend.map(ptr, g, scratch)
                except Exception as exc:  # noqa: BLE001 - collected; close() raises the first after releasing the rest
                    errors.append(exc)
        self.bytes = sum(s.size for s in busy)
        log.warning("closing with allocations still live in space(s) %s: their %s stay reserved over a scratch "
                    "chunk (reads give garbage) until the backend closes", [s.id for s in busy],
                    fmt_bytes(self.bytes))
        return busy
