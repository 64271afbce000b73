"""The switch, GRAPHKIT_GRAPH_MEMORY (``graphkit.switch``): what it refuses to start, the engines' plugin entry
points, and the switch in processes that never call graphkit (spawned and forked ranks, a fresh environment).
Its value is checked in ``graphs/test_switch_value.py``, the start-up hook in ``test_startup_hook.py``."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import site
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import hal
from graphkit import switch
from graphkit.switch import ENV, Options
from tests.paths import ROOT, TESTS

HOOK_FILE = ROOT / "graphkit-startup.pth"
ENGINE = TESTS / "graphkit" / "switch_engine.py"


def _env(value: str | None, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != ENV}
    if value is not None:
        env[ENV] = value
    return {**env, **extra}


# -- starting it ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("call", "arg", "named"), [
    ("parse", 5, "value=5 must be the variable's text"), ("parse", b"1", "value=b'1' must be the variable's text"),
    ("start", "kind=shared", (r"options='kind=shared' must be a graphkit.switch.Options or None; for the variable's "
                              r"text, pass graphkit.switch.parse\('kind=shared'\)")),
    ("start", {"kind": "shared"}, r"options=\{'kind': 'shared'\} must be a graphkit.switch.Options"),
    ("start", True, "options=True must be a graphkit.switch.Options"),
    ("ProcessGraphMemory", "x", "options='x' must be a graphkit.switch.Options"),
])
def test_what_is_no_value_or_options_is_refused_and_nothing_starts(call: str, arg: Any, named: str,
                                                                  switch_reset: None) -> None:
    with pytest.raises(hal.InvalidArgumentError, match=named):
        getattr(switch, call)(arg)
    assert switch.active() is None


def test_graphkit_switch_is_reachable_after_import_graphkit() -> None:
    code = "import graphkit; print(graphkit.switch.parse('kind=shared').kind)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env=_env(None))
    assert out.returncode == 0 and out.stdout.split()[0] == "shared", out.stderr[-2000:]


# -- the engines' plugin entry points -------------------------------------------------------------------------


@pytest.fixture
def switch_reset() -> Iterator[None]:
    """The process's switch is off before and after the test, and a bad value has not been reported yet."""
    assert switch.active() is None
    yield
    switch.stop()
    switch._reported = False


@pytest.mark.parametrize("group", ["vllm.general_plugins", "sglang.srt.plugins"])
def test_the_package_declares_the_engines_plugin_entry_points(group: str) -> None:
    found = [ep for ep in importlib.metadata.entry_points(group=group) if ep.name == "graphkit"]
    assert found, f"no 'graphkit' entry point in {group}: reinstall the package (pip install -e .)"
    assert found[0].load() is switch.plugin


def test_the_plugin_does_nothing_while_the_variable_is_unset(monkeypatch, switch_reset) -> None:
    monkeypatch.delenv(ENV, raising=False)
    switch.plugin()
    assert switch.active() is None


def test_the_plugin_starts_the_switch_once_however_often_it_is_called(monkeypatch, switch_reset) -> None:
    monkeypatch.setenv(ENV, "kind=shared,report=0")
    switch.plugin()
    scope = switch.active()
    assert scope is not None and scope.options == Options(kind="shared", report=0.0)
    switch.plugin()
    assert switch.active() is scope


def test_the_plugin_reports_a_bad_value_once_and_never_raises(monkeypatch, caplog, switch_reset) -> None:
    monkeypatch.setenv(ENV, "kind=bogus")
    with caplog.at_level(logging.WARNING, logger="graphkit.switch"):
        switch.plugin()
        switch.plugin()
    assert switch.active() is None
    warnings = [r.getMessage() for r in caplog.records if r.name == "graphkit.switch"]
    assert len(warnings) == 1, warnings
    assert "'kind=bogus' has a value the option does not take" in warnings[0] and "stays off" in warnings[0]
    assert warnings[0].count(ENV) == 1


# -- the switch in processes that never call graphkit ----------------------------------------------------------


def _installed_hook() -> Path:
    """The hook file of this environment's install, checked against the project's."""
    folders = [*site.getsitepackages(), site.getusersitepackages()]
    for folder in folders:
        path = Path(folder) / HOOK_FILE.name
        if path.exists():
            assert path.read_text() == HOOK_FILE.read_text(), f"{path} is stale: reinstall (pip install -e .)"
            return path
    raise AssertionError(f"{HOOK_FILE.name} is in none of {folders}: install the package (pip install -e .)")


def _report_lines(stderr: str, pid: int) -> list[str]:
    return [line for line in stderr.splitlines() if f"graphkit: process {pid}, " in line]


def test_spawned_and_forked_ranks_are_served_with_the_variable_alone() -> None:
    _installed_hook()
    out = subprocess.run([sys.executable, str(ENGINE), "spawn", "fork"], capture_output=True, text=True,
                         timeout=400, env=_env("report=0"), cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.splitlines()[-1])
    assert seen["launcher"]["graphkit_imported"] and seen["launcher"]["served"] == []
    assert not _report_lines(out.stderr, seen["launcher"]["pid"])  # it captured nothing: nothing to report
    for rank in seen["ranks"]:
        assert rank["served"] == ["fake:0"], rank
        assert rank["worst"] == 0.0 and rank["exitcode"] == 0, rank
        lines = _report_lines(out.stderr, rank["pid"])
        assert len(lines) == 1, (rank, out.stderr[-3000:])
        assert "fake:0: graph pools on fake (vmm): 3 key(s)" in lines[0] and lines[0].endswith("(at exit)")
        configured = rank["method"] == "fork"  # that rank set up logging of its own: the line went through it
        assert lines[0].startswith("INFO graphkit.switch: ") == configured, lines[0]


def test_ranks_an_engine_spawns_inside_graph_memory_are_served_with_the_blocks_options() -> None:
    """``with graph_memory(): llm = LLM(...)`` reaches the ranks the engine spawns in the block, which never run
    the block's code; the launcher's own switch stays off (the block serves it), and after the block a new
    rank is the framework's again."""
    _installed_hook()
    out = subprocess.run([sys.executable, str(ENGINE), "scope"], capture_output=True, text=True, timeout=400,
                         env=_env(None, GRAPHKIT_GRAPH_MEMORY_FROM=""), cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.splitlines()[-1])
    inside, after = seen["ranks"]
    assert inside["served"] == ["fake:0"] and inside["outputs"] == "replay", inside
    assert inside["worst"] == 0.0 and inside["exitcode"] == 0, inside
    assert inside["launcher_switch"] is None, inside  # the plugin called in the block's process started nothing
    assert after["served"] is None and after["worst"] == 0.0, after


FORKED_CHILD = """
import multiprocessing, os, sys
def child():
    import torch, hal
    import graphkit.switch
    graphkit.switch.plugin()  # the switch starts in the child, after the fork
    be = hal.get_backend("fake"); g = be.create_graph(); x = torch.ones(2)
    with be.capture(g):
        y = x * 3
    print("child", os.getpid(), flush=True)
if __name__ == "__main__":
    p = multiprocessing.get_context(sys.argv[1]).Process(target=child); p.start(); p.join(100)
"""


@pytest.mark.parametrize("method", ["fork", "forkserver"])
def test_a_switch_started_in_a_forked_child_logs_its_line_at_exit(tmp_path: Path, method: str) -> None:
    """A multiprocessing child leaves through os._exit, past atexit: its line comes through multiprocessing's exit."""
    script = tmp_path / "child.py"
    script.write_text(FORKED_CHILD)
    out = subprocess.run([sys.executable, str(script), method], capture_output=True, text=True, timeout=200,
                         env=_env("report=0", PYTHONPATH=str(ROOT)), cwd=ROOT)
    pid = int(next(line.split()[1] for line in out.stdout.splitlines() if line.startswith("child ")))
    lines = _report_lines(out.stderr, pid)
    assert len(lines) == 1 and lines[0].endswith("(at exit)"), out.stderr[-3000:]


@pytest.mark.slow
def test_the_wheel_installs_the_hook_and_a_fresh_environment_is_served(tmp_path: Path) -> None:
    pytest.importorskip("setuptools", minversion="68", reason="builds the wheel with this environment's setuptools")
    source = tmp_path / "source"
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "build", "dist")
    for name in ("hal", "graphkit"):
        shutil.copytree(ROOT / name, source / name, ignore=ignore)
    for name in ("pyproject.toml", "setup.py", "README.md", HOOK_FILE.name, "_graphkit_startup.py"):
        shutil.copy(ROOT / name, source / name)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    subprocess.run([*pip, "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"),
                    str(source)], check=True, capture_output=True, timeout=300)
    wheel = next((tmp_path / "dist").glob("hal_graphkit-*.whl"))
    env_dir = tmp_path / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True, timeout=120)
    python = env_dir / "bin" / "python"
    purelib = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                                  capture_output=True, text=True, check=True).stdout.strip())
    # torch and the other dependencies from this environment, as plain folders (their .pth files stay unread)
    (purelib / "dependencies.pth").write_text("\n".join(p for p in sys.path if p.endswith("-packages")) + "\n")
    subprocess.run([*pip, "--python", str(python), "install", "-q", "--no-deps", "--no-index", str(wheel)],
                   check=True, capture_output=True, timeout=300)
    assert (purelib / HOOK_FILE.name).read_text() == HOOK_FILE.read_text()
    assert (purelib / "_graphkit_startup.py").exists()
    out = subprocess.run([python, str(ENGINE), "none"], capture_output=True, text=True, timeout=400,
                         env=_env("1", PYTHONPATH=""), cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    rank = json.loads(out.stdout.splitlines()[-1])["ranks"][0]
    assert rank["served"] == ["fake:0"] and rank["worst"] == 0.0, rank
    assert all(Path(f).is_relative_to(purelib) for f in rank["files"].values()), rank["files"]
    line = _report_lines(out.stderr, rank["pid"])
    assert len(line) == 1 and "3 key(s)" in line[0] and line[0].endswith("(at exit)"), out.stderr[-3000:]
