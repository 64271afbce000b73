"""What every closable graphkit object shares: ``with`` closes it; a close goes on past failed steps, says so once."""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import TypeVar

import hal

_T = TypeVar("_T", bound="Closable")
_warned: weakref.WeakSet[hal.Backend] = weakref.WeakSet()  # backends whose late closes were warned about


class Closable:
    """``with obj:`` returns ``obj`` and calls ``obj.close()`` at the end of the block."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self: _T) -> _T:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def close_step(errors: list[BaseException], step: Callable[..., object], *args: object) -> bool:
    """Run one step of a close that goes on past failures: a hal error goes to ``errors``; whether it succeeded."""
    try:
        step(*args)
    except hal.HalError as exc:
        errors.append(exc)
        return False
    return True


def raise_first_failure(log: logging.Logger, errors: list[BaseException], call: str) -> None:
    """After a close that went on past failed steps: log how many failed and raise the first (nothing if none)."""
    if errors:
        log.error("%s: %d step(s) failed; close() again to finish: %s", call, len(errors), str(errors[0]))
        raise errors[0]


def after_backend(backend: hal.Backend, log: logging.Logger, what: str) -> bool:
    """Whether ``backend`` is closed already: then its close released every graph, pool, mapping, range and chunk,
    and a close of ``what`` has nothing left to give back (it only forgets them). Warns once per backend."""
    if not backend.closed:
        return False
    if backend not in _warned:
        _warned.add(backend)
        log.warning("%s closed after its backend %s: nothing left to release (the backend's close released it); "
                    "close graphkit objects before their backend", what, backend.name)
    return True
