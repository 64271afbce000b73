"""``python -m hal`` lists the backends, and why unavailable ones are unavailable."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from tests.paths import ROOT

LINE = re.compile(r"^  (?P<name>\S+)\s+(?P<state>available|unavailable)\s+\[(?P<origin>[^\]]*)\]$")


def test_python_m_hal_lists_builtins_with_reasons() -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("HAL_BACKEND", None)
    proc = subprocess.run([sys.executable, "-m", "hal"], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    found: dict[str, tuple[str, str]] = {}
    for i, line in enumerate(lines):
        m = LINE.match(line)
        if not m:
            continue
        follow = lines[i + 1].strip() if i + 1 < len(lines) else ""
        found[m["name"]] = (m["state"], follow)
        assert m["origin"], line
    assert {"cuda", "ascend", "mlu", "fake"} <= set(found), proc.stdout
    assert found["fake"][0] == "available"
    assert found["fake"][1].startswith("devices: "), proc.stdout
    assert re.search(r"capabilities: \S", found["fake"][1]), proc.stdout  # an available backend's capabilities
    assert "graphs" in found["fake"][1].partition("capabilities: ")[2].split(", ")
    for name, (state, follow) in found.items():
        if state == "unavailable":
            assert re.match(r"reason: \S", follow), f"{name} is unavailable without a reason:\n{proc.stdout}"
    assert re.search(r"^selected by default: \S+$", proc.stdout, re.M), proc.stdout
