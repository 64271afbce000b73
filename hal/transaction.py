"""One undo stack for every multi-step change to mapped memory, in hal and in graphkit.

>>> with Transaction() as tx:
...     handle = be.create_phy_mem_handle(g)
...     tx.append(lambda: be.release_phy_mem_handle(handle))
...     be.map(ptr, g, handle)
...     tx.append(lambda: be.unmap(ptr, g))
...     tx.commit()
>>> chunks.append(handle)               # the object's state changes only after commit()

Leaving the block without :meth:`Transaction.commit` (an exception) runs the
undo steps in reverse. An undo step that fails is tried once more (driver
faults are often transient) unless it was appended with ``retry=False`` (a
callback that must not run twice: a router's ``on_end(False)``); one that
fails for good is logged, the rest still run, and the error that left the
block is the one that propagates; :attr:`Transaction.rollback_errors` says which failed, so the caller can
record exactly what is left (a mapping that would not go, a chunk that would
not be released) instead of assuming the rollback worked.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from types import TracebackType

log = logging.getLogger(__name__)


class Transaction:
    """An undo stack: ``append(undo)`` after each step, ``commit()`` when every step succeeded."""

    def __init__(self) -> None:
        self._undo: list[tuple[Callable[[], None], bool]] = []
        self.committed = False
        self.rollback_errors: list[BaseException] = []

    def append(self, undo: Callable[[], None], *, retry: bool = True) -> None:
        """Undo the step just done if the transaction does not commit (a failed ``undo`` tried once more
        unless ``retry=False``)."""
        self._undo.append((undo, retry))

    def commit(self) -> None:
        """Keep every step: the undo steps are dropped."""
        self._undo.clear()
        self.committed = True

    def rollback(self) -> None:
        """Run the undo steps in reverse; failures are logged and kept in :attr:`rollback_errors`."""
        undo, self._undo = self._undo, []
        for step, retry in reversed(undo):
            for attempt in (1, 2) if retry else (2,):
                try:
                    step()
                    break
                except Exception as exc:  # noqa: BLE001 - a failed undo must not stop the others
                    if attempt == 1:
                        log.warning("rollback step failed, trying it again: %s", str(exc))
                        continue
                    log.error("rollback step failed%s (what it would have undone is recorded and left for a later "
                              "call): %s", " twice" if retry else "", str(exc))
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


__all__ = ["Transaction"]
