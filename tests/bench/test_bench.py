"""The bench and the demo end to end on a tiny workload (CPU, fake backend)."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from graphkit_bench.cli import TINY_FAKE_GRANULARITY, main, parse_sizes
from graphkit_bench.strategies import COMPILE, ORDERS, STRATEGIES
from tests.conftest import DRIVER_STEP


@pytest.mark.slow
def test_bench_json_has_every_strategy_order_and_correctness(tmp_path: Path) -> None:
    code = main(["bench", "--workload", "tiny", "--sizes", "1,2,4,8,16", "--iters", "2", "--no-progress",
                 "--backend", "fake", "--out-dir", str(tmp_path)])
    assert code == 0
    out = json.loads((tmp_path / "bench.json").read_text())
    assert (tmp_path / "bench.png").stat().st_size > 10_000
    got = {(r["strategy"], r["order"]) for r in out["results"]}
    assert got == {(s, o) for s in STRATEGIES for o in ORDERS}
    assert COMPILE in out["left_out"] and "CUDA graphs" in out["left_out"][COMPILE]
    for r in out["results"]:
        assert r["max_rel_error"] < 1e-4, r
        assert r["graph_memory_bytes"] >= 0 and len(r["capture_seconds_per_size"]) == len(out["sizes"])
    vmm = {r["order"]: r for r in out["results"] if r["strategy"] == "vmm"}
    assert {"chunk_bytes", "reserved_bytes", "replay_ms", "hand_loop_ms_batch1"} <= vmm["descending"].keys()
    assert [t["id"] for t in out["targets"]] == [1, 2, 3, 4, 5, 6]
    assert out["targets"][4]["met"] is None  # the speed-up target is judged on a GPU only
    assert out["targets"][5]["met"] is None and "host device" in out["targets"][5]["detail"]  # no driver memory
    for r in out["results"]:  # every size replayed once at its own batch, exactly; memory measured after that
        assert r["replayed_sizes"] == len(out["sizes"]) and r["unreplayable_sizes"] == {}, r
        assert r["every_size_exact"] and r["max_rel_error_every_size"] < 1e-4
        a = r["accounting"]
        assert a["device"] == r["graph_memory_bytes"] and r["capture_only_bytes"] >= 0
        assert a["rest"] == a["device"] - a["chunks"] - (a["executables_bytes"] or 0) - a["workspaces"]
        budget = r["executables"]["budget"]
        if r["strategy"] == "vmm":  # graphkit's default budget: one executable per graph, at its first replay
            assert budget == "lazy" and r["executables"]["count"] == len(out["sizes"]), r["executables"]
            assert r["executables"]["updates"] == 0 and r["executables"]["instantiations"] == len(out["sizes"])
            assert r["executables"]["graphs"] == len(out["sizes"]) and a["chunks"] == r["chunk_bytes"]
        else:  # the engines' way: every graph instantiated at its capture's end
            assert budget is None and r["executables"]["count"] == len(out["sizes"]), r["executables"]
    private = next(r for r in out["results"] if r["strategy"] == "private" and r["order"] == "descending")
    assert private["graph_memory_bytes"] > vmm["descending"]["graph_memory_bytes"]
    # the tiny decoder in fake's granules of its size: vmm the same in every order, one shared pool more smallest
    # first (in fake's own 2 MiB granules every strategy but a pool per graph showed one granule)
    assert out["machine"]["granularity"] == TINY_FAKE_GRANULARITY
    assert len({r["graph_memory_bytes"] for r in vmm.values()}) == 1
    memory = {(r["strategy"], r["order"]): r["graph_memory_bytes"] for r in out["results"]}
    assert memory["shared-weakref", "ascending"] > memory["vmm", "ascending"], memory
    assert out["machine"]["backend"] == "fake" and out["command"].startswith("python -m graphkit bench")
    assert out["graph_floor"]["per_graph_bytes"] == 0  # fake graphs keep no device memory of their own
    assert all(r["driver_bytes"] is None and "the host" in r["driver_why"] for r in out["results"])  # not measured
    assert "the driver's memory per graph" in out["targets"][0]["target"]


def _help(command: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exit_:
        main([*command, "--help"])
    assert exit_.value.code == 0
    return capsys.readouterr().out


def test_bench_help_documents_every_option(capsys: pytest.CaptureFixture[str]) -> None:
    text = _help(["bench"], capsys)
    for option in ("--workload", "--hidden", "--layers", "--heads", "--kv-heads", "--head-dim", "--mlp", "--vocab",
                   "--context", "--dtype", "--sizes", "--strategies", "--orders", "--backend", "--device",
                   "--iters", "--compile-budget", "--seed", "--out-dir", "--no-progress"):
        assert option in text


def _flag_helps(text: str) -> dict[str, str]:
    """Each flag of a --help text with its help, the wrapped lines joined."""
    helps: dict[str, str] = {}
    flag = None
    for line in text.splitlines():
        if re.match(r"^  -", line):
            flag = line.split()[0].rstrip(",")
            helps[flag] = line
        elif flag is not None and line.startswith("   "):
            helps[flag] += " " + line.strip()
        else:
            flag = None  # a group's title, the usage, a blank line
    return {k: " ".join(v.split()) for k, v in helps.items()}


@pytest.mark.parametrize("command", [[], ["demo"], ["bench"]])
def test_every_flag_states_its_default_once(command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """argparse's ArgumentDefaultsHelpFormatter added "(default: X)" where the help already said it, and
    "(default: None)" where the default is the workload's: each flag now says it once, in words."""
    helps = _flag_helps(_help(command, capsys))
    assert len(helps) > (20 if command == ["bench"] else 1), helps
    for flag, text in helps.items():
        if flag == "-h":
            continue
        assert text.count("default:") == 1, text
        assert "(default: None)" not in text and "(default: False)" not in text, text
    if command == ["bench"]:
        assert "(default: descending,ascending,random,on-demand)" in helps["--orders"]
        assert "(default: off)" in helps["--every-size"] and "reference 1024, tiny 64" in helps["--hidden"]
        assert "16.0 KiB granules for the tiny decoder" in helps["--backend"]


@pytest.mark.parametrize("module", ["graphkit_bench.trace", "graphkit_bench.capture_pairs"])
def test_the_other_commands_state_each_default_once(module: str, capsys: pytest.CaptureFixture[str]) -> None:
    import importlib

    with pytest.raises(SystemExit):
        importlib.import_module(module).main(["--help"])
    helps = _flag_helps(capsys.readouterr().out)
    assert helps and all(text.count("default:") == 1 for flag, text in helps.items() if flag != "-h"), helps


def test_sizes_syntax() -> None:
    assert parse_sizes("1,2,4,8:257:8") == [1, 2, 4, *range(8, 257, 8)]
    with pytest.raises(argparse.ArgumentTypeError):
        parse_sizes("0")


def test_without_matplotlib_the_plot_is_skipped_with_the_extra_to_install(tmp_path: Path, monkeypatch,
                                                                          caplog) -> None:
    from graphkit_bench import output

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    assert output.plot({"results": [], "largest_alone_bytes": 0}, tmp_path / "demo.png") is False
    assert "hal-graphkit[bench]" in caplog.text and not (tmp_path / "demo.png").exists()


def test_the_overhead_bench_times_the_runner_the_hand_loop_and_hal_in_turns(tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    from graphkit_bench import overhead

    assert overhead.main(["--backend", "fake", "--workload", "trivial", "--processes", "0", "--rounds", "6",
                          "--out-dir", str(tmp_path)]) == 0
    out = json.loads((tmp_path / "bench-overhead.json").read_text())
    run = out["runs"][0]
    assert all(len(run[k]) == 6 for k in ("runner_ms", "hand_ms", "hal_ms", "ratios", "hal_ratios"))
    assert out["met"] in (True, False, None) and out["ratio"]["n"] == 6
    text = capsys.readouterr().out
    assert "target 4" in text and "graphkit's own share" in text


def _target_1(vmm: int, alone: int, floor: float | None, sizes: int = 5) -> dict:
    from graphkit_bench.targets import check_targets

    rows = [{"strategy": s, "order": "descending", "graph_memory_bytes": vmm, "capture_seconds": 1.0}
            for s in ("vmm", "shared-weakref")]
    out = {"results": rows, "largest_alone_bytes": alone, "sizes": list(range(1, sizes + 1)), "eager_ms": {},
           "graph_floor": None if floor is None else {"per_graph_bytes": floor}}
    return next(t for t in check_targets(out, 2, reference_gpu=True) if t["id"] == 1)


def test_vmm_memory_is_judged_against_the_largest_alone_plus_the_measured_floor_per_graph() -> None:
    """The driver's memory per instantiated graph is a floor no pool shares: N sizes may cost the largest alone
    plus N - 1 times it (and a granule), not 1.1 x the largest alone."""
    assert _target_1(vmm=130, alone=100, floor=7.5)["met"]  # 100 + 4 x 7.5 + 2 = 132
    assert not _target_1(vmm=133, alone=100, floor=7.5)["met"]
    assert "4 x 8 B per graph" in _target_1(vmm=130, alone=100, floor=7.5)["detail"]
    assert not _target_1(vmm=130, alone=100, floor=None)["met"]  # figures without the floor: the old 1.1 x


def test_an_isolated_bench_measures_the_floor_in_a_process_of_its_own(tmp_path: Path) -> None:
    path = tmp_path / "part.json"
    assert main(["bench", "--workload", "tiny", "--sizes", "1,2", "--iters", "1", "--no-progress", "--backend", "fake",
                 "--part", "graph-floor", "--part-out", str(path)]) == 0
    part = json.loads(path.read_text())
    assert part["graph_floor"]["graphs"] == 2 and part["results"] == [] and part["largest_alone_bytes"] is None


@pytest.mark.cuda
def test_the_drivers_memory_per_graph_is_measured_on_cuda() -> None:
    """Graphs instantiated by the driver keep memory no pool shares: measured on a GPU, in the driver's 2 MiB
    steps (how many steps four small graphs take differs by generation: none is a measurement too)."""
    from graphkit_bench.model import DecoderConfig
    from graphkit_bench.run import Bench, BenchConfig

    bench = Bench(BenchConfig(workload=DecoderConfig.tiny(), sizes=[1, 2, 4, 8], backend="cuda", progress=False))
    try:
        floor = bench.run_graph_floor()
    finally:
        bench.close()
    assert floor["graphs"] == 4 and floor["pool_bytes"] >= 0 and floor["driver_bytes"] >= 0, floor
    assert floor["driver_bytes"] % DRIVER_STEP == 0 and floor["per_graph_bytes"] == floor["driver_bytes"] / 4, floor


@pytest.mark.parametrize("flag", [[], ["--verify"]])
def test_the_verifier_is_off_unless_the_bench_asks_for_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          flag: list[str]) -> None:
    from graphkit_bench import verifier

    monkeypatch.setenv(verifier.ENV, "0")  # undone after the test, whatever --verify sets
    assert main(["bench", "--workload", "tiny", "--strategies", "vmm", "--orders", "descending", "--iters", "1",
                 "--backend", "fake", "--no-progress", "--out-dir", str(tmp_path), *flag]) == 0
    (result,) = json.loads((tmp_path / "bench.json").read_text())["results"]
    assert (result["verified_graphs"] > 0) == bool(flag), result


def test_the_hand_loop_launches_the_executable_the_runner_uses(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a budget the size's own graph may hold no executable: the loop launches the one the budget runs its
    work with (after one call of the runner), and its output equals the runner's."""
    from graphkit_bench.model import DecoderConfig
    from graphkit_bench.run import Bench, BenchConfig
    from graphkit_bench.strategies import STRATEGIES

    monkeypatch.setitem(STRATEGIES, "vmm", {"kind": "vmm", "executables": 1})  # one executable for every size
    bench = Bench(BenchConfig(workload=DecoderConfig.tiny(), sizes=[1, 2, 4], backend="fake", progress=False,
                              strategies=["vmm"], orders=["descending"]))
    try:
        runner = bench.make_runner("vmm", on_demand=False)
        runner.capture(bench.inputs[4])
        executables = runner.pools.executables
        assert executables is not None and executables.per_topology == 1
        for n in (4, 2):
            runner(**bench.inputs[n])
        graph = runner.bucket(1).graphs[0]
        assert executables.executable_of(graph) is None  # size 1 was never replayed: no executable runs it
        launched: list[object] = []
        real = bench.be.launch
        monkeypatch.setattr(bench.be, "launch", lambda g: (launched.append(g), real(g)))
        step = bench.hand_loop(runner, 1)
        host = executables.executable_of(graph)
        assert host is not None and host is runner.bucket(4).graphs[0]  # the one executable, updated to size 1
        launched.clear()
        got = step().clone()
        assert launched == [host]
        bench.model.reset_cache()
        got = step().clone()
        bench.model.reset_cache()
        assert torch.equal(got, runner(**bench.inputs[1]).clone())
        runner.close()
    finally:
        bench.close()


def _rows(vmm: dict[str, int], weak: int, *, exact: bool = True, measured: bool = True,
          every: int | None = None) -> dict:
    """Crafted bench figures: vmm rows by order (graph memory), shared-weakref descending, an every-size row."""
    def row(strategy: str, order: str, memory: int, sizes: int = 35, **more: object) -> dict:
        return {"strategy": strategy, "order": order, "graph_memory_bytes": memory, "capture_seconds": 1.0,
                "sizes_captured": sizes, "max_rel_error": 0.0, "replayed_sizes": sizes,
                "unreplayable_sizes": {} if exact else {"8": "InvalidStateError: gone"},
                "max_rel_error_every_size": 0.0, "executables": {"count": 8, "graphs": sizes, "topologies": 2,
                                                                 "instantiations": 8, "driver_bytes":
                                                                 (8 << 20) if measured else None}, **more}
    rows = [row("vmm", o, m) for o, m in vmm.items()] + [row("shared-weakref", "descending", weak)]
    if every is not None:
        rows.append(row("vmm", "descending", every, sizes=256, variant="every-size"))
    return {"results": rows, "largest_alone_bytes": 100, "sizes": list(range(1, 36)), "eager_ms": {},
            "graph_floor": None}


def _target(out: dict, tid: int) -> dict:
    from graphkit_bench.targets import check_targets

    return next(t for t in check_targets(out, 2, reference_gpu=True) if t["id"] == tid)


def test_vmm_is_judged_against_08_x_shared_weakref_in_both_orders_with_every_size_exact() -> None:
    assert _target(_rows({"descending": 340, "ascending": 345}, 432), 6)["met"] is True
    missed = _target(_rows({"descending": 340, "ascending": 350}, 432), 6)
    assert missed["met"] is False and missed["ratio"] == pytest.approx(350 / 432)
    wrong = _target(_rows({"descending": 100, "ascending": 100}, 432, exact=False), 6)
    assert wrong["met"] is False and "do not replay (8)" in wrong["detail"]  # small but not every size replays
    one_order = _target(_rows({"descending": 100}, 432), 6)
    assert one_order["met"] is None and "ascending not run" in one_order["detail"]
    host = _target(_rows({"descending": 100, "ascending": 100}, 432, measured=False), 6)
    assert host["met"] is None and "not judged" in host["detail"]


def test_every_size_is_judged_against_11_x_the_bench_sizes() -> None:
    assert _target(_rows({"descending": 400}, 432, every=440), 7)["met"] is True
    missed = _target(_rows({"descending": 400}, 432, every=441), 7)
    assert missed["met"] is False and "256 sizes 441 B, 35 sizes 400 B" in missed["detail"]
    wrong = _target(_rows({"descending": 400}, 432, every=400, exact=False), 7)
    assert wrong["met"] is False
    assert not [t for t in _check(_rows({"descending": 400}, 432)) if t["id"] == 7]  # no every-size row: no target
    alone = _rows({"ascending": 400}, 432, every=400)
    assert _target(alone, 7)["met"] is None  # no vmm row over the bench's sizes to compare with


def _check(out: dict) -> list[dict]:
    from graphkit_bench.targets import check_targets

    return check_targets(out, 2, reference_gpu=True)


def test_the_floor_line_is_the_largest_alone_plus_one_executable_per_further_topology() -> None:
    from graphkit_bench.targets import executable_floor

    floor = executable_floor(_rows({"descending": 400}, 432))
    assert floor == {"topologies": 2, "per_executable_bytes": 1 << 20, "measured": True, "bytes": 100 + (1 << 20),
                     "executables": 2, "each": "topology"}
    lazy = _rows({"descending": 400}, 432)
    lazy["results"][0]["executables"]["budget"] = "lazy"  # an executable per graph replayed: 35 graphs
    assert executable_floor(lazy) == {"topologies": 2, "per_executable_bytes": 1 << 20, "measured": True,
                                      "bytes": 100 + 34 * (1 << 20), "executables": 35, "each": "graph"}
    host = executable_floor(_rows({"descending": 400}, 432, measured=False))
    assert host is not None and host["bytes"] == 100 and not host["measured"]


def test_the_every_size_row_captures_every_batch_size(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["bench", "--workload", "tiny", "--sizes", "1,4,8", "--strategies", "vmm", "--orders", "descending",
                 "--iters", "1", "--no-progress", "--backend", "fake", "--every-size", "--out-dir", str(tmp_path)])
    assert code == 0
    out = json.loads((tmp_path / "bench.json").read_text())
    base, every = out["results"]
    assert base["sizes_captured"] == 3 and "variant" not in base
    assert every["variant"] == "every-size" and every["sizes_captured"] == 8 and every["replayed_sizes"] == 8
    assert len(every["capture_seconds_per_size"]) == 8 and every["executables"]["graphs"] == 8
    target = next(t for t in out["targets"] if t["id"] == 7)
    assert target["met"] is True and "8 sizes" in target["detail"] and "3 sizes" in target["detail"]
    assert "vmm 1..8" in capsys.readouterr().out  # the table names the row


@pytest.mark.slow
def test_python_m_graphkit_bench_workload_tiny_still_runs(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "graphkit", "bench", "--workload", "tiny", "--sizes", "1,2,4",
                           "--strategies", "shared-weakref,vmm", "--orders", "descending", "--iters", "1",
                           "--backend", "fake", "--isolate", "no", "--no-progress", "--out-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads((tmp_path / "bench.json").read_text())
    assert {r["strategy"] for r in out["results"]} == {"shared-weakref", "vmm"}
    assert "accounting:" in proc.stdout and "targets:" in proc.stdout


def test_the_heap_settled_for_the_runs_goes_back_to_the_collector() -> None:
    """What lived before a run is out of the collector's sight during the runs (each runner's close collects),
    and back in it once the bench is done."""
    import gc

    from graphkit_bench.timing import settled_heap

    with settled_heap() as settle:
        settle()
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0
