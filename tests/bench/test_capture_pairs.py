"""Capture time judged in paired fresh processes (python -m graphkit_bench.capture_pairs)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import hal
from graphkit_bench import capture_pairs
from graphkit_bench.capture_pairs import judge_pairs


def _pairs(ratios: list[float]) -> list[dict[str, Any]]:
    return [{"pair": i, "first": "vmm", "ours": {"capture_seconds": r}, "theirs": {"capture_seconds": 1.0},
             "ratio": r} for i, r in enumerate(ratios)]


def test_the_pairs_ratios_are_judged_against_11() -> None:
    assert judge_pairs(_pairs([1.0, 1.02, 0.98, 1.05, 1.01, 0.99, 1.03, 1.0, 1.04, 0.97]))["met"] is True
    missed = judge_pairs(_pairs([1.3, 1.25, 1.4, 1.22, 1.35, 1.3, 1.28, 1.31, 1.33, 1.27]))
    assert missed["met"] is False and missed["ratio"]["median"] == pytest.approx(1.30)
    straddles = judge_pairs(_pairs([0.9, 1.3, 0.95, 1.25, 1.0, 1.2, 1.05, 1.15, 1.1, 1.12]))
    assert straddles["met"] is None and "straddles 1.1" in straddles["why"]
    few = judge_pairs(_pairs([1.0, 1.0]))
    assert few["met"] is None and "too few" in few["why"]


def test_the_pairs_alternate_which_goes_first(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    seen: list[str] = []

    def child(argv: list[str], strategy: str, path: Path, timeout: float) -> dict[str, Any]:
        seen.append(strategy)
        assert timeout == 7.0  # every process gets the timeout
        return {"strategy": strategy, "capture_seconds": 2.0 if strategy == "graph_memory" else 1.0}

    monkeypatch.setattr(capture_pairs, "run_child", child)
    pairs = capture_pairs.run_pairs([], "engine", 3, tmp_path, timeout=7.0, progress=False)
    assert seen == ["graph_memory", "own-kept", "own-kept", "graph_memory", "graph_memory", "own-kept"]
    assert [p["first"] for p in pairs] == ["graph_memory", "own-kept", "graph_memory"]
    assert [p["ratio"] for p in pairs] == [2.0, 2.0, 2.0]


def test_a_process_past_its_timeout_is_an_error_naming_the_flag(tmp_path: Path) -> None:
    with pytest.raises(hal.HalError, match="--timeout"):
        capture_pairs.run_child(["--backend", "fake", "--config", "tiny"], "vmm", tmp_path / "x.json", 0.05)


@pytest.mark.slow
def test_two_pairs_on_fake_write_the_figures(tmp_path: Path) -> None:
    assert capture_pairs.main(["--backend", "fake", "--config", "tiny", "--pairs", "2", "--no-progress",
                               "--out-dir", str(tmp_path)]) == 0
    out = json.loads((tmp_path / "capture-pairs-reference.json").read_text())
    assert out["strategies"] == ["vmm", "shared-weakref"] and len(out["pairs"]) == 2
    assert [p["first"] for p in out["pairs"]] == ["vmm", "shared-weakref"]
    for p in out["pairs"]:
        assert p["ours"]["strategy"] == "vmm" and p["theirs"]["strategy"] == "shared-weakref"
        assert p["ratio"] == pytest.approx(p["ours"]["capture_seconds"] / p["theirs"]["capture_seconds"])
    assert out["target"]["met"] is None and "too few" in out["target"]["why"]  # 2 pairs are not judged
    text = (tmp_path / "capture-pairs-reference.md").read_text()
    assert "the target asks for 10 at least" in text and "| 1 | shared-weakref |" in text


@pytest.mark.parametrize(("args", "flag"), [(["--pairs", "0"], "--pairs"), (["--workload", "x"], "--workload"),
                                            (["--timeout", "0"], "--timeout")])
def test_bad_flags_exit_2_naming_the_flag(args: list[str], flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        capture_pairs.main(["--backend", "fake", *args])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and flag in err[0], err
