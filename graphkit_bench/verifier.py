"""Whether the bench turns graphkit's optional isolation verifier on (``--verify``), in every process it starts."""

from __future__ import annotations

import os

#: the variable ``--verify`` sets; the bench's processes (cases measured in fresh processes too) read it
ENV = "GRAPHKIT_BENCH_VERIFY"


def turn_on() -> None:
    """Turn the verifier on for this process and the processes it starts."""
    os.environ[ENV] = "1"


def on() -> bool:
    """Whether the bench's graph pools and runners verify their captures."""
    return os.environ.get(ENV, "") == "1"
