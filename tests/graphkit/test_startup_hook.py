"""The start-up hook installed with the package (``_graphkit_startup``, read through ``graphkit-startup.pth``): its
import hook, in this process on modules made for the test, and the .pth file in fresh interpreters."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import _graphkit_startup
from _graphkit_startup import StartupHook
from graphkit.switch import ENV
from tests.paths import ROOT

HOOK_FILE = ROOT / "graphkit-startup.pth"


def _env(value: str | None, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != ENV}
    if value is not None:
        env[ENV] = value
    return {**env, **extra}


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
