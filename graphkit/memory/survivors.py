"""Memory that outlives its capture gets physical memory of its own, at the same addresses.

Every virtual space of an allocator maps the same shared chunks, so a block
still allocated in a space when its capture ended (an output the engine
keeps, a cache made inside the capture) is overwritten by the replays of
every other space. :class:`Survivors` gives the granules under such blocks
to that space alone: the space keeps the chunk it maps there (with its
bytes), and the other spaces that reach the granule get a new shared chunk
at the same offset (created when the first of them needs it). Once the
blocks are freed, the granule's chunk is shared again. Addresses never move,
so graphs and tensors that hold them keep working, however they got the
address, and nothing is copied.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol

import hal
from graphkit.memory.backing import Backing, Chunk, Place, wait_for_device
from hal.transaction import Transaction

if TYPE_CHECKING:
    from graphkit.memory.ranges import VirtualSpace


class Shared(Protocol):
    """What survivors need of the shared chunks (:class:`graphkit.memory.chunks.SharedChunks`, which holds
    them): the chunk at an index, and the verb that puts another one there."""

    def chunk(self, index: int) -> Chunk: ...

    def adopt(self, index: int, chunk: Chunk, tx: Transaction) -> None: ...

def granules_of(space: VirtualSpace, blocks: Iterable[tuple[int, int]], granularity: int) -> set[int]:
    """The indices of the granules of ``space`` that ``(address, nbytes)`` blocks reach, among those it maps.

    Bounded by arithmetic: a block is clipped to the granules the space maps before any index is made, so a
    block of any size costs at most the space's mapped granules.
    """
    wanted: set[int] = set()
    for address, nbytes in blocks:
        if nbytes > 0 and space.contains(address):
            first = (address - space.base) // granularity
            last = min((address + nbytes - 1 - space.base) // granularity, space.mapped - 1)
            wanted.update(range(first, last + 1))
    return wanted


def checked_blocks(blocks: object, backend: str | None, call: str, name: str = "blocks") -> list[tuple[int, int]]:
    """``blocks`` as a list of ``(address, nbytes)`` pairs of ints with ``nbytes >= 0``; else a hal error naming
    the argument (``name``)."""
    pairs: list[tuple[int, int]] = []
    ok = isinstance(blocks, Iterable) and not isinstance(blocks, (str, bytes))
    for block in blocks if isinstance(blocks, Iterable) and ok else ():
        if not (isinstance(block, (tuple, list)) and len(block) == 2 and all(_an_int(v) for v in block)
                and block[1] >= 0):
            ok = False
            break
        pairs.append((block[0], block[1]))
    if not ok:
        text = repr(blocks)
        raise hal.InvalidArgumentError(f"{name}={text if len(text) <= 120 else text[:117] + '...'} must be "
                                       "(address, nbytes) pairs of ints with nbytes >= 0", backend=backend, call=call)
    return pairs


def _an_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _forget(chunks: dict[int, Chunk], index: int) -> None:
    chunks.pop(index, None)


class Survivors:
    """The chunks that one space alone maps, under blocks that outlived their capture, per space and granule.

    :param backing: the shared chunks' release/restore machine (its create, map, unmap and release steps).
    :param shared: the shared chunks, chunk ``i`` at offset ``i * granularity`` of every space that reaches it
        (a chunk whose handle is None is made again when a space reaches it); read with its ``chunk(i)``, changed
        with its ``adopt(i, chunk, tx)`` alone.

    Only it writes its record of the chunks each space alone maps; the rest reads it through :meth:`chunks`,
    :meth:`of` and :attr:`held_bytes`.
    """

    def __init__(self, backend: hal.Backend, backing: Backing, shared: Shared) -> None:
        self.backend, self.backing, self.shared = backend, backing, shared
        self.granularity = backend.granularity
        self._private: dict[int, dict[int, Chunk]] = {}  # space id -> granule index -> the chunk it alone maps
        self._pinned: dict[int, dict[int, int]] = {}  # space id -> granule index -> pins: its chunk stays

    @property
    def held_bytes(self) -> int:
        """Bytes of the chunks one space alone maps, held now."""
        return sum(c.size for c in self.chunks() if c.handle is not None)

    def chunks(self) -> list[Chunk]:
        """Every chunk one space alone maps (held or released)."""
        return [c for own in self._private.values() for c in own.values()]

    def of(self, space: VirtualSpace) -> dict[int, Chunk]:
        """The chunks ``space`` alone maps, by granule index (a copy)."""
        return dict(self._private.get(space.id, {}))

    def privatize(self, space: VirtualSpace, wanted: set[int], spaces: Iterable[VirtualSpace]) -> None:
        """Make ``space`` alone map the granules ``wanted`` and share the others (all or nothing; after the
        device's queued work).

        A granule given to ``space`` keeps its chunk, bytes and mapping there; the other spaces of ``spaces``
        that map that chunk get a new shared chunk at the same offset (nothing when none does: the shared chunk
        is made when a space reaches the offset). A granule given back becomes the shared chunk again where no
        other space maps a newer one; else ``space`` maps that one and its own is released.
        """
        have = self._private.setdefault(space.id, {})
        pinned = self._pinned.get(space.id, {})  # another process reads these granules: their chunks stay
        add = sorted(i for i in wanted - have.keys() if i < space.mapped and space.place(i).mapped
                     and space.place(i).chunk is self.shared.chunk(i) and i not in pinned)
        back = sorted(i for i in have.keys() - wanted if i not in pinned)
        others = [s for s in spaces if s is not space]
        freed: list[Chunk] = []
        if add or back:
            with self.backing.ordered(), Transaction() as tx:
                for i in add:
                    self._give(space, i, others, have, tx)
                for i in back:
                    freed += self._share(space, i, have, tx)
                tx.commit()
        for chunk in freed:
            self.backing.release(chunk)
        if not have:
            del self._private[space.id]

    def on_shared(self, space: VirtualSpace, blocks: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
        """Those of ``blocks`` that reach a granule of ``space`` mapped to a shared chunk."""
        own = self._private.get(space.id, {})
        return [b for b in blocks if not own or granules_of(space, [b], self.granularity) - own.keys()]

    def keep(self, space: VirtualSpace, index: int, chunk: Chunk) -> None:
        """``space`` keeps ``chunk``, the one it shows at granule ``index``, as a chunk of its own from now on (a
        scratch chunk that would not give way to the granule's own); the chunk of its own it had there goes once
        mapped nowhere. A shared chunk it mapped there stays the shared one."""
        have = self._private.setdefault(space.id, {})
        old = have.get(index)
        have[index] = chunk
        if old is not None and old is not chunk and not old.maps:
            self.backing.release(old)

    def pin(self, space: VirtualSpace, granules: Iterable[int]) -> None:
        """Keep the chunks ``space`` maps at ``granules`` there (a peer process mapped them): neither given to it
        alone nor shared back, and no other space's survivor takes them from it. Counted: :meth:`unpin` as often."""
        pins = self._pinned.setdefault(space.id, {})
        for i in granules:
            pins[i] = pins.get(i, 0) + 1

    def unpin(self, space_id: int, granules: Iterable[int]) -> None:
        """One pin fewer on each of ``granules`` of the space ``space_id`` (gone spaces and unpinned granules are
        ignored)."""
        pins = self._pinned.get(space_id, {})
        for i in granules:
            if pins.get(i, 0) > 1:
                pins[i] -= 1
            else:
                pins.pop(i, None)
        if not pins:
            self._pinned.pop(space_id, None)

    def drop(self, space: VirtualSpace) -> None:
        """Release the chunks ``space`` alone mapped (unmapped with it)."""
        self._pinned.pop(space.id, None)
        for chunk in self._private.pop(space.id, {}).values():
            if not chunk.maps:
                self.backing.release(chunk)

    # -- steps ----------------------------------------------------------------------

    def _give(self, space: VirtualSpace, index: int, others: list[VirtualSpace], have: dict[int, Chunk],
              tx: Transaction) -> None:
        """``space`` keeps the shared chunk ``index``; the other spaces mapping it get a new one (undone by ``tx``)."""
        old = self.shared.chunk(index)
        fresh = Chunk(self.granularity)
        mapping = [s for s in others if index < s.mapped and s.place(index).chunk is old]
        if any(index in self._pinned.get(s.id, {}) for s in mapping):  # a peer maps the shared chunk: it stays
            self._copy_out(space, index, fresh, have, tx)
            return
        if mapping:
            self.backing.create(fresh, tx)
            for other in mapping:
                self._swap(other, index, fresh, tx)
        self.shared.adopt(index, fresh, tx)
        have[index] = old
        tx.append(functools.partial(_forget, have, index))

    def _copy_out(self, space: VirtualSpace, index: int, fresh: Chunk, have: dict[int, Chunk],
                  tx: Transaction) -> None:
        """``space`` gets ``fresh`` at ``index``, with the bytes it shows there now; the shared chunk stays where the
        other spaces map it (undone by ``tx``). The copy goes through a range of its own, unmapped once done."""
        g, be = self.granularity, self.backend
        self.backing.create(fresh, tx)
        scratch = be.create_vir_ptr(g)
        try:
            place = Place(scratch, fresh)
            self.backing.map(place)
            try:
                be.tensor_at(scratch, g).copy_(be.tensor_at(space.place(index).ptr, g))
                wait_for_device(be)  # the copy is done before either mapping goes
            finally:
                self.backing.unmap(place)
        finally:
            be.release_vir_ptr(scratch, g)
        self._swap(space, index, fresh, tx)
        have[index] = fresh
        tx.append(functools.partial(_forget, have, index))

    def _share(self, space: VirtualSpace, index: int, have: dict[int, Chunk], tx: Transaction) -> list[Chunk]:
        """The chunk ``space`` alone mapped at ``index`` is shared again; the chunks to release once committed."""
        own, current = have.pop(index), self.shared.chunk(index)
        tx.append(functools.partial(have.__setitem__, index, own))
        if current.maps:  # other spaces map a newer shared chunk: map it here too, release this one
            self._swap(space, index, current, tx)
            return [own]
        self.shared.adopt(index, own, tx)  # nobody maps the newer one: this one is the shared chunk again
        return [current] if current.handle is not None else []

    def _swap(self, space: VirtualSpace, index: int, chunk: Chunk, tx: Transaction) -> None:
        """Map ``chunk`` at granule ``index`` of ``space`` in place of what is mapped there (undone by ``tx``)."""
        old = space.place(index)
        if old.mapped:
            self.backing.unmap(old, tx)
        new = Place(old.ptr, chunk)
        self.backing.map(new, tx)
        space.swap(index, new)
        tx.append(functools.partial(space.swap, index, old))
