"""Graph buffers of two ranks read in place by each other over graphkit memory on NVIDIA GPUs (one GPU: both
ranks on it; two: one each): ``tests/cuda_scripts/peer_buffers.py`` (see its docstring)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.paths import ROOT, SCRIPTS

pytestmark = pytest.mark.cuda
log = logging.getLogger("tests.peer_buffers")


def test_two_ranks_read_each_others_graph_buffers_in_place_after_registration_and_after_a_sleep(
        tmp_path: Path) -> None:
    same = torch.cuda.device_count() < 2
    proc = subprocess.run([sys.executable, str(SCRIPTS / "peer_buffers.py"), "--world", "2", "--out", str(tmp_path),
                           "--timeout", "200", *(["--same-device"] if same else [])],
                          capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-8000:]
    data = json.loads((tmp_path / "peer_buffers.json").read_text())
    log.info("%s", json.dumps(data))
    for rank in data["ranks"]:
        assert rank["ok"] and rank["buffers"] == 32 and rank["graphs"] == 4, rank
        assert rank["distinct_sums"] > 8, rank  # the buffers hold what the replays wrote, not zeros
        assert rank["mapped"]["peers"] == 1 and rank["mapped"]["shared"] > 0, rank
