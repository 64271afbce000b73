"""``python -m graphkit_bench demo`` and ``bench``: the same command line as ``python -m graphkit``."""

import sys

from graphkit_bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
