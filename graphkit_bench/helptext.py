"""The help of the bench's command lines: every flag states its default once."""

from __future__ import annotations

import argparse
from typing import Any


class OneDefaultFormatter(argparse.HelpFormatter):
    """Help that states each flag's default once: in the help's own words where they say ``default:``, else as
    ``(default: X)`` after it (``off`` for a switch)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if (not action.option_strings or "default:" in text or action.default in (None, argparse.SUPPRESS)
                or text == argparse.SUPPRESS):
            return action.help
        return f"{text} (default: {shown_default(action.default)})"


def shown_default(value: Any) -> str:
    """A default as a flag would take it: ``off``/``on`` for a switch, a list comma-separated."""
    if isinstance(value, bool):
        text = "on" if value else "off"
    elif isinstance(value, (list, tuple)):
        text = ",".join(map(str, value))
    else:
        text = str(value)
    return text.replace("%", "%%")  # argparse formats help with %
