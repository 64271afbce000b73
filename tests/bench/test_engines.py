"""The engine bench: one measured case of the engine-shaped decode loop on fake, and a run interrupted half-way
that keeps the cases it measured."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import hal
from graphkit_bench.engine_cases import run_engine_case


@pytest.mark.parametrize("strategy, order", [("own-kept", "descending"), ("graph_memory", "on-demand")])
def test_engine_case_of_the_bench(be: hal.Backend, strategy: str, order: str) -> None:
    result = run_engine_case(strategy, order, [1, 2, 4, 8], be, config="tiny", iters=3)
    assert result["strategy"] == strategy and result["order"] == order and result["sizes"] == [1, 2, 4, 8]
    assert result["tokens_equal"] is True and result["max_abs_error"] < 1e-4
    assert result["graph_memory_bytes"] > 0 and result["capture_seconds"] > 0
    assert set(result["replay_ms"]) == {"1", "8"} and all(ms > 0 for ms in result["replay_ms"].values())
    assert (result["replay_ms_1"], result["replay_ms_max"]) == (result["replay_ms"]["1"], result["replay_ms"]["8"])
    if strategy == "graph_memory":
        assert result["chunk_bytes"] == result["graph_memory_bytes"]  # on fake, the chunks are all it adds
        assert result["verified_graphs"] == 0 and result["verify_seconds"] == 0  # the verifier is opt-in
    else:
        assert result["chunk_bytes"] is None
    assert be.live.zero, be.live



def test_an_interrupted_bench_keeps_the_cases_it_measured(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from graphkit_bench import engines

    done: list[str] = []

    def one_case(workload: str, strategy: str, *args: object) -> dict:
        if done:
            raise KeyboardInterrupt  # the second case never finishes
        done.append(strategy)
        return {"strategy": strategy, "order": "descending"}

    monkeypatch.setattr(engines, "run_one", one_case)
    with pytest.raises(KeyboardInterrupt):
        engines.run_engine_bench("engine", "tiny", [1, 2], ["own-kept", "graph_memory"], ["descending"], runs=1,
                                 backend="fake", device=0, seed=0, iters=1, isolate=False, out_dir=tmp_path,
                                 command="test", progress=False)
    saved = json.loads((tmp_path / "bench-engine.json").read_text())
    assert saved["partial"] is True and saved["results"] == [{"strategy": "own-kept", "order": "descending", "run": 0}]
