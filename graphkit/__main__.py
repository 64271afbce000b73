"""``python -m graphkit demo`` and ``python -m graphkit bench``: the command line of the bench, which lives
beside the library in ``graphkit_bench`` and comes with the ``bench`` extra."""

from __future__ import annotations

import sys

#: what to install when the bench, or a module it needs, is missing
INSTALL = "pip install \"hal-graphkit[bench]\" (from a checkout: pip install -e \".[bench]\")"


def main(argv: list[str] | None = None) -> int:
    """Run the bench's command line; exit code 2 and one line on stderr when it is not installed."""
    try:
        from graphkit_bench.cli import main as cli
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
