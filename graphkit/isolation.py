"""Proving at capture end that a graph reads no other key's memory.

Graphs of different keys of one :class:`graphkit.GraphPools` (or sizes of one
vmm :class:`graphkit.GraphRunner`) live in different virtual spaces mapped
onto the *same* physical chunks. A graph that uses an address inside another
key's space -- a tensor another capture allocated and left alive, typically
the previous piece's output in a piecewise forward -- reads bytes that its
own capture's intermediates overwrite at replay: wrong results, silently.

The backend reads the addresses from the captured graph itself
(:meth:`hal.Backend.graph_addresses`); :func:`foreign_uses` matches them
against the live spaces and :func:`check` turns a match into an
:class:`IsolationError` that names both keys and the fix.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import Any

import hal
from graphkit._arenas import VirtualSpace
from hal.types import GraphAddresses, fmt_bytes

log = logging.getLogger("graphkit.isolation")


class IsolationError(hal.CaptureError):
    """A captured graph uses memory in another key's space; the graph was refused (released)."""


@dataclass(frozen=True)
class ForeignUse:
    """The part of one graph's addresses that falls into the space of another key."""

    space_id: int
    addresses: int  # how many of the graph's spans or pointers fall there
    nbytes: int  # bytes of those spans inside the space (1 per pointer whose size is unknown)
    first: int  # the lowest such address
    pointers: int = 0  # how many of them are bare pointers (sizes unknown)

    def __str__(self) -> str:
        if self.pointers == self.addresses:
            return f"{self.pointers} pointer(s)"
        return f"{fmt_bytes(self.nbytes)} ({self.nbytes} bytes) of {self.addresses} tensor(s)"


@dataclass
class VerifyStats:
    """What verification did so far, for reports."""

    graphs: int = 0  # graphs whose addresses were checked
    nodes: int = 0  # nodes (ops, kernels) the backend read
    missed: int = 0  # nodes the backend could not read
    seconds: float = 0.0  # time spent reading graphs and checking

    def add(self, found: GraphAddresses, asking: float, checking: float) -> None:
        """Count one verified graph: ``asking`` the seconds the backend took to answer, ``checking`` ours.

        A backend that read the graph while it was being captured (cuda) answers at once; the time it
        spent reading then is ``found.seconds``, and counts too.
        """
        self.graphs += 1
        self.nodes += found.nodes
        self.missed += found.missed
        self.seconds += max(asking, found.seconds) + checking


def _hits(spans: tuple[tuple[int, int], ...], ranges: list[tuple[int, int, int]]) -> list[ForeignUse]:
    """For each range id, how much of ``spans`` falls in its ``(lo, hi, id)`` ranges."""
    ordered = sorted(ranges)
    starts = [lo for lo, _, _ in ordered]
    hits: dict[int, list[int]] = {}  # range id -> [count, bytes, first address, pointers]
    for ptr, nbytes in spans:
        end = ptr + max(nbytes, 1)
        i = max(bisect.bisect_right(starts, ptr) - 1, 0)
        while i < len(ordered) and ordered[i][0] < end:
            lo, hi, space_id = ordered[i]
            if hi > ptr:
                hit = hits.setdefault(space_id, [0, 0, max(ptr, lo), 0])
                hit[0] += 1
                hit[1] += min(end, hi) - max(ptr, lo)
                hit[2] = min(hit[2], max(ptr, lo))
                hit[3] += nbytes <= 1
            i += 1
    return [ForeignUse(space_id, *hit) for space_id, hit in sorted(hits.items())]


def foreign_uses(found: GraphAddresses, spaces: Mapping[int, VirtualSpace], own: int | None,
                 live_blocks: Callable[[int], list[tuple[int, int]] | None] | None = None) -> list[ForeignUse]:
    """The spaces other than ``own`` that the graph's spans reach into, with how much of each.

    :param live_blocks: the blocks still allocated in a space (None where
        unknown): a use counts only inside one of them. A backend that finds
        bare pointers among kernel arguments also finds integers that happen
        to fall in a space (a division constant); inside a live block of
        another key they are what the check is about.
    """
    # a bare word that is odd is no address of a tensor wider than a byte: packed integers of kernel arguments
    # (the multiplier and shift of a division by a constant) are odd and fall among device addresses
    spans = tuple(span for span in found.spans if span[1] > 1 or not span[0] & 1)
    uses = _hits(spans, [(s.base, s.base + s.size, s.id) for s in spaces.values() if s.id != own and s.size])
    if not uses or live_blocks is None:
        return uses
    ranges: list[tuple[int, int, int]] = []
    for use in uses:
        blocks = live_blocks(use.space_id)
        space = spaces[use.space_id]
        ranges += ([(space.base, space.base + space.size, use.space_id)] if blocks is None
                   else [(ptr, ptr + size, use.space_id) for ptr, size in blocks])
    return _hits(spans, ranges)


def verify(backend: hal.Backend, graph: Any, stats: VerifyStats, spaces: Mapping[int, VirtualSpace],
           own: int | None, key: Hashable, key_of: Callable[[int], Hashable | None], fix: str,
           live_blocks: Callable[[int], list[tuple[int, int]] | None] | None = None) -> None:
    """Ask the backend which addresses ``graph`` uses, :func:`check` them, and count it in ``stats``."""
    start = time.perf_counter()
    found = backend.graph_addresses(graph)
    asked = time.perf_counter()
    try:
        check(backend, found, spaces, own, key, key_of, fix, live_blocks)
    finally:
        stats.add(found, asked - start, time.perf_counter() - asked)


def check(backend: hal.Backend, found: GraphAddresses, spaces: Mapping[int, VirtualSpace], own: int | None,
          key: Hashable, key_of: Callable[[int], Hashable | None], fix: str,
          live_blocks: Callable[[int], list[tuple[int, int]] | None] | None = None) -> None:
    """Raise :class:`IsolationError` when the graph of ``key`` uses memory another key left alive in its space.

    :param key_of: the key whose space has a given id (None for a space that
        no longer belongs to a key).
    :param fix: what the caller should do, for the message.
    :param live_blocks: see :func:`foreign_uses`.
    """
    foreign = foreign_uses(found, spaces, own, live_blocks)
    if not foreign:
        return
    parts = []
    for use in foreign:
        other = key_of(use.space_id)
        owner = f"key {other!r}" if other is not None else f"a released space (id {use.space_id})"
        parts.append(f"{use} in the space of {owner}, from {use.first:#x}")
    raise IsolationError(
        f"the graph of key {key!r} uses memory that another capture allocated and left alive: "
        f"{'; '.join(parts)}. Keys share physical memory, so those bytes are overwritten by this graph's "
        f"own intermediates before it reads them, and replay gives wrong results. {fix}. The graph was "
        "refused (its capture undone); the pools stay usable", backend=backend.name, call="capture")


def readable(backend: hal.Backend, logged: list[bool]) -> bool:
    """Whether ``backend`` can say which addresses a graph uses; logs once (per ``logged``) when not."""
    if backend.supports("graph_addresses"):
        return True
    if not logged:
        log.info("%s cannot tell which addresses a captured graph uses (no 'graph_addresses' capability): "
                 "graphs are not checked for reads of other keys' memory", backend.name)
        logged.append(True)
    return False


__all__ = ["ForeignUse", "IsolationError", "VerifyStats", "check", "foreign_uses", "verify"]
