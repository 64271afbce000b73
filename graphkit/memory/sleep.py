"""The sleep side of an allocator: its chunks released and made again, its spaces kept at their addresses."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

import hal
from graphkit.memory.chunks import SharedChunks
from graphkit.memory.transaction import Transaction

if TYPE_CHECKING:
    from graphkit.memory.ranges import VirtualSpace


class SpacesSleep:
    """Whether any chunk is released or unmapped (:attr:`paused`), and the pause and resume of every space at once.

    :param spaces: the allocator's live spaces by id (the same dict, read here).
    """

    def __init__(self, chunks: SharedChunks, spaces: dict[int, VirtualSpace]) -> None:
        self.chunks = chunks
        self.spaces = spaces
        self.paused = False  # some memory is released or unmapped: nothing may use the spaces

    def check_awake(self, call: str) -> None:
        """Raise :class:`hal.InvalidStateError` for ``call`` while paused."""
        if self.paused:
            raise hal.InvalidStateError("the allocator's physical memory is released (paused): resume its "
                                        "MemorySaver tag, or call restore_physical(), first",
                                        backend=self.chunks.backend.name, call=call)

    @contextlib.contextmanager
    def transaction(self) -> Iterator[Transaction]:
        """A transaction committed at the end of the block; a rollback that left holes makes it read paused."""
        tx = Transaction()
        try:
            with tx:
                yield tx
                tx.commit()
        finally:
            if not tx.clean and self.chunks.has_holes():  # paused until restore() maps them
                self.paused = True

    def release(self) -> int:
        """Unmap every chunk from every space and release them all; return the bytes released.

        A failure half-way maps back what was unmapped (what will not map
        back stays recorded, and it reads paused).
        """
        was = self.paused
        self.paused = True  # from the first unmap on, nothing may use the spaces
        try:
            with Transaction() as tx:
                for space in self.spaces.values():
                    self.chunks.unmap_space(space, tx)
                tx.commit()
        except BaseException:
            self.paused = was or self.chunks.has_holes()
            raise
        return self.chunks.release_all()

    def restore(self) -> None:
        """Create the chunks again and map them where they were (all or nothing); idempotent."""
        if not self.paused:
            return
        self.chunks.retry()
        with Transaction() as tx:
            for index in range(len(self.chunks.handles)):
                self.chunks.ensure(index, tx)
            for space in self.spaces.values():
                for index in sorted(space.holes):
                    self.chunks.fill_hole(space, index, tx)
            tx.commit()
        self.paused = False
