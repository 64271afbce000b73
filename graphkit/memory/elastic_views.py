"""Which framework views of an elastic buffer are alive, and how far into the buffer each reaches."""

from __future__ import annotations

import weakref


class ViewToken:
    """Owned by the storage of one view: alive while the view or any slice of it is, and keeps the buffer alive."""

    __slots__ = ("__weakref__", "buffer")

    def __init__(self, buffer: object) -> None:
        self.buffer = buffer


class LiveViews:
    """The views made of one buffer, each as a weak reference to its token and the byte offset its end reaches.

    Dead entries are dropped now and then as views are made, so the record
    stays short however many views come and go; ``len()`` counts what it
    holds, dead entries not yet dropped included.
    """

    def __init__(self) -> None:
        self._views: list[tuple[weakref.ref[ViewToken], int]] = []
        self._prune_at = 64

    def __len__(self) -> int:
        return len(self._views)

    def add(self, token: ViewToken, end: int) -> None:
        """Record a view whose storage owns ``token``, reaching ``end`` bytes in (0: it stops no shrink)."""
        if len(self._views) >= self._prune_at:
            self.ends()
        self._views.append((weakref.ref(token), end))

    def ends(self) -> list[int]:
        """How far each live view reaches (dead entries dropped on the way)."""
        self._views = [(ref, end) for ref, end in self._views if ref() is not None]
        self._prune_at = max(64, 2 * len(self._views))
        return [end for _, end in self._views]
