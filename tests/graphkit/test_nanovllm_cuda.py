"""nano-vllm, its source untouched, starts and generates under graphkit (one NVIDIA GPU; two for TP=2).

Each case runs ``tests/cuda_scripts/nanovllm/run.py`` in processes of its own (a random-weight
Qwen3-0.6B-shaped checkpoint, 8 decode batch sizes, the engine's own warm-up and capture loop): under
``graph_memory()``, with the README's one-line port, and with ``GRAPHKIT_GRAPH_MEMORY=1``; in both capture
orders. Every rank replays each graph against its eager model; at TP=1 the engine generates. Needs the
``nano-vllm-fork`` package and ``transformers``; skipped with the reason otherwise.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.paths import ROOT, SCRIPTS

pytestmark = [pytest.mark.cuda, pytest.mark.slow]

RUN = SCRIPTS / "nanovllm" / "run.py"
MISSING = [name for name in ("nanovllm", "transformers", "xxhash") if importlib.util.find_spec(name) is None]
needs_engine = pytest.mark.skipif(bool(MISSING), reason=f"nano-vllm's test needs {', '.join(MISSING)}")


def start(tmp_path: Path, mode: str, order: str, tp: int = 1, port: int = 29517) -> dict:
    """Start the engine in ``mode``; the RESULT of run.py (every rank's figures), with its ``output``."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, str(RUN), "--mode", mode, "--order", order, "--tp", str(tp),
                           "--out", str(tmp_path / f"{mode}-{order}-{tp}"), "--port", str(port)],
                          capture_output=True, text=True, timeout=480, env=env)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-5000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))
    return {**json.loads(line[len("RESULT "):]), "output": output}


def check(result: dict, tp: int) -> None:
    assert len(result["ranks"]) == tp, result
    for rank, figures in result["ranks"].items():
        assert figures["device"] == int(rank), figures  # each rank's graphs on its own device
        assert len(figures["sizes"]) == 8
        assert max(figures["check_relative_error"].values()) < 2e-2, figures
    if tp == 1:
        assert result["generated"] == [16, 16, 16, 16]


@needs_engine
@pytest.mark.parametrize("order", ["descending", "ascending"])
@pytest.mark.parametrize("mode", ["scope", "port", "switch"])
def test_nanovllm_starts_and_generates_under_graphkit(tmp_path: Path, mode: str, order: str) -> None:
    result = start(tmp_path, mode, order)
    check(result, tp=1)
    if mode == "switch":  # the process's report line, logged by graphkit in the engine's process
        lines = [x for x in result["output"].splitlines() if x.startswith("graphkit: process")]
        assert any("cuda:0" in x and "8 key(s)" in x for x in lines), result["output"][-3000:]
    else:
        report = result["scope_report"] or result["ranks"]["0"]["pools_report"]
        assert "8 key(s)" in report and "verified isolated" in report, report
    print(json.dumps(result["ranks"]["0"]))


@needs_engine
@pytest.mark.multi_gpu
@pytest.mark.parametrize("order", ["descending", "ascending"])
@pytest.mark.parametrize("mode", ["switch", "port"])
def test_nanovllm_tensor_parallel_ranks_each_use_graphkit_on_their_device(tmp_path: Path, mode: str,
                                                                         order: str) -> None:
    """TP=2: rank 1 is a process nano-vllm spawns; each rank's graphs replay right and live on its own device.
    (The engine's own TP generation fails in its code -- pickled sequences lose a field -- so the graphs are
    replayed directly, in both ranks together.)"""
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs, found {torch.cuda.device_count()}")
    result = start(tmp_path, mode, order, tp=2, port=29600 + (mode == "port") * 10 + (order == "ascending"))
    print(json.dumps({rank: {k: f[k] for k in ("device", "graph_bytes", "capture_s")}
                      for rank, f in result["ranks"].items()}))
    check(result, tp=2)
    if mode == "switch":
        lines = [x for x in result["output"].splitlines() if x.startswith("graphkit: process")]
        for device in (0, 1):
            assert any(f"cuda:{device}" in x and "8 key(s)" in x for x in lines), lines
    else:
        assert all("8 key(s)" in (f["pools_report"] or "") for f in result["ranks"].values()), result["ranks"]
