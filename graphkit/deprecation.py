"""Old public names kept working for a while, each with a :class:`DeprecationWarning`."""

from __future__ import annotations

import warnings
from typing import Any


def renamed(old: str, new: str, *, stacklevel: int = 3) -> None:
    """Warn that ``old`` is a deprecated spelling of ``new`` (the warning points at the caller's caller)."""
    warnings.warn(f"{old} is deprecated; use {new}", DeprecationWarning, stacklevel=stacklevel)


class alias(property):  # lower case: used in a class body like ``property``
    """A deprecated attribute name that reads another one and warns: ``pool = alias("kind")`` in a class body."""

    def __init__(self, new: str) -> None:
        def read(obj: Any) -> Any:
            renamed(self.old, new)
            return getattr(obj, new)

        super().__init__(read, doc=f"Deprecated spelling of :attr:`{new}`.")
        self.new = new
        self.old = new

    def __set_name__(self, owner: type, name: str) -> None:
        self.old = f"{owner.__name__}.{name}"
