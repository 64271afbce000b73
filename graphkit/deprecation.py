"""Old public names kept working for a while, each with a :class:`DeprecationWarning`."""

from __future__ import annotations

import warnings


def renamed(old: str, new: str, *, stacklevel: int = 3) -> None:
    """Warn that ``old`` is a deprecated spelling of ``new`` (the warning points at the caller's caller)."""
    warnings.warn(f"{old} is deprecated; use {new}", DeprecationWarning, stacklevel=stacklevel)
