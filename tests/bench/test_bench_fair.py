"""Fair comparisons in the bench: cases run by run with no strategy in a fixed place, figures as median and spread."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from graphkit_bench import engines
from graphkit_bench.fair import fmt_spread, interleaved, rotated, spread


def test_every_run_visits_every_strategy_and_the_first_rotates() -> None:
    cases = interleaved(["a", "b", "c"], ["desc", "asc"], 3)
    assert cases[:6] == [("a", "desc", 0), ("b", "desc", 0), ("c", "desc", 0),
                         ("a", "asc", 0), ("b", "asc", 0), ("c", "asc", 0)]
    assert [s for s, o, i in cases if o == "desc"] == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    firsts = [cases[6 * i][0] for i in range(3)]
    assert firsts == ["a", "b", "c"]  # over as many runs as strategies, each goes first once
    assert sorted(cases) == sorted((s, o, i) for s in "abc" for o in ("desc", "asc") for i in range(3))
    assert rotated([], 3) == [] and rotated([1, 2], 5) == [2, 1]


def test_spread_is_the_median_with_min_and_max() -> None:
    assert spread([3.0, 1.0, 2.0, None, 10.0]) == {"median": 2.5, "min": 1.0, "max": 10.0, "n": 4}
    assert spread([None]) == {"median": None, "min": None, "max": None, "n": 0}
    assert fmt_spread(spread([0.001, 0.002, 0.004]), 1e3, 1) == "2.0 (1.0-4.0)"
    assert fmt_spread(spread([0.5]), 1.0, 2) == "0.50" and fmt_spread(spread([])) == "-"


def test_the_engine_bench_interleaves_its_cases_and_reports_the_spread(monkeypatch: pytest.MonkeyPatch,
                                                                      tmp_path: Path) -> None:
    """Strategy-major order gave every run of one strategy the same neighbours; now runs alternate."""
    seen: list[tuple[str, str, int]] = []

    def one_case(workload, strategy, order, sizes, backend, device, config, seed, iters) -> dict:
        seen.append((strategy, order, seed))
        capture = {"own-kept": 1.0, "graph_memory": 2.0}[strategy] + seed / 10
        return {"strategy": strategy, "order": order, "graph_memory_bytes": 100 + seed, "chunk_bytes": None,
                "capture_seconds": capture, "replay_ms_1": 1.0 + seed, "replay_ms_max": 2.0, "tokens_equal": True}

    monkeypatch.setattr(engines, "run_one", one_case)
    rc = engines.run_engine_bench("engine", "tiny", [1, 2], ["own-kept", "graph_memory"], ["descending"], runs=3,
                                  backend="fake", device=0, seed=0, iters=1, isolate=False, out_dir=tmp_path,
                                  command="test", progress=False)
    assert rc == 0
    assert seen == [("own-kept", "descending", 0), ("graph_memory", "descending", 0),
                    ("graph_memory", "descending", 1), ("own-kept", "descending", 1),
                    ("own-kept", "descending", 2), ("graph_memory", "descending", 2)]
    saved = json.loads((tmp_path / "bench-engine.json").read_text())
    assert saved["case_order"] == "interleaved"
    own = next(r for r in saved["summary"] if r["strategy"] == "own-kept")
    assert own["capture_seconds"] == pytest.approx(1.1)
    assert own["spread"]["capture_seconds"] == pytest.approx({"median": 1.1, "min": 1.0, "max": 1.2, "n": 3})
    assert own["spread"]["replay_ms_1"] == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3}
    assert own["spread"]["graph_memory_bytes"]["max"] == 102
    assert "1.100 (1.000-1.200)" in engines.table(saved["summary"])


def test_the_sleep_bench_alternates_graphkit_and_torch_memory_saver(monkeypatch: pytest.MonkeyPatch,
                                                                   tmp_path: Path) -> None:
    """Round by round the one that goes first swaps; figures are medians of every cycle, first pauses apart."""
    from graphkit_bench import sleep

    calls: list[tuple[str, bool]] = []
    real = sleep.graphkit_case

    def graphkit_case(be, nbytes, backup, cycles):
        calls.append(("graphkit", backup))
        return real(be, nbytes, backup, cycles)

    def tms_case(be, nbytes, backup, cycles):  # a stand-in: torch_memory_saver needs CUDA
        calls.append(("tms", backup))
        n = len(calls)
        return {"impl": "torch_memory_saver", "bytes": nbytes, "backup": backup, "pauses": [n, 0.5],
                "resumes": [n, 0.25], "asleep_each": [0, 0], "exact": True}

    def recorded(name, real_case):
        def case(be, nbytes, backup, cycles):
            calls.append((name, backup))
            return real_case(be, nbytes, backup, cycles)
        return case

    monkeypatch.setattr(sleep, "graphkit_case", graphkit_case)
    monkeypatch.setattr(sleep, "tms_case", tms_case)
    monkeypatch.setattr(sleep, "elastic_case", recorded("elastic", sleep.elastic_case))
    monkeypatch.setattr(sleep, "hal_case", recorded("hal", sleep.hal_case))
    rc = sleep.run_sleep_bench("fake", 0, [2 << 20], 2, tmp_path, "test", rounds=3)
    assert rc == 0
    measured = calls[8:]  # after one untimed warm-up case of each kind and backup
    kinds = ["graphkit", "tms", "elastic", "hal"]
    assert measured == [(k, backup) for backup in (False, True) for i in range(3) for k in kinds[i:] + kinds[:i]]
    out = json.loads((tmp_path / "bench-sleep.json").read_text())
    assert out["case_order"] == "alternated" and out["rounds"] == 3
    tms = next(r for r in out["rows"] if r["impl"] == "torch_memory_saver" and not r["backup"])
    assert tms["first_pause"] == {"median": 13, "min": 10, "max": 20, "n": 3}  # calls 10, 13 and 20 (8 warm-ups)
    assert tms["pause"]["n"] == 6 and tms["pause_s"] == pytest.approx(5.25)  # of 10, 13, 20 and 0.5 three times
    ours = next(r for r in out["rows"] if r["impl"] == "graphkit" and r["backup"])
    assert ours["exact"] and ours["pause"]["n"] == 6 and ours["first_pause"]["n"] == 3
    # the rows of the elastic buffer and of hal's bare calls (no backup: the driver's share), and the first-pause
    # target of each graphkit row
    assert {(r["impl"], r["backup"]) for r in out["rows"]} >= {("graphkit-elastic", True), ("hal calls", False)}
    assert sum("first pause <= 1.2 x" in t["target"] for t in out["targets"]) == 4


def test_the_elastic_bench_alternates_regrowth_and_elastic_growth(monkeypatch: pytest.MonkeyPatch) -> None:
    import hal
    from graphkit_bench import elastic

    order: list[str] = []
    device_timed, host_timed = elastic._device_timed, elastic._host_timed
    monkeypatch.setattr(elastic, "_device_timed", lambda be, fn: order.append("regrow") or device_timed(be, fn))
    monkeypatch.setattr(elastic, "_host_timed", lambda fn: order.append("elastic") or host_timed(fn))
    with hal.get_backend("fake", granularity=1 << 16) as be:
        row = elastic.regrow_case(be, 1 << 20, 3)
        assert be.live.zero, be.live
    assert order == ["regrow", "elastic", "elastic", "regrow", "regrow", "elastic"]
    assert row["exact"] and row["alternations"] == 3 and row["regrow_copied_bytes"] == 1 << 20
    assert row["regrow"]["n"] == row["elastic_grow"]["n"] == 3 and row["elastic_copied_bytes"] == 0
    assert row["regrow"]["min"] <= row["regrow_s"] == row["regrow"]["median"] <= row["regrow"]["max"]


def test_the_interval_of_a_median_is_two_order_statistics_and_needs_six_values() -> None:
    from graphkit_bench.fair import median_interval

    assert median_interval([1.0, 2.0, 3.0, 4.0, 5.0]) is None
    assert median_interval([6.0, 1.0, 5.0, 2.0, 4.0, 3.0]) == (1.0, 6.0)  # 96.9% for the extremes of six
    assert median_interval([float(i) for i in range(1, 21)]) == (6.0, 15.0)  # the 6th from each end of 20


def _target_4(ratios: list[float]) -> dict:
    from graphkit_bench.targets import check_targets

    vmm = {"strategy": "vmm", "order": "descending", "graph_memory_bytes": 1, "capture_seconds": 1.0,
           "replay_ms": {"1": 1.0}, "runner_ms_batch1": 1.0, "hand_loop_ms_batch1": 1.0, "hand_loop_ratios": ratios}
    out = {"results": [vmm], "largest_alone_bytes": 1, "eager_ms": {"1": 2.0}}
    return next(t for t in check_targets(out, 1, reference_gpu=False) if t["id"] == 4)


def test_a_ratio_target_is_judged_on_the_rounds_and_a_noisy_machine_gets_not_judged_never_missed() -> None:
    from graphkit_bench.output import summary_table

    assert _target_4([1.01, 1.02, 1.0, 1.03, 1.02, 1.01, 1.0, 1.02])["met"] is True
    assert _target_4([1.2, 1.3, 1.25, 1.22, 1.28, 1.21, 1.24, 1.27])["met"] is False
    noisy = _target_4([0.7, 1.6, 0.9, 1.3, 1.0, 1.2, 0.8, 1.4])
    assert noisy["met"] is None and "straddles 1.05" in noisy["detail"]
    table = summary_table({"machine": {"backend": "fake", "processor": "x", "torch": "2"}, "sizes": [1],
                           "largest_alone_bytes": 1, "eager_ms": {}, "results": [], "targets": [noisy]})
    assert "[not judged]" in table and "MISSED" not in table


def test_the_engine_capture_target_pairs_the_runs_and_says_when_noise_cannot_tell() -> None:
    rows = [{"strategy": s, "order": "descending", "capture_seconds": 1.0, "graph_memory_bytes": 1}
            for s in ("own-kept", "own-weakref", "graph_memory")]

    def results(ratios: list[float]) -> list[dict]:
        out = []
        for i, r in enumerate(ratios):
            out += [{"strategy": "own-kept", "order": "descending", "capture_seconds": 1.0 + i, "run": i},
                    {"strategy": "graph_memory", "order": "descending", "capture_seconds": (1.0 + i) * r, "run": i}]
        return out

    def target(ratios: list[float]) -> dict:
        return next(t for t in engines.check_targets(rows, results(ratios)) if "capture time" in t["target"])

    assert target([1.02, 1.05, 1.0, 1.04, 1.03, 1.01])["met"] is True
    assert target([1.3, 1.4, 1.35, 1.32, 1.31, 1.45])["met"] is False
    noisy = target([0.9, 1.3, 1.0, 1.25, 1.05, 1.2])
    assert noisy["met"] is None and "straddles 1.1" in noisy["detail"] and noisy["measured"] == pytest.approx(1.125)
    assert target([1.0, 1.0, 1.0])["met"] is None  # three runs cannot tell 10% from noise


def _targets(vmm_per_size: dict[str, float], weak_per_size: dict[str, float], reference_gpu: bool = False) -> dict:
    from graphkit_bench.targets import check_targets

    def row(strategy: str, per_size: dict[str, float]) -> dict:
        return {"strategy": strategy, "order": "descending", "graph_memory_bytes": 1,
                "capture_seconds": sum(per_size.values()), "capture_seconds_per_size": per_size,
                "replay_ms": {"1": 1.0}, "runner_ms_batch1": 1.0, "hand_loop_ms_batch1": 1.0}

    out = {"results": [row("vmm", vmm_per_size), row("shared-weakref", weak_per_size)], "largest_alone_bytes": 1,
           "sizes": list(vmm_per_size), "eager_ms": {"1": 0.9}}
    return {t["id"]: t for t in check_targets(out, 1, reference_gpu=reference_gpu)}


def test_the_capture_time_target_is_judged_size_by_size_through_an_interval() -> None:
    sizes = [str(s) for s in range(1, 10)]
    weak = {s: 1.0 for s in sizes}
    assert _targets({s: 1.1 for s in sizes}, weak)[3]["met"] is True
    assert _targets({s: 2.0 for s in sizes}, weak)[3]["met"] is False
    noisy = _targets(dict(zip(sizes, [0.5, 2.5, 1.0, 2.0, 1.4, 1.6, 0.8, 2.2, 1.5], strict=True)), weak)[3]
    assert noisy["met"] is None and "straddles 1.5" in noisy["detail"]


def test_a_gpu_only_target_is_not_judged_and_shows_no_ratio_on_a_cpu() -> None:
    from graphkit_bench.output import summary_table

    cpu = _targets({"1": 1.0}, {"1": 1.0})[5]
    assert cpu["met"] is None and cpu["ratio"] is None and "GPU-only" in cpu["detail"]
    assert _targets({"1": 1.0}, {"1": 1.0}, reference_gpu=True)[5]["met"] is False  # 0.9 ms eager: no speed-up
    table = summary_table({"machine": {"backend": "fake", "processor": "x", "torch": "2"}, "sizes": [1],
                           "largest_alone_bytes": 1, "eager_ms": {}, "results": [], "targets": [cpu]})
    assert "5. [not judged]" in table and "ratio -" in table
