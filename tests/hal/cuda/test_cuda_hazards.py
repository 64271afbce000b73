"""State born inside a capture lands in memory that other graphs overwrite (the hazard hal's stream
preparation prevents, with or without a warm-up on the capture stream).

The decoder script runs in a subprocess with a timeout, so a GPU hang fails
the test instead of hanging the suite.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.paths import ROOT, SCRIPTS

pytestmark = pytest.mark.cuda

SCRIPT = SCRIPTS / "decoder_capture.py"
TIMEOUT_S = 240


def run_decoder(*args: str) -> tuple[int | None, str, dict | None]:
    """Run the script; return (exit status or None on timeout, output, its RESULT)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               PYTHONUNBUFFERED="1")
    try:
        proc = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                              timeout=TIMEOUT_S, env=env)
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return None, out, None
    out = proc.stdout + proc.stderr
    result = next((json.loads(line[len("RESULT "):]) for line in proc.stdout.splitlines()
                   if line.startswith("RESULT ")), None)
    return proc.returncode, out, result


def test_decoder_with_warmup_replays_right_in_any_order() -> None:
    rc, out, result = run_decoder()
    assert rc is not None, f"hung for {TIMEOUT_S} s:\n{out[-3000:]}"
    assert rc == 0, out[-3000:]
    assert result is not None and result["max_rel_error"] < 2e-2
    assert result["leftover_blocks"] == {}, f"memory outlived a capture: {result}"


def test_decoder_without_warmup_needs_none() -> None:
    """Without a warm-up on the capture stream, the stream's cuBLAS state would be born inside the first
    capture (a hang, a wrong replay, or leftovers, before hal made it ahead of every capture): no more."""
    rc, out, result = run_decoder("--no-warmup")
    assert rc is not None, f"hung for {TIMEOUT_S} s:\n{out[-3000:]}"
    assert rc == 0, out[-3000:]
    assert result is not None and result["max_rel_error"] < 2e-2
    assert result["leftover_blocks"] == {}, f"memory outlived a capture: {result}"
