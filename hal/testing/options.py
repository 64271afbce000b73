"""Parsing of ``--hal-option KEY=VALUE`` pairs."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from hal.testing.requirements import Requirements

_TRUE = {"true", "yes", "on"}
_FALSE = {"false", "no", "off"}


def parse_value(text: str) -> Any:
    """``"65536"``/``"0x10000"`` -> int, ``"true"``/``"false"`` -> bool, anything else -> str."""
    try:
        return int(text, 0)
    except ValueError:
        pass
    lowered = text.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    return text


def parse_options(pairs: Iterable[str]) -> dict[str, Any]:
    """Turn ``["granularity=65536", "path=/x"]`` into ``{"granularity": 65536, "path": "/x"}``."""
    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        key = key.strip()
        if not sep or not key.isidentifier():
            raise ValueError(f"--hal-option {pair!r}: expected KEY=VALUE with KEY a Python identifier")
        options[key] = parse_value(value)
    return options


def split_options(options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split parsed options into (backend options, requirement overrides)."""
    fields = set(Requirements.fields())
    backend = {k: v for k, v in options.items() if k not in fields}
    requirements = {k: v for k, v in options.items() if k in fields}
    return backend, requirements
