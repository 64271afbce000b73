"""Memory that outlives its capture gets physical memory of its own, at the same addresses.

Every virtual space of an allocator maps the same shared chunks, so a block
still allocated in a space when its capture ended (an output the engine
keeps, a cache made inside the capture) is overwritten by the replays of
every other space. :class:`Survivors` backs the granules under such blocks
with chunks no other space maps -- a copy of their bytes, swapped in under
the same virtual addresses -- and maps the shared chunks back once the blocks
are freed. Addresses never move, so graphs and tensors that hold them keep
working, however they got the address.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import TYPE_CHECKING

import hal
from graphkit.memory.backing import Backing, Chunk, Place, wait_for_device
from graphkit.memory.transaction import Transaction

if TYPE_CHECKING:
    from graphkit.memory.ranges import VirtualSpace

#: the scratch range the copies go through holds at least this many granules (it is kept and reused)
_SCRATCH_GRANULES = 8


def granules_of(space: VirtualSpace, blocks: Iterable[tuple[int, int]], granularity: int) -> set[int]:
    """The indices of the granules of ``space`` that ``(address, nbytes)`` blocks reach."""
    wanted: set[int] = set()
    for address, nbytes in blocks:
        if nbytes > 0 and space.contains(address):
            first, last = (address - space.base) // granularity, (address + nbytes - 1 - space.base) // granularity
            wanted.update(range(first, last + 1))
    return wanted


def _forget(chunks: dict[int, Chunk], index: int) -> None:
    chunks.pop(index, None)


class Survivors:
    """The chunks of their own under blocks that outlived their capture, per space and granule.

    :param backing: the shared chunks' release/restore machine (its map, unmap and release steps).
    :param shared: the shared chunks, chunk ``i`` at offset ``i * granularity`` of every space.
    """

    def __init__(self, backend: hal.Backend, backing: Backing, shared: list[Chunk]) -> None:
        self.backend, self.backing, self.shared = backend, backing, shared
        self.granularity = backend.granularity
        self.private: dict[int, dict[int, Chunk]] = {}  # space id -> granule index -> its own chunk there
        self._scratch: tuple[int, int] | None = None  # (address, bytes) the copies go through, kept for reuse

    @property
    def held_bytes(self) -> int:
        """Bytes of the chunks of their own held now."""
        return sum(c.size for c in self.chunks() if c.handle is not None)

    @property
    def scratch_ranges(self) -> int:
        """Address ranges held for the copies (0 or 1)."""
        return int(self._scratch is not None)

    def chunks(self) -> list[Chunk]:
        return [c for own in self.private.values() for c in own.values()]

    def privatize(self, space: VirtualSpace, wanted: set[int]) -> None:
        """Back exactly the granules ``wanted`` of ``space`` with chunks of their own, the others with the shared
        chunks, at the same addresses (all or nothing; after the device's queued work).

        A new chunk holds a copy of its granule's bytes (a device graph's capture runs nothing, but a host
        recorder's does, and memory used before the capture holds data). A granule no longer wanted maps its
        shared chunk again and its own chunk is released.
        """
        have = self.private.setdefault(space.id, {})
        add = sorted(i for i in wanted - have.keys() if i < space.mapped and space.places[i].mapped)
        back = sorted(i for i in have.keys() - wanted if self.shared[i].handle is not None)
        freed: list[Chunk] = []
        if add or back:
            with self.backing.ordered(), Transaction() as tx:
                for i, chunk in zip(add, self._copies(space, add, tx), strict=True):
                    self._swap(space, i, chunk, tx)
                    have[i] = chunk
                    tx.append(functools.partial(_forget, have, i))
                for i in back:
                    self._swap(space, i, self.shared[i], tx)
                    freed.append(have.pop(i))
                    tx.append(functools.partial(have.__setitem__, i, freed[-1]))
                tx.commit()
        for chunk in freed:
            self.backing.release(chunk)
        if not have:
            del self.private[space.id]

    def on_shared(self, space: VirtualSpace, blocks: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
        """Those of ``blocks`` that reach a granule of ``space`` mapped to a shared chunk."""
        own = self.private.get(space.id, {})
        return [b for b in blocks if not own or granules_of(space, [b], self.granularity) - own.keys()]

    def drop(self, space: VirtualSpace) -> None:
        """Release the chunks of their own of ``space`` (unmapped with it)."""
        for chunk in self.private.pop(space.id, {}).values():
            if not chunk.maps:
                self.backing.release(chunk)

    def drop_scratch(self) -> None:
        """Free the scratch range (at close); one whose release fails is kept, to free again."""
        if self._scratch is not None:
            self.backend.release_vir_ptr(*self._scratch)
            self._scratch = None

    # -- steps ----------------------------------------------------------------------

    def _scratch_range(self, count: int) -> int:
        """The address of a range of at least ``count`` granules, nothing mapped in it."""
        g = self.granularity
        if self._scratch is None or self._scratch[1] < count * g:
            self.drop_scratch()
            size = max(count, _SCRATCH_GRANULES) * g
            self._scratch = (self.backend.create_vir_ptr(size), size)
        return self._scratch[0]

    def _copies(self, space: VirtualSpace, indices: list[int], tx: Transaction) -> list[Chunk]:
        """New chunks holding the bytes of granules ``indices`` of ``space``: each mapped at the scratch range,
        copied into on the device, unmapped once the copies are done (released again on rollback of ``tx``)."""
        if not indices:
            return []
        g = self.granularity
        scratch = self._scratch_range(len(indices))
        made: list[Chunk] = []
        with Transaction() as staging:
            for k, i in enumerate(indices):
                chunk = Chunk(g)
                self.backing.create(chunk, tx)
                made.append(chunk)
                place = Place(scratch + k * g, chunk)
                self.backing.map(place)
                staging.append(functools.partial(self.backing.unmap, place))
                self.backend.tensor_at(place.ptr, g).copy_(self.backend.tensor_at(space.places[i].ptr, g))
            wait_for_device(self.backend)  # the copies are done before any place they read or write is unmapped
            for k, chunk in enumerate(made):
                self.backing.unmap(Place(scratch + k * g, chunk, mapped=True))
            staging.commit()
        return made

    def _swap(self, space: VirtualSpace, index: int, chunk: Chunk, tx: Transaction) -> None:
        """Map ``chunk`` at granule ``index`` of ``space`` in place of what is mapped there (undone by ``tx``)."""
        old = space.places[index]
        if old.mapped:
            self.backing.unmap(old, tx)
        new = Place(old.ptr, chunk)
        self.backing.map(new, tx)
        space.places[index] = new
        tx.append(functools.partial(space.places.__setitem__, index, old))
