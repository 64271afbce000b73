"""nano-vllm, its source untouched, starts and generates under graphkit (one NVIDIA GPU; two for TP=2, four for TP=4).

Each case runs ``tests/cuda_scripts/nanovllm/run.py`` in processes of its own (a random-weight
Qwen3-0.6B-shaped checkpoint, 8 decode batch sizes, the engine's own warm-up and capture loop): under
``graph_memory()``, with the README's one-line port, and with ``GRAPHKIT_GRAPH_MEMORY=1``; in both capture
orders. Every rank replays each graph against its eager model; at TP=1 the engine generates. Every rank holds
a context on its own device only, and graphkit serves that device only. Needs the ``nano-vllm-fork`` package
and ``transformers``; skipped with the reason otherwise.
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
        if figures.get("contexts") is not None:  # nothing of this rank on another device: not even a context
            assert figures["contexts"] == [int(rank)], figures
        if result["mode"] == "switch":
            assert figures["served"] == [f"cuda:{rank}"], figures
        if result["mode"] == "port":
            assert figures["pools_device"] == int(rank), figures
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
        assert "8 key(s)" in report, report  # isolation by construction: the verifier is opt-in
    print(json.dumps(result["ranks"]["0"]))


@needs_engine
@pytest.mark.multi_gpu
@pytest.mark.parametrize("order", ["descending", "ascending"])
@pytest.mark.parametrize("mode", ["switch", "port", "scope"])
def test_nanovllm_tensor_parallel_ranks_each_use_graphkit_on_their_device(tmp_path: Path, mode: str,
                                                                         order: str) -> None:
    """TP=2: rank 1 is a process nano-vllm spawns; each rank's graphs replay right and live on its own device.
    (The engine's own TP generation fails in its code -- pickled sequences lose a field -- so the graphs are
    replayed directly, in both ranks together.)"""
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs, found {torch.cuda.device_count()}")
    result = start(tmp_path, mode, order, tp=2,
                   port=29600 + ("switch", "port", "scope").index(mode) * 10 + (order == "ascending"))
    print(json.dumps({rank: {k: f[k] for k in ("device", "graph_bytes", "capture_s")}
                      for rank, f in result["ranks"].items()}))
    check(result, tp=2)
    if mode == "switch":
        lines = [x for x in result["output"].splitlines() if x.startswith("graphkit: process")]
        for device in (0, 1):
            assert any(f"cuda:{device}" in x and "8 key(s)" in x for x in lines), lines
    elif mode == "port":
        assert all("8 key(s)" in (f["pools_report"] or "") for f in result["ranks"].values()), result["ranks"]
    else:  # rank 0 is the block's process; rank 1, spawned inside the block, is served with its options
        assert "8 key(s)" in (result["scope_report"] or ""), result["scope_report"]
        assert result["ranks"]["1"]["served"] == ["cuda:1"], result["ranks"]["1"]


#: the engine's own figures per (tp, order), measured once per test session
_OWN: dict[tuple[int, str], dict] = {}


def own_pool(tmp_path: Path, order: str, tp: int, port: int) -> dict:
    """The engine as it is (its one shared pool), the figures graphkit's are compared with."""
    if (tp, order) not in _OWN:
        _OWN[(tp, order)] = start(tmp_path, "own", order, tp=tp, port=port)
    return _OWN[(tp, order)]


def against_own(result: dict, own: dict) -> dict:
    """Per rank: graph memory (MiB) and capture seconds, graphkit's and the engine's own, and their ratios."""
    table = {}
    for rank, figures in result["ranks"].items():
        theirs = own["ranks"][rank]
        table[rank] = {"mib": round(figures["graph_bytes"] / 2**20, 1),
                       "own_mib": round(theirs["graph_bytes"] / 2**20, 1),
                       "memory_ratio": round(figures["graph_bytes"] / max(theirs["graph_bytes"], 1), 3),
                       "capture_s": round(figures["capture_s"], 2), "own_capture_s": round(theirs["capture_s"], 2),
                       "capture_ratio": round(figures["capture_s"] / max(theirs["capture_s"], 1e-9), 2)}
    return table


@needs_engine
@pytest.mark.gpus(4)
@pytest.mark.parametrize("order", ["descending", "ascending"])
@pytest.mark.parametrize("mode", ["switch", "port", "scope"])
def test_nanovllm_four_ranks_each_use_graphkit_on_their_device(tmp_path: Path, mode: str, order: str) -> None:
    """TP=4: ranks 1-3 are processes nano-vllm spawns. Under the switch, with the port and under the scope
    around ``LLM(...)`` every rank's graphs come from graphkit on its own device (the scope reaches the ranks
    the engine spawns inside it, which never run the block, through the variable it sets for them). Each
    rank's graph memory and capture time are printed next to the engine's own pool's, in the same order."""
    port = 29700 + 10 * ("switch", "port", "scope").index(mode) + (order == "ascending")
    result = start(tmp_path, mode, order, tp=4, port=port)
    own = own_pool(tmp_path, order, tp=4, port=29690 + (order == "ascending"))
    table = against_own(result, own)
    print(json.dumps({"mode": mode, "order": order, "tp": 4, "ranks": table}))
    check(result, tp=4)
    check(own, tp=4)
    if mode == "switch":
        lines = [x for x in result["output"].splitlines() if x.startswith("graphkit: process")]
        for device in range(4):
            assert any(f"cuda:{device}" in x and "8 key(s)" in x for x in lines), lines
    elif mode == "port":
        assert all("8 key(s)" in (f["pools_report"] or "") for f in result["ranks"].values()), result["ranks"]
    else:
        assert "8 key(s)" in (result["scope_report"] or ""), result["scope_report"]  # rank 0: the block itself
        assert result["ranks"]["0"]["served"] is None, result["ranks"]["0"]
        for rank in ("1", "2", "3"):  # the spawned ranks: the switch, with the block's options
            assert result["ranks"][rank]["served"] == [f"cuda:{rank}"], result["ranks"][rank]
    for rank in ("0", "1", "2", "3"):  # graphkit never pays more than the engine's own pool, in either order
        assert table[rank]["mib"] <= table[rank]["own_mib"] + 32, table
