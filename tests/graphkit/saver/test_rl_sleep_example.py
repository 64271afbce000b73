"""The RL loop of examples/rl-sleep on fake: rollout in graphs, everything asleep while a trainer step takes the
memory, new weights loaded in place on wake, a graph replay bit-exact against eager after every wake."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

import hal
from tests.paths import ROOT

EXAMPLE_PATH = ROOT / "examples" / "rl-sleep" / "rl_sleep.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("rl_sleep_example", EXAMPLE_PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


rl_sleep = _load()


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """The tiny model's ops are far too small for intra-op threads, which only contend on a busy CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_two_rl_steps_sleep_everything_and_wake_with_new_weights_on_fake() -> None:
    with hal.get_backend("fake", **rl_sleep.FAKE_OPTIONS) as be:
        out = rl_sleep.rl_loop(be, "graphkit", steps=2, sizes=(1, 2, 4), rollout_steps=2)
        assert be.live.zero, be.live  # engine, graphs, regions and the trainer's memory all given back
    assert out["steps"] == 2 and out["all_exact"]
    for row in out["rows"]:
        assert row["replay_exact"] and row["replay_max_abs_diff"] == 0.0
        assert row["weights_changed"] and row["weights_loaded"] and row["weights_in_place"]
        assert row["released_bytes"] == out["awake_bytes"] > 0  # weights, KV cache and graphs: everything
        assert row["asleep_bytes"] == 0
        assert row["trainer_peak_bytes"] >= row["released_bytes"]  # the trainer really took the memory
        assert len(row["rollout_tokens"]) == 3 and all(len(t) == 2 for t in row["rollout_tokens"])
    assert out["first_pause_s"] > 0 and out["steady_pause"]["n"] == 1 and out["steady_resume"]["median"] > 0


def test_the_kv_cache_can_sleep_with_a_backup_and_the_first_pause_is_reported_against_the_steady_ones() -> None:
    with hal.get_backend("fake", **rl_sleep.FAKE_OPTIONS) as be:
        out = rl_sleep.rl_loop(be, "graphkit", steps=2, sizes=(1, 2), rollout_steps=2, kv_backup=True)
        assert be.live.zero, be.live
    assert out["kv_backup"] and out["all_exact"]
    summary = rl_sleep.combine([out])[0]
    assert summary["kv_backup"] and summary["first_over_steady_pause"] == pytest.approx(
        out["first_pause_s"] / out["rows"][1]["pause_s"])


def test_torch_memory_saver_needs_cuda_and_the_command_line_says_it_skipped(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with hal.get_backend("fake", **rl_sleep.FAKE_OPTIONS) as be:
        with pytest.raises(hal.UnsupportedError, match="CUDA"):
            rl_sleep.rl_loop(be, "tms")
        with pytest.raises(hal.InvalidArgumentError, match="impl="):
            rl_sleep.rl_loop(be, "vllm")
    rc = rl_sleep.main(["--backend", "fake", "--steps", "1", "--sizes", "1,2", "--json", str(tmp_path / "rl.json")])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "tms: skipped (torch_memory_saver needs CUDA)" in text and "graphkit" in text
    saved = json.loads((tmp_path / "rl.json").read_text())
    assert [r["impl"] for r in saved["results"]] == ["graphkit"] and saved["results"][0]["all_exact"]
    assert [r["impl"] for r in saved["summary"]] == ["graphkit"] and saved["summary"][0]["processes"] == 1


def test_the_figures_of_several_processes_combine_first_and_steady_apart() -> None:
    def run(impl: str, pauses: list[float]) -> dict:
        rows = [{"pause_s": p, "resume_s": p / 2, "load_weights_s": 0.01} for p in pauses]
        return {"impl": impl, "backend": "cuda", "config": "reference", "steps": len(rows), "awake_bytes": 5,
                "first_pause_s": pauses[0], "first_resume_s": pauses[0] / 2, "rows": rows, "released_bytes": 5,
                "asleep_bytes": 0, "trainer_peak_bytes": 4, "all_exact": True}

    summary = rl_sleep.combine([run("tms", [9.0, 1.0, 2.0]), run("graphkit", [3.0, 0.5, 0.25]),
                                run("graphkit", [5.0, 0.75, 0.5]), run("tms", [7.0, 3.0, 4.0])])
    assert [r["impl"] for r in summary] == ["graphkit", "tms"]
    ours, tms = summary
    assert ours["processes"] == 2 and ours["first_pause"] == {"median": 4.0, "min": 3.0, "max": 5.0, "n": 2}
    assert ours["steady_pause"] == {"median": 0.5, "min": 0.25, "max": 0.75, "n": 4}
    assert tms["steady_resume"] == {"median": 1.25, "min": 0.5, "max": 2.0, "n": 4} and tms["all_exact"]


@pytest.mark.cuda
def test_two_rl_steps_on_cuda() -> None:
    with hal.get_backend("cuda") as be:
        out = rl_sleep.rl_loop(be, "graphkit", steps=2, sizes=(1, 2, 4), rollout_steps=2)
    assert out["all_exact"], [(r["replay_max_abs_diff"], r["weights_loaded"]) for r in out["rows"]]
    # (what stays asleep -- the context, cuBLAS workspaces -- can exceed what three small sizes release)
    assert all(r["weights_changed"] and r["released_bytes"] > 0 for r in out["rows"])
