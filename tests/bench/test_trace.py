"""The serving trace (python -m graphkit_bench.trace): its seeded serving run, its replay through the runner and
the scope on fake, and how its targets and the recommended executables budget are judged."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import hal
from graphkit_bench import trace
from graphkit_bench.trace import Strategy, TraceOptions, recommend, simulate, summarise


def test_the_serving_run_is_seeded_and_has_the_steps_asked_for() -> None:
    opts = TraceOptions(steps=2000, max_batch=256, seed=3)
    a, b = simulate(opts), simulate(opts)
    assert a.batches == b.batches and a.arrivals == b.arrivals and a.departures == b.departures
    assert simulate(TraceOptions(steps=2000, max_batch=256, seed=4)).batches != a.batches
    assert len(a.batches) == len(a.arrivals) == len(a.departures) == len(a.waiting) == 2000
    assert all(1 <= n <= 256 for n in a.batches)


def test_requests_arrive_run_and_depart_as_counted() -> None:
    t = simulate(TraceOptions(steps=3000, max_batch=32, seed=1, mean_length=16, load=0.8))
    for i in range(len(t.batches) - 1):
        stayed = t.batches[i] - t.departures[i]  # nobody leaves but those done
        joined = t.batches[i + 1] - stayed
        assert 0 <= joined <= t.arrivals[i + 1] + t.waiting[i], i  # those who join arrived or waited
        assert t.waiting[i] == 0 or t.batches[i] == 32  # a request waits only while the batch is full
    running_at_end = t.batches[-1] - t.departures[-1]
    assert sum(t.arrivals) == sum(t.departures) + running_at_end + t.waiting[-1]
    assert max(t.batches) == 32 and max(t.waiting) > 0  # heavy load fills the batch and queues
    assert min(t.batches) <= 4  # light load drains it: the rate swings
    summary = t.summary([1, 2, 4, 8, 16, 32])
    assert summary["finished"] == sum(t.departures) and summary["sizes_used"] == 6
    assert sum(summary["steps_per_size"].values()) == 3000


@pytest.mark.parametrize("bad", [{"steps": 0}, {"max_batch": -1}, {"swing": 1.0}, {"load": 0}])
def test_bad_trace_options_are_refused_by_name(bad: dict[str, Any]) -> None:
    with pytest.raises(hal.InvalidArgumentError, match=next(iter(bad))):
        TraceOptions(**bad)


def test_the_trace_replays_through_the_runner_and_the_scope_on_fake(tmp_path: Path) -> None:
    code = trace.main(["--backend", "fake", "--config", "tiny", "--steps", "40", "--rounds", "3", "--ks", "1",
                       "--processes", "0", "--no-progress", "--out-dir", str(tmp_path)])
    assert code == 0
    out = json.loads((tmp_path / "trace.json").read_text())
    names = [r["strategy"] for r in out["rows"]]
    default = "lazy"  # graphkit's default budget: an executable per size at its first replay
    assert default == trace.DEFAULT
    assert names == ["runner all", "runner K=1", f"runner {default}", "scope all", "scope K=1", f"scope {default}"]
    rows = {r["strategy"]: r for r in out["rows"]}
    for r in out["rows"]:
        assert r["steps"] == 40 and r["mean_ms"] > 0 and r["p50_ms"] <= r["p99_ms"]
        assert r["max_rel_error"] < 1e-4, r
    for path in ("runner", "scope"):
        assert rows[f"{path} all"]["ratio_mean"] == 1.0 and rows[f"{path} all"]["updates_per_step"] == 0
        one = rows[f"{path} K=1"]
        # one topology on the host, one executable: updated at every change of size, instantiated once
        assert one["executables"]["median"] == 1 and one["instantiations"]["median"] == 1
        assert one["updates"]["median"] == out["trace"]["size_changes"] > 0
        assert one["updates_per_step"] == pytest.approx(out["trace"]["size_changes"] / 40)
        # the steps that neither updated nor instantiated its executable, timed against the same steps of all
        assert one["quiet_steps"] == 40 - out["trace"]["size_changes"] - 1 and one["ratio_quiet_mean"] > 0
        assert rows[f"{path} all"]["quiet_steps"] == 40 and rows[f"{path} all"]["ratio_quiet_mean"] == 1.0
        assert one["targets"]["mean"]["met"] is None and "40 steps" in one["targets"]["mean"]["why"]
        lazy = rows[f"{path} {default}"]  # an executable per size replayed, never updated
        assert lazy["updates"]["median"] == 0 and lazy["executables"]["median"] >= 1
    assert out["recommendation"]["k"] is None and "no budget was judged" in out["recommendation"]["why"]
    text = (tmp_path / "trace.md").read_text()
    assert "| scope K=1 |" in text and "## Recommended default" in text


def _process(times: dict[str, list[float]], bytes_of: dict[str, int]) -> dict[str, Any]:
    """A crafted process: step times per strategy, 4 rounds."""
    steps = len(next(iter(times.values())))
    bounds = [(k * steps // 4, (k + 1) * steps // 4) for k in range(4)]
    strategies = {}
    for name, t in times.items():
        k = None if name.endswith("all") else int(name.split("=")[1])
        stats = None if k is None else {"executables": k, "driver_bytes": bytes_of[name], "updates": 10,
                                        "instantiations": k, "refused": 0, "topologies": 1}
        strategies[name] = {"times_ms": t, "setup": {"capture_seconds": 1.0, "graphs": 35, "driver_bytes": 100},
                            "stats": stats, "max_rel_error": 0.0}
    return {"bounds": bounds, "strategies": strategies}


def test_the_recommended_budget_is_the_smallest_that_meets_both_targets() -> None:
    plan = [Strategy("runner", None), Strategy("runner", 1), Strategy("runner", 2), Strategy("runner", 4)]
    base = [3.0] * 400
    slow_tail = [4.5 if i % 40 == 0 else 3.0 for i in range(400)]  # 2.5% of steps 1.5 x, in every round: p99 1.5 x
    slower = [3.3] * 400  # mean 1.1 x
    processes = [_process({"runner all": base, "runner K=1": slower, "runner K=2": slow_tail,
                           "runner K=4": [3.01] * 400}, {"runner K=1": 1, "runner K=2": 2, "runner K=4": 4})
                 for _ in range(3)]
    rows = summarise(processes, plan, judged=True)
    by = {r["strategy"]: r for r in rows}
    assert by["runner K=1"]["targets"]["mean"]["met"] is False and by["runner K=1"]["targets"]["p99"]["met"] is True
    assert by["runner K=2"]["targets"]["mean"]["met"] is True and by["runner K=2"]["targets"]["p99"]["met"] is False
    assert by["runner K=4"]["targets"]["mean"]["met"] is True and by["runner K=4"]["targets"]["p99"]["met"] is True
    assert by["runner K=2"]["ratio_p99"] == pytest.approx(1.5) and by["runner K=1"]["ratio_mean"] == pytest.approx(1.1)
    rec = recommend(rows)
    assert rec["k"] == 4 and [e["met"] for e in rec["evidence"]] == [False, False, True]
    assert "mean 1.100 x (missed), p99 1.100 x (met)" in trace.markdown(_result(rows, rec))
    unjudged = summarise(processes, plan, judged=False, why_not="the device is the host")
    why = "not judged: the device is the host"
    assert unjudged[3]["targets"]["mean"] == {"met": None, "why": why, "interval": None}
    assert recommend(unjudged)["k"] is None
    few = [_process({"runner all": base, "runner K=1": base, "runner K=2": base, "runner K=4": base},
                    {"runner K=1": 1, "runner K=2": 2, "runner K=4": 4})]
    assert summarise(few, plan, judged=True)[1]["targets"]["mean"]["met"] is None  # 4 rounds are too few
    # the tail in one round of each process: pooled p99 1.5 x, but resampling rounds cannot rule out 1.0
    clustered = [_process({"runner all": base, "runner K=1": [3.0] * 390 + [4.5] * 10, "runner K=2": base,
                           "runner K=4": base}, {"runner K=1": 1, "runner K=2": 2, "runner K=4": 4}) for _ in range(3)]
    tail = summarise(clustered, plan, judged=True)[1]
    assert tail["ratio_p99"] == pytest.approx(1.5) and tail["targets"]["p99"]["met"] is None
    assert "straddles 1.25" in tail["targets"]["p99"]["why"]


def _result(rows: list[dict[str, Any]], rec: dict[str, Any]) -> dict[str, Any]:
    return {"trace": {"steps": 400, "min_batch": 1, "max_batch": 256, "mean_batch": 100.0, "requests": 9,
                      "sizes_used": 3, "size_changes": 5}, "machine": {"backend": "cuda", "device_name": "H200"},
            "config": "reference", "sizes": [1, 256], "command": "c", "options": {"seed": 0}, "processes": 3,
            "rounds": 4, "rows": rows, "recommendation": rec}


def test_a_trace_process_past_its_timeout_is_an_error_naming_the_flag(tmp_path: Path) -> None:
    with pytest.raises(hal.HalError, match="--timeout"):
        trace.main(["--backend", "fake", "--config", "tiny", "--processes", "1", "--timeout", "0.05",
                    "--out-dir", str(tmp_path), "--no-progress"])


@pytest.mark.parametrize(("args", "flag"), [(["--ks", "0"], "--ks"), (["--paths", "engine"], "--paths"),
                                            (["--steps", "-1"], "--steps"), (["--processes", "-1"], "--processes")])
def test_bad_flags_exit_2_naming_the_flag(args: list[str], flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        trace.main(["--backend", "fake", *args])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and flag in err[0], err
