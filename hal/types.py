"""Small value types shared by the facade, the backends and graphkit."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MemInfo:
    """Device memory as the driver reports it, in bytes."""

    free: int
    total: int

    @property
    def used(self) -> int:
        return self.total - self.free


@dataclass(frozen=True)
class BackendInfo:
    """One entry of :func:`hal.list_backends`."""

    name: str
    available: bool
    reason: str
    """Why the backend is unavailable ("" when it is available)."""
    origin: str
    """``"built-in"`` or the distribution that provides it (``"name version"``)."""
    priority: int
    """Lower is preferred when no backend is named."""


@dataclass(frozen=True)
class Mapping:
    """One live mapping recorded by the facade."""

    ptr: int
    size: int
    handle: object


def round_up(n: int, multiple: int) -> int:
    """Round ``n`` up to a multiple of ``multiple``."""
    return -(-n // multiple) * multiple


def fmt_bytes(n: float) -> str:
    """Human-readable bytes: ``fmt_bytes(3 << 20) == '3.0 MiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
