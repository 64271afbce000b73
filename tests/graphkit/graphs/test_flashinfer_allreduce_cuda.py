"""FlashInfer's custom all-reduce (its vLLM-style kernel, built by its JIT on the device) in graphs over graphkit
memory, two GPUs and four: ``tests/cuda_scripts/flashinfer_allreduce.py`` (see its docstring).

The graph's input staged into FlashInfer's own registered buffer replays equal to NCCL's all-reduce after other
keys ran over the same chunks and after a sleep and resume; the path that registers the graph's own buffers by
legacy IPC is refused on graphkit memory, with FlashInfer's own error naming the call that failed; with graphkit
serving that registration (``--serve``), the graph's own buffers are read in place, equal to the reference
all-reduce through the same checks (on one GPU: both ranks on it). Skipped where ``flashinfer`` is not installed
(``flashinfer-python``, or the cut of it ``tests/cuda_scripts/flashinfer_site.py`` makes; its JIT needs ``nvcc``).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from tests.paths import ROOT, SCRIPTS

log = logging.getLogger("tests.flashinfer_allreduce")

SCRIPT = SCRIPTS / "flashinfer_allreduce.py"
SKIP = 3  # the script's exit code where FlashInfer or its JIT is missing

pytestmark = [pytest.mark.cuda, pytest.mark.slow,  # FlashInfer's JIT build, a process per rank
              pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None,
                                 reason="needs flashinfer-python (FlashInfer's JIT builds its all-reduce here)")]


def run(tmp_path: Path, world: int, kinds: str, *extra: str) -> tuple[subprocess.CompletedProcess[str], dict]:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--world", str(world), "--kinds", kinds, "--out",
                           str(tmp_path), "--timeout", "240", "--reps", "5", "--iters", "30", *extra],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    if proc.returncode == SKIP:
        pytest.skip(next(x for x in proc.stdout.splitlines() if x.startswith("SKIP ")))
    return proc, json.loads((tmp_path / "flashinfer_allreduce.json").read_text())


@pytest.mark.multi_gpu
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.gpus(4))])
def test_flashinfer_allreduce_staged_in_graphs_over_graphkit_memory(tmp_path: Path, world: int) -> None:
    proc, data = run(tmp_path, world, "staged,nccl")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-8000:]
    log.info("%s", (tmp_path / "flashinfer_allreduce.md").read_text().strip())
    assert len(data["ranks"]) == world
    for rank in data["ranks"]:
        assert rank["graph_memory_is_graphkit"] == {"staged": True, "nccl": True}, rank
        assert not rank["refused"] and set(rank["checks"].values()) == {6}, rank  # 3 sizes x 2 kinds, 4 phases


@pytest.mark.multi_gpu
def test_flashinfer_graph_registration_by_legacy_ipc_is_refused_on_graphkit_memory(tmp_path: Path) -> None:
    proc, data = run(tmp_path, 2, "registered,nccl")
    assert proc.returncode == 1, (proc.stdout + proc.stderr)[-8000:]
    for rank in data["ranks"]:
        assert set(rank["refused"]) == {"registered"} and "invalid argument" in rank["refused"]["registered"]
        assert rank["legacy_ipc_capable_graph_buffers"]["registered"] == [0], rank
        assert rank["legacy_ipc_capable_plain_buffers"] == [1], rank  # torch's own pool: capable


@pytest.mark.parametrize("by", ["call", "switch"])
def test_flashinfer_reads_graph_buffers_in_place_over_graphkit_memory_when_graphkit_serves_the_registration(
        tmp_path: Path, by: str) -> None:
    """``call``: the rank calls serve_flashinfer(); ``switch``: it starts with GRAPHKIT_GRAPH_MEMORY=allreduce=
    flashinfer and calls nothing (the switch's pools then take the plain graphs too: the registered kind alone)."""
    import torch

    same = ["--same-device"] if torch.cuda.device_count() < 2 else []
    kinds, flag = ("registered,staged", "--serve") if by == "call" else ("registered", "--switch-serves")
    proc, data = run(tmp_path, 2, kinds, flag, *same)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-8000:]
    for rank in data["ranks"]:
        assert rank["served_by"] == by and not rank["refused"], rank
        assert rank.get("namespace_served", True), rank
        assert all(rank["graph_memory_is_graphkit"].values()), rank
        assert rank["legacy_ipc_capable_graph_buffers"]["registered"] == [0], rank  # in place all the same
        assert set(rank["checks"].values()) == {6 if by == "call" else 3}, rank  # 3 sizes x the kinds, 4 phases
