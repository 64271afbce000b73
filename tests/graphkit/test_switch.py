"""GRAPHKIT_GRAPH_MEMORY: its value, the start-up hook installed with the package, the engines' plugin entry
points, and the switch in processes that never call graphkit (spawned and forked ranks, a fresh environment)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import logging
import os
import re
import shutil
import site
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import _graphkit_startup
import graphkit
import hal
from _graphkit_startup import StartupHook
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


# -- the value ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [None, "", "  ", "0", "off", "No", " false "])
def test_values_that_leave_the_switch_off(value: str | None) -> None:
    assert switch.parse(value) is None
    assert not _graphkit_startup.requested({} if value is None else {ENV: value})


@pytest.mark.parametrize(("value", "options"), [
    ("1", Options()), ("on", Options()), ("TRUE", Options()), ("yes", Options()),
    ("kind=shared,verify=0", Options(kind="shared", verify=False)),
    (" report=0 , hygiene=on ", Options(report=0.0, hygiene=True)),
    ("kind=private,", Options(kind="private")),
    ("report=2.5", Options(report=2.5)),
    ("1,kind=shared", Options(kind="shared")), ("yes,verify=1", Options(verify=True)),  # the word beside options
])
def test_values_that_turn_it_on(value: str, options: Options) -> None:
    assert switch.parse(value) == options
    assert _graphkit_startup.requested({ENV: value})


@pytest.mark.parametrize(("value", "named"), [
    ("2", "'2'"), ("bogus", "'bogus'"), ("kind=bogus", "'kind=bogus'"), ("verify=2", "'verify=2'"),
    ("hygiene=", "'hygiene='"), ("report=-1", "'report=-1'"), ("report=nan", "'report=nan'"),
    ("report=inf", "'report=inf'"), ("report=soon", "'report=soon'"), ("2,kind=shared", "'2'"),
    ("report=1e10", "'report=1e10'"),  # past what threading.Timer waits: every capture's timer thread would die
    ("=1", "'=1'"), ("kind=vmm,kind=shared", "'kind=shared' is given twice"),
])
def test_bad_values_are_refused_naming_the_variable_and_the_option(value: str, named: str) -> None:
    with pytest.raises(hal.InvalidArgumentError, match=re.escape(named)) as caught:
        switch.parse(value)
    assert caught.value.call == ENV
    assert str(caught.value).startswith(f"{ENV}: ") and str(caught.value).count(ENV) == 1
    assert _graphkit_startup.requested({ENV: value})  # the hook still waits for torch: the switch reports it


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


@pytest.mark.parametrize(("fields", "named"), [
    ({"report": 1e10}, "report=10000000000.0 must be seconds >= 0"), ({"report": -1}, "report=-1"),
    ({"kind": "bogus"}, "kind='bogus' must be one of"), ({"verify": "yes"}, "verify='yes' must be a bool"),
])
def test_options_made_in_code_are_checked_as_the_variable_is(fields: dict[str, Any], named: str) -> None:
    with pytest.raises(hal.InvalidArgumentError, match=named):
        Options(**fields)


@pytest.mark.parametrize("options", [Options(), Options(kind="shared", outputs="replay", verify=True, hygiene=True,
                                                             executables=3),
                                     Options(kind="private", executables=None)])
def test_the_value_a_block_writes_for_its_children_reads_back_as_its_options(options: Options) -> None:
    from graphkit.graphs.switch_value import written

    value = written(options.kind, options.outputs, options.verify, options.hygiene, options.executables)
    assert switch.parse(value) == options
    assert switch.parse is graphkit.graphs.switch_value.parse and switch.Options is graphkit.graphs.switch_value.Options


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


# -- the start-up hook's import hook (in this process, on modules made for the test) ---------------------------


@pytest.fixture
def modules(tmp_path: Path, monkeypatch) -> Iterator[Path]:
    """A folder on sys.path for the test's modules; they and any hook the test adds are gone afterwards."""
    monkeypatch.syspath_prepend(str(tmp_path))
    before, meta = set(sys.modules), list(sys.meta_path)
    yield tmp_path
    for name in set(sys.modules) - before:
        del sys.modules[name]
    sys.meta_path[:] = meta


def _write(folder: Path, name: str, body: str) -> None:
    (folder / f"{name}.py").write_text(textwrap.dedent(body))


def _hook(on_ready: Any, triggers: tuple[str, ...], importers: tuple[str, ...] = ()) -> StartupHook:
    hook = StartupHook(on_ready, triggers, importers)
    sys.meta_path.insert(0, hook)
    return hook


def test_the_hook_runs_once_the_trigger_module_has_finished_importing(modules: Path) -> None:
    _write(modules, "gk_trigger_a", "import time\nDONE = True\n")
    seen = []
    _hook(lambda: seen.append(getattr(sys.modules["gk_trigger_a"], "DONE", False)), ("gk_trigger_a",))
    probed = importlib.util.find_spec("gk_trigger_a")  # probing finds it, and its loader answers as usual
    assert probed is not None and probed.loader is not None and not probed.loader.is_package("gk_trigger_a")
    assert seen == []
    import gk_trigger_a  # type: ignore[import-not-found]

    assert seen == [True]
    assert type(gk_trigger_a.__loader__).__name__ == "SourceFileLoader"  # the module keeps its own loader
    assert gk_trigger_a.__spec__.loader is gk_trigger_a.__loader__


def test_the_hook_waits_while_an_importer_module_is_half_imported(modules: Path) -> None:
    _write(modules, "gk_trigger_b", "")
    _write(modules, "gk_importer_b", "import gk_trigger_b\nDONE = True\n")
    seen = []
    _hook(lambda: seen.append(getattr(sys.modules["gk_importer_b"], "DONE", False)), ("gk_trigger_b",),
          ("gk_importer_b",))
    import gk_importer_b  # type: ignore[import-not-found]  # noqa: F401

    assert seen == [True]


def test_the_hook_is_not_reentered_by_the_imports_of_its_own_callback(modules: Path) -> None:
    _write(modules, "gk_trigger_c", "")
    _write(modules, "gk_importer_c", "import gk_trigger_c\n")
    calls = []

    def on_ready() -> None:
        calls.append(1)
        import gk_importer_c  # type: ignore[import-not-found]  # noqa: F401

    _hook(on_ready, ("gk_trigger_c",), ("gk_importer_c",))
    import gk_trigger_c  # type: ignore[import-not-found]  # noqa: F401

    assert calls == [1]


def test_a_failed_import_does_not_trigger_and_a_failing_callback_is_logged_not_raised(modules: Path, caplog,
                                                                                     monkeypatch) -> None:
    _write(modules, "gk_trigger_d", "raise ImportError('not here')\n")
    _write(modules, "gk_trigger_e", "")
    calls = []

    def on_ready() -> None:
        calls.append(1)
        raise RuntimeError("broken")

    _hook(on_ready, ("gk_trigger_d", "gk_trigger_e"))
    with pytest.raises(ImportError, match="not here"):
        import gk_trigger_d  # type: ignore[import-not-found]  # noqa: F401
    assert calls == []
    monkeypatch.setattr(_graphkit_startup, "_warned", False)
    with caplog.at_level(logging.WARNING, logger="graphkit.switch"):
        import gk_trigger_e  # type: ignore[import-not-found]  # noqa: F401
    assert calls == [1]
    assert "did not start" in caplog.text and "RuntimeError: broken" in caplog.text


def test_install_is_inert_without_the_variable_and_registers_one_hook_with_it(modules: Path, monkeypatch) -> None:
    calls = []
    monkeypatch.delenv(ENV, raising=False)
    assert _graphkit_startup.install(lambda: calls.append(1)) is None
    monkeypatch.setenv(ENV, "0")
    assert _graphkit_startup.install(lambda: calls.append(1)) is None
    assert not any(isinstance(f, StartupHook) for f in sys.meta_path)
    monkeypatch.setenv(ENV, "1")
    hook = _graphkit_startup.install(lambda: calls.append(1))
    assert hook is not None and calls == [1]  # torch is imported already in this process: it runs at once
    assert _graphkit_startup.install(lambda: calls.append(2)) is hook
    assert [f for f in sys.meta_path if isinstance(f, StartupHook)] == [hook] and calls == [1]


# -- the .pth file in fresh interpreters -----------------------------------------------------------------------


_PROBE = """
import json, site, sys
before = set(sys.modules)
for folder in sys.argv[1:]:
    site.addsitedir(folder)          # the hook processed twice: two site folders that both carry it
hooks = [type(f).__name__ for f in sys.meta_path if getattr(f, "graphkit_startup_hook", False)]
new = sorted(set(sys.modules) - before)
foreign = sorted({name.split(".")[0] for name in new} - set(sys.stdlib_module_names))
print(json.dumps({"hooks": hooks, "new": new, "foreign": foreign}))
"""


@pytest.mark.parametrize("value", [None, "0", "1", "kind=bogus"])
def test_the_pth_file_imports_neither_torch_nor_graphkit(tmp_path: Path, value: str | None) -> None:
    folders = []
    for name in ("base", "venv"):
        folder = tmp_path / name
        folder.mkdir()
        shutil.copy(HOOK_FILE, folder)
        folders.append(str(folder))
    # -S: no site-packages (nothing installed is read); the project's root gives the hook's module only
    out = subprocess.run([sys.executable, "-S", "-c", _PROBE, *folders], capture_output=True, text=True,
                         timeout=60, env=_env(value, PYTHONPATH=str(ROOT)), check=True)
    assert out.stderr == ""
    seen = json.loads(out.stdout)
    on = value not in (None, "0")
    assert seen["hooks"] == (["StartupHook"] if on else [])
    assert not {"torch", "hal", "graphkit"} & set(seen["new"])
    assert seen["foreign"] == (["_graphkit_startup"] if value is not None else [])  # and the standard library


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


def test_a_value_set_already_wins_over_the_blocks(monkeypatch) -> None:
    """A block leaves a variable the user set alone (``0`` included), and puts back what it set."""
    from graphkit.graphs.scope import FROM_ENV

    be = hal.get_backend("fake")
    monkeypatch.setenv(ENV, "0")
    with graphkit.graph_memory(be):
        assert os.environ[ENV] == "0" and FROM_ENV not in os.environ
    monkeypatch.delenv(ENV)
    with graphkit.graph_memory(be, outputs="replay") as pools:
        assert switch.parse(os.environ[ENV]) == Options(outputs="replay")
        assert os.environ[FROM_ENV] == str(os.getpid())
        assert switch.start_from_environment() is None  # this process is the block's
    assert ENV not in os.environ and FROM_ENV not in os.environ
    with graphkit.graph_memory(be, children=False):
        assert ENV not in os.environ
    with pytest.raises(hal.InvalidArgumentError, match="children="):
        with graphkit.graph_memory(be, children="yes"):  # type: ignore[arg-type]
            pass
    pools.close()


def test_a_block_says_once_when_this_python_cannot_serve_the_processes_it_starts(monkeypatch, tmp_path: Path,
                                                                                  caplog) -> None:
    """Without the start-up hook in this interpreter's site-packages (``pip`` of another Python installed the
    package), processes started inside a block never read the variable: the block says so, naming this Python
    and the fix, once per process; with the hook there it says nothing."""
    from graphkit.graphs import scope

    be = hal.get_backend("fake")
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setattr(scope, "_hook_warned", False)
    monkeypatch.setattr(scope, "hook_folders", lambda: [str(tmp_path)])
    with caplog.at_level(logging.WARNING, logger="graphkit.graphs.scope"):
        for _ in range(2):
            with graphkit.graph_memory(be) as pools:
                pass
            pools.close()
    said = [r.getMessage() for r in caplog.records if "will not be served" in r.getMessage()]
    assert len(said) == 1 and sys.executable in said[0] and "-m pip install" in said[0], said
    caplog.clear()
    monkeypatch.setattr(scope, "_hook_warned", False)
    (tmp_path / scope.HOOK_FILE).write_text("")
    with caplog.at_level(logging.WARNING, logger="graphkit.graphs.scope"):
        with graphkit.graph_memory(be) as pools:
            pass
        pools.close()
    assert not [r for r in caplog.records if "will not be served" in r.getMessage()]
    assert scope.startup_hook_installed()


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
