"""A custom all-reduce of torch's symmetric memory, captured in graphs over graphkit memory (two GPUs; four).

The device cases run ``tests/cuda_scripts/custom_allreduce.py`` (see its docstring): N ranks, each capturing
the all-reduce kinds at four sizes inside ``graphkit.graph_memory()``, every replay equal to NCCL's all-reduce
after other keys ran over the same chunks and after a sleep and resume, and the replay latency over graphkit
memory against torch's own graph pool. The CPU cases check the script's argument parsing, its statistics
and its launcher (with stand-in ranks).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.paths import ROOT, SCRIPTS
from tests.ranks import RankResult

log = logging.getLogger("tests.custom_allreduce")

SCRIPT = SCRIPTS / "custom_allreduce.py"
PHASES = ("replays, shuffled", "all replayed, then read", "after sleep and resume, shuffled",
          "after sleep and resume, all replayed, then read")


def script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("custom_allreduce_script", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# -- on the device --------------------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.multi_gpu
@pytest.mark.slow  # a process per rank, NCCL set up, every kind captured, aliased, slept and timed
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.gpus(4))])
def test_custom_allreduce_in_graphs_over_graphkit_memory(tmp_path: Path, world: int) -> None:
    """Every rank's graphs (their inputs and outputs in graphkit's chunks) equal NCCL's all-reduce, also after
    other keys aliased the chunks and after a sleep and resume; the latency against plain memory is logged."""
    proc = subprocess.run([sys.executable, str(SCRIPT), "--world", str(world), "--out", str(tmp_path),
                           "--timeout", "180", "--reps", "5", "--iters", "30"],
                          capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-8000:]
    data = json.loads((tmp_path / "custom_allreduce.json").read_text())
    log.info("%s", (tmp_path / "custom_allreduce.md").read_text().strip())
    assert len(data["ranks"]) == world
    for rank in data["ranks"]:
        kinds = rank["kinds_run"]
        assert "nccl" in kinds and {"one_shot_copy", "two_shot"} & set(kinds), rank  # a custom kind ran
        graphs = len(kinds) * 4
        assert rank["checks"] == dict.fromkeys(PHASES, graphs), rank["checks"]
        assert rank["graph_memory_is_graphkit"] and not rank["plain_memory_is_graphkit"], rank
        # what legacy IPC would be asked to register: the driver says no for every graph buffer
        assert rank["legacy_ipc_capable_graph_buffers"] in ([0], [None]), rank
        print(json.dumps({"rank": rank["rank"], "kinds": kinds, "multicast": rank["multicast"],
                          "ratios": {k: {n: round(v["ratio"], 3) for n, v in per.items()}
                                     for k, per in rank["latency"].items()}}))


# -- on the CPU: the script's own logic -------------------------------------------------------------------------


def test_arguments_are_parsed_and_bad_ones_refused(capsys: pytest.CaptureFixture[str]) -> None:
    m = script()
    args = m.parse_args(["--world", "4", "--sizes", "64,1024", "--kinds", "two_shot,nccl"])
    assert (args.world, args.sizes, args.kinds, args.rank) == (4, [64, 1024], ["two_shot", "nccl"], None)
    assert m.parse_args([]).sizes == list(m.SIZES)
    for bad in (["--kinds", "ring"], ["--world", "1"], ["--world", "4", "--sizes", "8"], ["--reps", "0"],
                ["--world", "2", "--rank", "2"]):
        with pytest.raises(SystemExit):
            m.parse_args(bad)
    assert "--kinds" in capsys.readouterr().err


def test_latency_statistics_and_the_ratio_of_interleaved_samples() -> None:
    m = script()
    s = m.stats([3.0, 1.0, 2.0, 10.0])
    assert (s["median"], s["min"], s["max"], s["n"]) == (2.5, 1.0, 10.0, 4)
    assert s["spread"] == pytest.approx(9.0 / 2.5)
    with pytest.raises(ValueError):
        m.stats([])
    c = m.compare([11.0, 12.0, 30.0], [10.0, 10.0, 20.0])
    assert c["ratio"] == pytest.approx(12.0 / 10.0)
    assert c["paired_ratio"] == pytest.approx(1.2)  # median of 1.1, 1.2, 1.5
    with pytest.raises(ValueError):
        m.compare([1.0], [1.0, 2.0])


def _rank_result(m: ModuleType, rank: int, ratio: float) -> dict:
    row = m.compare([ratio * 10.0] * 3, [10.0] * 3)
    return {"rank": rank, "device": "stand-in", "kinds_run": ["two_shot", "nccl"],
            "latency": {"two_shot": {"2048": row}, "nccl": {"2048": m.compare([50.0] * 3, [10.0] * 3)}}}


def test_launcher_writes_every_rank_and_the_table_line(tmp_path: Path) -> None:
    m = script()
    seen = {}

    def runner(path: Path, world: int, **kw: object) -> list[RankResult]:
        seen.update(kw, path=path, world=world)
        return [RankResult(r, 0, "noise\nRESULT " + json.dumps(_rank_result(m, r, 1.02)) + "\n") for r in range(world)]

    argv = ["--world", "4", "--out", str(tmp_path)]
    assert m.launch(m.parse_args(argv), argv, runner=runner) == 0
    assert seen["world"] == 4 and seen["args"][0] == "--rank-from-argv" and seen["path"] == SCRIPT
    env = seen["env"]
    assert isinstance(env, dict) and str(ROOT) in env["PYTHONPATH"].split(os.pathsep)
    data = json.loads((tmp_path / "custom_allreduce.json").read_text())
    assert [r["rank"] for r in data["ranks"]] == [0, 1, 2, 3] and data["summary"]["ok"]
    line = (tmp_path / "custom_allreduce.md").read_text()
    assert "4 ranks" in line and "worst 1.020x (two_shot, 4 KiB)" in line and "equal to NCCL" in line
    assert "nccl" not in line.split("|")[2]  # the NCCL reference is not counted as a custom all-reduce


def test_launcher_fails_when_a_rank_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    m = script()

    def runner(path: Path, world: int, **kw: object) -> list[RankResult]:
        return [RankResult(0, 0, "RESULT " + json.dumps(_rank_result(m, 0, 1.0))),
                RankResult(1, 1, "Traceback: rank 1, graph ('two_shot', 2048) differs")][:world]

    argv = ["--world", "2", "--out", str(tmp_path)]
    assert m.launch(m.parse_args(argv), argv, runner=runner) == 1
    data = json.loads((tmp_path / "custom_allreduce.json").read_text())
    assert data["ranks"][1]["failed"] == 1 and "differs" in data["ranks"][1]["output"]
    assert "FAILED" in (tmp_path / "custom_allreduce.md").read_text()
    assert "differs" in capsys.readouterr().err
