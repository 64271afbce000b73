"""``python -m graphkit demo`` and ``python -m graphkit bench``: the bench's command line, which comes with the
``bench`` extra and registers itself under the entry point group :data:`GROUP` (graphkit imports none of it)."""

from __future__ import annotations

import importlib.metadata
import sys
from collections.abc import Callable, Iterable

#: what to install when the bench, or a module it needs, is missing
INSTALL = "pip install \"hal-graphkit[bench]\" (from a checkout: pip install -e \".[bench]\")"
#: the entry point group of the command lines that ``python -m graphkit`` runs; the bench registers ``bench``
GROUP = "graphkit.commands"
#: the bench's registration as pyproject.toml writes it, for an install whose metadata predates the group
REGISTERED = importlib.metadata.EntryPoint(name="bench", value="graphkit_bench.cli:main", group=GROUP)


def command(found: Iterable[importlib.metadata.EntryPoint] | None = None) -> Callable[[list[str] | None], int]:
    """The registered command line (``found``: the group's entry points, default the installed ones); raises
    :class:`ModuleNotFoundError` when the bench is not installed."""
    entries = importlib.metadata.entry_points(group=GROUP) if found is None else found
    return next((e for e in entries if e.name == "bench"), REGISTERED).load()


def main(argv: list[str] | None = None) -> int:
    """Run the bench's command line; exit code 2 and one line on stderr when it is not installed."""
    try:
        cli = command()
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if missing.partition(".")[0] in ("graphkit", "hal") or missing.startswith("graphkit_bench."):
            raise  # a module of this distribution itself: a broken install, not a missing extra
        sys.stderr.write(f"python -m graphkit: error: the demo and the bench need the bench extra "
                         f"(no module named {missing!r}): {INSTALL}\n")
        return 2
    return cli(argv)


if __name__ == "__main__":
    sys.exit(main())
