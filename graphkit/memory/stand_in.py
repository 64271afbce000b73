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
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

import hal
from graphkit.memory.backing import Backing, Chunk, Place
from hal.transaction import Transaction

if TYPE_CHECKING:
    from graphkit.memory.ranges import VirtualSpace


#: ``keep(space, index, chunk)``: ``space`` keeps ``chunk`` at granule ``index`` as a chunk of its own, from now on
Keep = Callable[["VirtualSpace", int, Chunk], None]


def _swap(backing: Backing, space: VirtualSpace, index: int, place: Place, tx: Transaction) -> None:
    """Map ``place`` at granule ``index`` of ``space`` instead of what is mapped there (undone by ``tx``).

    The record follows the driver: ``space`` shows ``place`` from the moment it is mapped until the moment it is
    unmapped again by a rollback (a rollback whose unmap fails leaves ``space`` showing it, mapped)."""
    old = space.place(index)
    backing.unmap(old, tx)
    backing.map(place)
    space.swap(index, place)
    tx.append(functools.partial(_unswap, backing, space, index, place, old))


def _unswap(backing: Backing, space: VirtualSpace, index: int, place: Place, old: Place) -> None:
    backing.unmap(place)
    space.swap(index, old)


@contextlib.contextmanager
def standing_in(backing: Backing, granules: Iterable[tuple[VirtualSpace, Iterable[int]]],
                keep: Keep) -> Iterator[list[int]]:
    """Inside the block, each granule of each ``(space, granule indices)`` maps a fresh scratch chunk at its
    address instead of its own chunk; yields the scratch granules' addresses (their bytes are whatever the driver
    gave). After the block the spaces map their own chunks again, with the bytes they had, and the scratch chunks
    are released.

    All or nothing on the way in: a failure half-way maps back what was swapped. On the way out each granule is
    swapped back on its own, a fault tried once more; a granule that still will not go back keeps its scratch
    chunk as a chunk of its own (``keep``: its owner holds and releases it from then on, and the scratch bytes are
    what the granule holds), and the first fault is raised. No scratch chunk is ever left to nobody. A granule
    that is not mapped now (a hole, one past what the space reaches) is a :class:`hal.InvalidStateError`.
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
        # undone last: a rollback that could not unmap a scratch chunk leaves it mapped, to whoever shows it
        tx.append(functools.partial(_settle, backing, swaps, keep))
        for space, index, scratch in swaps:
            backing.create(scratch.chunk, tx)
            _swap(backing, space, index, scratch, tx)
        tx.commit()
    try:
        yield [scratch.ptr for _, _, scratch in swaps]
    finally:
        _restore(backing, swaps, originals, keep)


def _restore(backing: Backing, swaps: list[tuple[VirtualSpace, int, Place]], originals: list[Place],
             keep: Keep) -> None:
    """Swap every granule back to its own chunk (each on its own, a fault tried once more), then settle the
    scratch chunks; raises the first fault that would not go away."""
    errors: list[hal.HalError] = []
    for wait in (1, 2):
        try:
            with backing.ordered():  # the wait for the device; a fault in it is tried once more, as each swap is
                for (space, index, scratch), original in zip(swaps, originals, strict=True):
                    for attempt in (1, 2):
                        if space.place(index) is not scratch:
                            break
                        try:
                            with Transaction() as tx:
                                _swap(backing, space, index, original, tx)
                                tx.commit()
                        except hal.HalError as exc:
                            if attempt == 2:
                                errors.append(exc)
            break
        except hal.HalError as exc:
            if wait == 2:
                errors.append(exc)
    _settle(backing, swaps, keep)
    if errors:
        raise errors[0].led_by(f"{len(errors)} granule(s) of other keys would not map their own chunks again after "
                               "the isolation check: they keep the scratch chunks, with the bytes they held")


def _settle(backing: Backing, swaps: list[tuple[VirtualSpace, int, Place]], keep: Keep) -> None:
    """Each scratch chunk goes to whoever holds it now: released where no space shows it any more (mapped
    nowhere), kept by the space that still shows it (mapped, or a hole a resume maps again)."""
    for space, index, scratch in swaps:
        if scratch.chunk.handle is None:
            continue  # never made, or released by the rollback
        if space.place(index) is scratch:
            keep(space, index, scratch.chunk)
        elif not scratch.chunk.maps:
            backing.release(scratch.chunk)


__all__ = ["standing_in"]
