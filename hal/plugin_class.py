"""What hal asks of a backend's class before, or beside, a backend made from it: which device it calls current,
and how to name what a plugin raised."""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("hal")


def raised(exc: BaseException) -> str:
    """``Type: message`` of what a plugin raised, saying what ``SystemExit`` means."""
    if isinstance(exc, SystemExit):
        return f"SystemExit({exc.code!r}): it called sys.exit(); a plugin must raise or return a reason instead"
    return f"{type(exc).__name__}: {exc}"


def current_device(cls: Any) -> int:
    """The device a backend class calls current (its ``current_device()`` classmethod; 0 without one)."""
    ask = getattr(cls, "current_device", None)
    if ask is None:
        return 0
    try:
        device = ask()
    except Exception as exc:  # noqa: BLE001 - a plugin's query must not break selection: its first device then
        log.warning("%s.current_device() raised %s: using device 0", getattr(cls, "__name__", cls), raised(exc))
        return 0
    return device if isinstance(device, int) and not isinstance(device, bool) and device >= 0 else 0
