"""What memory that sleeps asks of the saver it sleeps with, stated here so that the memory room names no room
above it: :class:`graphkit.MemorySaver` is a :class:`Keeper`."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Keeper(Protocol):
    """A saver that pauses and resumes memory by tag (:class:`graphkit.MemorySaver`)."""

    @property
    def closed(self) -> bool:
        """Whether it was closed (it manages nothing from then on)."""
        ...

    def check_adoptable(self, tag: Any, call: str) -> str:
        """Raise :class:`hal.InvalidArgumentError` unless memory can sleep under ``tag``; the tag."""
        ...

    def adopt(self, sleeper: Any, tag: str) -> None:
        """Pause and resume ``sleeper`` with ``tag`` from now on."""
        ...

    def forget(self, sleeper: Any) -> None:
        """Stop managing ``sleeper`` (its owner closes it)."""
        ...


__all__ = ["Keeper"]
