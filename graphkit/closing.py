"""What every closable graphkit object shares: ``with`` closes it, and a close that failed a step says so once."""

from __future__ import annotations

import logging
from typing import TypeVar

_T = TypeVar("_T", bound="Closable")


class Closable:
    """``with obj:`` returns ``obj`` and calls ``obj.close()`` at the end of the block."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self: _T) -> _T:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def raise_first_failure(log: logging.Logger, errors: list[BaseException], call: str) -> None:
    """After a close that went on past failed steps: log how many failed and raise the first (nothing if none)."""
    if errors:
        log.error("%s: %d step(s) failed; close() again to finish: %s", call, len(errors), str(errors[0]))
        raise errors[0]
