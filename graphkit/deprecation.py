"""Old public names kept working for a while, each with a :class:`DeprecationWarning`."""

from __future__ import annotations

import warnings
from typing import Any

import hal


def renamed(old: str, new: str, *, stacklevel: int = 3) -> None:
    """Warn that ``old`` is a deprecated spelling of ``new`` (the warning points at the caller's caller)."""
    warnings.warn(f"{old} is deprecated; use {new}", DeprecationWarning, stacklevel=stacklevel)


def renamed_keyword(call: str, old: str, old_value: Any, new: str, new_value: Any, *,
                    backend: str | None = None) -> Any:
    """The value of a renamed keyword argument of ``call``: ``new_value``, or ``old_value`` when only the old
    spelling was given (``None`` is "not given" for both); the old spelling warns.

    :raises hal.InvalidArgumentError: both spellings were given: neither silently wins.
    """
    if old_value is None:
        return new_value
    renamed(f"{call}({old}=)", f"{new}=", stacklevel=4)
    if new_value is not None:
        raise hal.InvalidArgumentError(f"{old}={old_value!r} and {new}={new_value!r} were both given: {old}= is the "
                                       f"deprecated spelling of {new}=: pass one of them ({new}=)", backend=backend,
                                       call=call)
    return old_value


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
