"""One undo stack for every multi-step change to mapped memory, and the steps they share.

>>> with Transaction() as tx:
...     handle = be.create_phy_mem_handle(g)
...     tx.append(lambda: be.release_phy_mem_handle(handle))
...     be.map(ptr, g, handle)
...     tx.append(lambda: be.unmap(ptr, g))
...     tx.commit()
>>> chunks.append(handle)               # the object's state changes only after commit()

Leaving the block without :meth:`Transaction.commit` (an exception) runs the
undo steps in reverse. An undo step that fails is tried once more (driver
faults are often transient); one that fails again is logged and the rest
still run; :attr:`Transaction.rollback_errors` says which failed, so the caller can
record exactly what is left (a mapping that would not go, a chunk that would
not be released) instead of assuming the rollback worked.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, MutableSequence, Sequence
from types import TracebackType
from typing import Any

import hal

log = logging.getLogger("graphkit.memory.transaction")


class Transaction:
    """An undo stack: ``append(undo)`` after each step, ``commit()`` when every step succeeded."""

    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] = []
        self.committed = False
        self.rollback_errors: list[BaseException] = []

    def append(self, undo: Callable[[], None]) -> None:
        """Undo the step just done if the transaction does not commit."""
        self._undo.append(undo)

    def commit(self) -> None:
        """Keep every step: the undo steps are dropped."""
        self._undo.clear()
        self.committed = True

    def rollback(self) -> None:
        """Run the undo steps in reverse; failures are logged and kept in :attr:`rollback_errors`."""
        undo, self._undo = self._undo, []
        for step in reversed(undo):
            for attempt in (1, 2):
                try:
                    step()
                    break
                except Exception as exc:  # noqa: BLE001 - a failed undo must not stop the others
                    if attempt == 1:
                        log.warning("rollback step failed, trying it again: %s", str(exc))
                        continue
                    log.error("rollback step failed twice (what it would have undone is recorded and left "
                              "for a later call): %s", str(exc))
                    self.rollback_errors.append(exc)

    @property
    def clean(self) -> bool:
        """Whether the rollback (if any) undid every step."""
        return not self.rollback_errors

    def __enter__(self) -> Transaction:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if not self.committed:
            self.rollback()


# -- steps shared by the allocator, elastic buffers and the saver --------------------------


def map_run(backend: hal.Backend, base: int, size: int, handles: Sequence[Any], tx: Transaction,
            indices: Iterable[int] | None = None, on_map: Callable[[int], None] | None = None,
            on_unmap: Callable[[int], None] | None = None) -> None:
    """Map ``handles[i]`` at ``base + i * size`` for each ``i`` of ``indices`` (default: all), in order.

    Each mapping is unmapped on rollback. ``on_map(i)`` runs right after the
    ``i``-th map succeeded and ``on_unmap(i)`` right after its undo did, so
    the caller's record of what is mapped stays exact even when an undo fails.
    """
    for i in sorted(range(len(handles)) if indices is None else indices):
        ptr = base + i * size
        backend.map(ptr, size, handles[i])
        if on_map is not None:
            on_map(i)

        def undo(ptr: int = ptr, i: int = i) -> None:
            backend.unmap(ptr, size)
            if on_unmap is not None:
                on_unmap(i)

        tx.append(undo)


def unmap_run(backend: hal.Backend, base: int, size: int, handles: Sequence[Any], tx: Transaction,
              indices: Iterable[int] | None = None, on_unmap: Callable[[int], None] | None = None,
              on_map: Callable[[int], None] | None = None) -> None:
    """Unmap ``handles[i]`` at ``base + i * size`` for each ``i`` of ``indices`` (default: all), last first.

    Each is mapped again on rollback; ``on_unmap(i)`` runs right after the
    ``i``-th unmap succeeded and ``on_map(i)`` right after its undo mapped it back.
    """
    for i in sorted(range(len(handles)) if indices is None else indices, reverse=True):
        ptr = base + i * size
        backend.unmap(ptr, size)
        if on_unmap is not None:
            on_unmap(i)

        def undo(ptr: int = ptr, i: int = i) -> None:
            backend.map(ptr, size, handles[i])
            if on_map is not None:
                on_map(i)

        tx.append(undo)


def release_or_keep(backend: hal.Backend, handle: Any, keep: MutableSequence[Any]) -> bool:
    """Release a chunk that is mapped nowhere; one whose release fails twice goes to ``keep`` (retried later).

    Returns whether it was released. Never raises a hal error: the chunk is
    never lost, and the operation that released it has already done its job.
    """
    for attempt in (1, 2):
        try:
            backend.release_phy_mem_handle(handle)
            return True
        except hal.HalError as exc:
            if attempt == 2:
                log.warning("a chunk could not be released yet (kept, released later): %s", str(exc))
    keep.append(handle)
    return False


def retry_releases(backend: hal.Backend, keep: list[Any]) -> None:
    """Release the chunks ``keep`` holds; those that fail again stay in it."""
    pending, keep[:] = list(keep), []
    for handle in pending:
        release_or_keep(backend, handle, keep)


__all__ = ["Transaction", "map_run", "release_or_keep", "retry_releases", "unmap_run"]
