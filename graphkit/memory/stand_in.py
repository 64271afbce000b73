"""Granules of a space backed for a while by scratch chunks, then by their own chunks again.

The verifier (:mod:`graphkit.graphs.isolation`) tells whether a graph really
reads or writes the memory a word of its arguments points to by changing the
bytes behind that address and replaying: a virtual range keeps its address
while what backs it changes, so the granules of one space are given fresh
scratch chunks at the same addresses (:func:`standing_in`), and once the
block ends the space maps its own chunks again, their bytes untouched. Every
unmap, both ways, comes after the work queued on the device so far
(:meth:`graphkit.memory.backing.Backing.ordered`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import hal
from graphkit.memory.backing import Backing, Chunk, Place
from graphkit.memory.transaction import Transaction

if TYPE_CHECKING:
    from graphkit.memory.ranges import VirtualSpace


def _swap(backing: Backing, space: VirtualSpace, index: int, place: Place, tx: Transaction) -> None:
    """Map ``place`` at granule ``index`` of ``space`` instead of what is mapped there (undone by ``tx``)."""
    old = space.place(index)
    backing.unmap(old, tx)
    backing.map(place, tx)
    space.swap(index, place)
    tx.append(functools.partial(space.swap, index, old))


@contextlib.contextmanager
def standing_in(backing: Backing, granules: Iterable[tuple[VirtualSpace, Iterable[int]]]) -> Iterator[list[int]]:
    """Inside the block, each granule of each ``(space, granule indices)`` maps a fresh scratch chunk at its
    address instead of its own chunk; yields the scratch granules' addresses (their bytes are whatever the driver
    gave). After the block the spaces map their own chunks again, with the bytes they had, and the scratch chunks
    are released.

    All or nothing both ways: a failure half-way maps back what was swapped. A granule that is not mapped now
    (a hole, one past what the space reaches) is a :class:`hal.InvalidStateError`.
    """
    swaps: list[tuple[VirtualSpace, int, Place]] = []
    for space, indices in granules:
        for index in sorted(set(indices)):
            if not 0 <= index < space.mapped or not space.place(index).mapped:
                raise hal.InvalidStateError(f"granule {index} of space {space.id} is not mapped now: nothing to stand "
                                            "in for", backend=backing.backend.name, call="stand_in")
            old = space.place(index)
            swaps.append((space, index, Place(old.ptr, Chunk(old.size))))
    originals = [space.place(index) for space, index, _ in swaps]
    with backing.ordered(), Transaction() as tx:
        for space, index, scratch in swaps:
            backing.create(scratch.chunk, tx)
            _swap(backing, space, index, scratch, tx)
        tx.commit()
    try:
        yield [scratch.ptr for _, _, scratch in swaps]
    finally:
        with backing.ordered(), Transaction() as tx:
            for (space, index, _), original in zip(swaps, originals, strict=True):
                _swap(backing, space, index, original, tx)
            tx.commit()
        for _, _, scratch in swaps:
            backing.release(scratch.chunk)


__all__ = ["standing_in"]
