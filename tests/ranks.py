"""Two (or more) rank processes for the multi-GPU tests: a deadline for all of them, no rank left behind.

A rank that fails leaves its peers blocked in a collective; a rank that
hangs would hold the run. :func:`run_ranks` kills every rank at the deadline,
and the others a few seconds after one failed, and returns what each printed.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

#: seconds the other ranks get to finish after one exited with an error
GRACE = 10.0


@dataclass
class RankResult:
    rank: int
    returncode: int | None  # None: killed at the deadline (or after a peer failed)
    output: str  # stdout and stderr together

    @property
    def ok(self) -> bool:
        return self.returncode == 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_env(**extra: str) -> dict[str, str]:
    """The environment of a rank: this one's, the project on the path, a rendezvous port, ``extra``."""
    return dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]), **extra)


def run_ranks(script: Path, world: int = 2, *, timeout: float = 150.0, env: dict[str, str] | None = None,
              args: Sequence[str] = (), pass_fds: Sequence[Sequence[int]] = ()) -> list[RankResult]:
    """Run ``python script RANK *args`` for every rank; every rank is gone when this returns.

    :param pass_fds: per rank, descriptors it inherits (its argv can name them).
    """
    env = env if env is not None else rank_env()
    with contextlib.ExitStack() as stack:
        # files, not pipes: a chatty rank never blocks on a full pipe
        outs = [stack.enter_context(tempfile.TemporaryFile(mode="w+")) for _ in range(world)]
        procs: list[subprocess.Popen[str]] = []
        killed = [True] * world
        try:
            for rank in range(world):
                procs.append(subprocess.Popen([sys.executable, str(script), str(rank), *args], env=env,
                                              stdout=outs[rank], stderr=subprocess.STDOUT, text=True,
                                              pass_fds=tuple(pass_fds[rank]) if pass_fds else ()))
            deadline = time.monotonic() + timeout
            while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
                if any(p.returncode not in (None, 0) for p in procs):
                    deadline = min(deadline, time.monotonic() + GRACE)
                time.sleep(0.2)
        finally:
            for rank, p in enumerate(procs):
                killed[rank] = p.poll() is None
                if killed[rank]:
                    p.kill()
            for p in procs:
                p.wait()
        results = []
        for rank, (p, out) in enumerate(zip(procs, outs, strict=True)):
            out.seek(0)
            results.append(RankResult(rank, None if killed[rank] else p.returncode, out.read()))
        return results


def explain(results: list[RankResult], tail: int = 6000) -> str:
    """What each rank printed (the end of it), for an assertion message."""
    parts = []
    for r in results:
        state = "killed (deadline, or a peer failed)" if r.returncode is None else f"exit {r.returncode}"
        parts.append(f"--- rank {r.rank}: {state}\n{r.output[-tail:]}")
    return "\n".join(parts)
