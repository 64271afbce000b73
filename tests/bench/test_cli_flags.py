"""D12: every flag of ``python -m graphkit`` and ``python -m hal`` is checked before any work.

A bad value ends the process with exit code 2 and one line on stderr that names the flag and
the value, never a traceback.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

import hal
from graphkit_bench.cli import main
from graphkit_bench.run import Bench, BenchConfig
from tests.paths import ROOT

#: the smallest decoder the CLI takes, so a run that should not happen ends fast if it does
TINY = ["--workload", "tiny", "--hidden", "16", "--layers", "1", "--heads", "2", "--kv-heads", "1",
        "--head-dim", "8", "--mlp", "16", "--vocab", "32", "--context", "4", "--iters", "1", "--no-progress",
        "--strategies", "vmm", "--orders", "descending"]


@pytest.fixture(autouse=True)
def fake_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HAL_BACKEND", "fake")


def rejected(argv: list[str], capsys: pytest.CaptureFixture[str], *needles: str) -> str:
    """Run ``main(argv)`` in this process; assert exit code 2 and one stderr line holding ``needles``."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def cli(module: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m module args`` with the fake backend (or ``env``)."""
    full = {**os.environ, "PYTHONPATH": str(ROOT), "HAL_BACKEND": "fake", **(env or {})}
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, env=full,
                          cwd=ROOT, timeout=120, check=False)


def assert_one_line(proc: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


# -- through a fresh process ---------------------------------------------------------------------------


def test_iters_zero_exits_2_before_running(tmp_path: Path) -> None:
    proc = cli("graphkit", "bench", *TINY, "--iters", "0", "--out-dir", str(tmp_path / "out"))
    assert_one_line(proc, "--iters", "0")
    assert not (tmp_path / "out" / "bench.json").exists()


def test_unknown_backend_lists_the_known_ones(tmp_path: Path) -> None:
    proc = cli("graphkit", "bench", *TINY, "--backend", "nope", "--out-dir", str(tmp_path))
    assert_one_line(proc, "--backend", "nope", *(i.name for i in hal.list_backends()))


@pytest.mark.parametrize("args", [["--bogus"], ["--iters=-5", "nonsense"]])
def test_mapcalls_refuses_arguments_it_does_not_take_before_running(args: list[str]) -> None:
    proc = cli("graphkit_bench.mapcalls", *args)
    assert_one_line(proc, "python -m graphkit_bench.mapcalls: error: unrecognized arguments:", *args)
    assert "map calls" not in proc.stdout  # the bench did not run


def test_python_m_graphkit_without_the_bench_names_the_extra() -> None:
    """The library alone (no graphkit_bench): ``python -m graphkit demo`` says which extra to install."""
    full = {**os.environ, "PYTHONPATH": str(ROOT), "HAL_BACKEND": "fake"}
    launch = textwrap.dedent("""
        import runpy, sys

        class NoBench:  # the import system as it answers where graphkit_bench is not installed
            def find_spec(self, name, path=None, target=None):
                if name.partition(".")[0] == "graphkit_bench":
                    raise ModuleNotFoundError(f"No module named {name!r}", name=name)

        sys.meta_path.insert(0, NoBench())
        sys.argv = ["graphkit", "demo"]
        runpy.run_module("graphkit", run_name="__main__")
    """)
    proc = subprocess.run([sys.executable, "-c", launch], capture_output=True, text=True, env=full, cwd=ROOT,
                          timeout=120, check=False)
    assert_one_line(proc, "python -m graphkit", "graphkit_bench", "hal-graphkit[bench]")
    assert proc.stdout == ""


def test_python_m_graphkit_bench_is_the_same_command_line(tmp_path: Path) -> None:
    proc = cli("graphkit_bench", "bench", *TINY, "--iters", "0", "--out-dir", str(tmp_path / "out"))
    assert_one_line(proc, "python -m graphkit bench", "--iters", "0")


def test_python_m_hal_with_an_unknown_hal_backend_exits_2() -> None:
    proc = cli("hal", env={"HAL_BACKEND": "nope"})
    assert_one_line(proc, "HAL_BACKEND", "nope", "fake")
    assert proc.stdout == ""


# -- through main(argv) --------------------------------------------------------------------------------


def test_a_single_size_runs_to_completion(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", *TINY, "--sizes", "2", "--backend", "fake", "--out-dir", str(tmp_path)]) == 0
    out = json.loads((tmp_path / "bench.json").read_text())
    assert out["sizes"] == [2]
    assert [r["strategy"] for r in out["results"]] == ["vmm"]


@pytest.mark.parametrize("sizes", [[1], [2], [3], [5], [1, 2], [40]])
def test_error_check_batches_fit_the_sizes(sizes: list[int]) -> None:
    batches = Bench.check_batches(SimpleNamespace(cfg=BenchConfig(sizes=sizes)))  # type: ignore[arg-type]
    assert batches[0] == 1 and max(batches) == max(sizes)


@pytest.mark.parametrize("iters", ["0", "-5"])
def test_iters_below_one_is_refused(iters: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rejected(["bench", *TINY, "--iters", iters, "--out-dir", str(tmp_path)], capsys, "--iters", iters)


@pytest.mark.parametrize("iters", [0, -5])
def test_bench_config_refuses_iters_below_one(iters: int) -> None:
    with pytest.raises(hal.InvalidArgumentError, match="iters"):
        BenchConfig(iters=iters)


@pytest.mark.parametrize("flag", ["--hidden", "--layers", "--heads", "--kv-heads", "--head-dim", "--mlp", "--vocab",
                                  "--context", "--runs", "--cycles"])
def test_sizes_of_things_must_be_positive(flag: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rejected(["bench", *TINY, flag, "-8", "--out-dir", str(tmp_path)], capsys, flag, "-8")


@pytest.mark.parametrize("flag", ["--sizes", "--sleep-sizes", "--elastic-sizes"])
@pytest.mark.parametrize("value,bad", [("1,0,4", "'0'"), ("1,x", "'x'"), ("8:1", "'8:1'"), ("1:9:0", "'1:9:0'"),
                                       ("0:4", "'0:4'")])
def test_size_lists_name_the_bad_element(flag: str, value: str, bad: str, tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    rejected(["bench", *TINY, flag, value, "--out-dir", str(tmp_path)], capsys, flag, bad)


@pytest.mark.parametrize("argv,needles", [
    (["--sizes", "1:100000000000"], ["--sizes", "'1:100000000000'", "2147483648"]),  # counted, never built
    (["--sizes", "1:2000000:3"], ["--sizes", "'1:2000000:3'", "4096"]),
    (["--sizes", "99999999999999999999999"], ["--sizes", "99999999999999999999999"]),
    (["--sleep", "--sleep-sizes", "99999999999"], ["--sleep-sizes", "99999999999"]),
    (["--elastic", "--elastic-sizes", "99999999999"], ["--elastic-sizes", "99999999999"]),
    (["--sleep", "--sleep-sizes", "999999"], ["--sleep-sizes", "999999 MiB", "device"]),
    (["--elastic", "--elastic-sizes", "999999"], ["--elastic-sizes", "999999 MiB", "device"]),
    (["--sleep", "--sizes", "4"], ["--sizes", "--sleep", "--sleep-sizes"]),
    (["--sleep", "--elastic-sizes", "4"], ["--elastic-sizes", "--sleep"]),
    (["--elastic", "--sleep-sizes", "4"], ["--sleep-sizes", "--elastic"]),
    (["--sleep-sizes", "4"], ["--sleep-sizes", "graph bench", "--sizes"]),
    (["--compile-budget", "0"], ["--compile-budget", "0"]),
    (["--compile-budget", "nan"], ["--compile-budget", "nan"]),
    (["--seed", "-1"], ["--seed", "-1"]),
    (["--orders", ","], ["--orders"]),
    (["--strategies", "own-kept"], ["--strategies", "own-kept"]),
    (["--kv-heads", "3"], ["--heads", "--kv-heads", "3"]),
    (["--head-dim", "7"], ["--head-dim", "7"]),
    (["--sleep", "--elastic"], ["--sleep", "--elastic"]),
])
def test_other_bad_values(argv: list[str], needles: list[str], tmp_path: Path,
                          capsys: pytest.CaptureFixture[str]) -> None:
    rejected(["bench", *TINY, *argv, "--out-dir", str(tmp_path)], capsys, *needles)


def test_unavailable_backend_gives_the_probe_reason(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    down = next((i for i in hal.list_backends() if not i.available), None)
    if down is None:
        pytest.skip("every backend is available here")
    line = rejected(["bench", *TINY, "--backend", down.name, "--out-dir", str(tmp_path)], capsys, "--backend",
                    down.name)
    assert " ".join(down.reason.split()) in line


def test_unknown_backend_in_the_demo(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "demo-out"
    rejected(["demo", "--backend", "nope", "--out-dir", str(out)], capsys, "--backend", "nope")
    assert not out.exists()  # the backend is checked first, and nothing is made


@pytest.mark.parametrize("extra", [[], ["--sleep"], ["--elastic"],
                                   ["--workload", "engine", "--strategies", "own-kept"]])
def test_device_beyond_the_device_count(extra: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with hal.get_backend("fake") as be:
        count = be.device_count()
    line = rejected(["bench", *TINY, *extra, "--backend", "fake", "--device", str(count + 4), "--out-dir",
                     str(tmp_path)], capsys, "--device", str(count + 4))
    assert str(count) in line


def test_negative_device(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rejected(["bench", *TINY, "--device", "-1", "--out-dir", str(tmp_path)], capsys, "--device", "-1")


@pytest.mark.parametrize("command", ["bench", "demo"])
def test_unwritable_out_dir_fails_up_front(command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    out = blocker / "out"
    argv = [command, *(TINY if command == "bench" else []), "--out-dir", str(out)]
    rejected(argv, capsys, "--out-dir", str(out))


def test_out_dir_is_created_with_its_parents(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "a" / "b" / "c"
    rejected(["bench", *TINY, "--iters", "0", "--out-dir", str(out)], capsys, "--iters")  # the flags come first
    rejected(["bench", *TINY, "--backend", "nope", "--out-dir", str(out)], capsys, "--backend")
    assert not out.exists()  # a bad flag leaves nothing behind
    from graphkit_bench.cli import out_dir_error

    assert out_dir_error(out) is None and out.is_dir() and not list(out.iterdir())


def test_hal_listing_refuses_an_unavailable_hal_backend(monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    from hal.__main__ import main as hal_main

    down = next((i for i in hal.list_backends() if not i.available), None)
    if down is None:
        pytest.skip("every backend is available here")
    monkeypatch.setenv("HAL_BACKEND", down.name)
    assert hal_main([]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.strip().splitlines()) == 1
    assert "HAL_BACKEND" in captured.err and down.name in captured.err


def test_a_backend_without_graphs_is_named_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """A VMM-only plugin chosen by name ends in one line naming the missing capability."""
    from graphkit_bench.cli import backend_error

    def refuse(name, *, requires=(), device=0):  # what hal says of a backend that lacks 'graphs'
        raise hal.UnsupportedError("lacks capability 'graphs'", backend=name, call="get_backend")

    monkeypatch.setattr(hal.registry, "select_backend_name",
                        lambda name=None, *, requires=(), device=0: refuse(name) if requires else (name or "fake"))
    why = backend_error("fake")
    assert why is not None and "graphs" in why and "--backend" in why and "\n" not in why
