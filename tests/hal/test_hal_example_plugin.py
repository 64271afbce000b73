"""The example plugin package, installed the way a user installs it, found and conformant."""

from __future__ import annotations

import ast
import io
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import tokenize
from collections.abc import Iterator
from pathlib import Path

import pytest

import hal
from hal.registry import THIRD_PARTY_PRIORITY
from hal.testing.distributions import importable
from hal.testing.runner import run_pytest, run_suite
from tests.paths import ROOT

EXAMPLE = ROOT / "examples" / "hal-hostmem"


@pytest.fixture(scope="module")
def hostmem_site() -> Iterator[Path]:
    """``pip install --target`` of a copy of the example (the checkout stays clean); removed afterwards."""
    tmp = Path(tempfile.mkdtemp(prefix="hal-hostmem-"))
    try:
        src, site = tmp / "src", tmp / "site"
        shutil.copytree(EXAMPLE, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
             "--no-index", "--disable-pip-version-check", "--target", str(site), str(src)],
            capture_output=True, text=True, timeout=300,
        )
        assert proc.returncode == 0, f"pip install failed:\n{proc.stdout}\n{proc.stderr}"
        with importable(site):
            yield site
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def test_discovered_through_its_entry_point(hostmem_site: Path) -> None:
    info = {i.name: i for i in hal.list_backends()}["hostmem"]
    assert info.available, info.reason
    assert info.origin == "hal-hostmem 0.1.0"
    assert info.priority == 2000 > THIRD_PARTY_PRIORITY
    with hal.get_backend("hostmem") as be:
        assert be.origin == "hal-hostmem 0.1.0"
        module = sys.modules[type(be.plugin).__module__]
        assert module.__name__ == "hal_hostmem.backend"
        assert Path(module.__file__).is_relative_to(hostmem_site), "not the installed copy"


def test_a_host_device_declares_a_priority_after_fake(hostmem_site: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HAL_BACKEND", raising=False)
    names = [i.name for i in hal.list_backends()]
    assert names.index("fake") < names.index("hostmem")
    with hal.get_backend(requires=("graphs",)) as be:  # installing it changes no default choice
        assert be.name != "hostmem"
    every = hal.CAPABILITIES - {"unmap_waits"}  # memory sharing too (its chunks are memfds); its unmap does not wait
    with hal.get_backend("hostmem", requires=every) as be:
        assert be.capabilities == every


def test_it_aliases_like_a_device(hostmem_site: Path) -> None:
    import ctypes

    with hal.get_backend("hostmem", granularity=1 << 16, capacity=1 << 20) as be:
        g = be.granularity
        h = be.create_phy_mem_handle(g)
        va1, va2 = be.create_vir_ptr(g), be.create_vir_ptr(2 * g)
        be.map(va1, g, h)
        be.map(va2 + g, g, h)
        ctypes.memmove(va1 + 10, b"hostmem", 7)
        assert ctypes.string_at(va2 + g + 10, 7) == b"hostmem"
        with pytest.raises(hal.DeviceOutOfMemoryError):
            be.create_phy_mem_handle(1 << 20)
    assert be.live.zero


def test_unknown_option_names_it(hostmem_site: Path) -> None:
    with pytest.raises(hal.InvalidArgumentError, match="capacty"):
        hal.get_backend("hostmem", capacty=1 << 20)


@pytest.mark.parametrize("half, at_least", [("vmm", 40), ("graph", 25)])
def test_passes_each_half_of_the_conformance_suite(hostmem_site: Path, half: str, at_least: int) -> None:
    result = run_suite("hostmem", extra_paths=[hostmem_site], extra_args=["--hal-half", half])
    assert result.ok, result.output
    assert result.passed >= at_least and not result.failed_tests, result.output
    # graphs through the public host recorder, memory sharing through hal.host.vm: no test skips, as the
    # guide and the example's README say
    assert result.skipped == 0, result.skip_reasons


def code_lines(path: Path) -> int:
    """Lines of ``path`` that hold code: not blank, not comments, not docstrings."""
    source = path.read_text()
    docs: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            docs.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}
    lines = {line for tok in tokenize.generate_tokens(io.StringIO(source).readline) if tok.type not in skip
             for line in range(tok.start[0], tok.end[0] + 1)}
    return len(lines - docs)


def test_the_guides_count_of_the_examples_lines_of_code_is_true() -> None:
    """The guide and the example's README say how many lines of code the package is, counted as
    :func:`code_lines` counts them (the rule they state): the number stays true as the example changes."""
    total = sum(code_lines(p) for p in (EXAMPLE / "hal_hostmem").glob("*.py"))
    for doc in (ROOT / "docs" / "plugins.md", EXAMPLE / "README.md"):
        said = re.findall(r"(\d+) lines of code \(lines that are not blank, comments or docstrings",
                          " ".join(doc.read_text().split()))
        assert said == [str(total)], f"{doc.name} says {said}; the package has {total} lines of code"


def test_the_example_imports_nothing_private() -> None:
    for path in (EXAMPLE / "hal_hostmem").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for name in names:
                if name.split(".")[0] == "hal":
                    assert not any(part.startswith("_") for part in name.split(".")), f"{path.name}: {name}"
                    assert not name.startswith("hal.backends"), f"{path.name} imports a backend's internals: {name}"


def test_it_works_where_the_fake_backend_cannot_be_imported(hostmem_site: Path) -> None:
    child = textwrap.dedent("""
        import ctypes, sys
        sys.modules["hal.backends.fake"] = None  # any import of fake now fails
        import torch, hal
        with hal.get_backend("hostmem", granularity=1 << 16) as be:
            g = be.granularity
            h = be.create_phy_mem_handle(g)
            va1, va2 = be.create_vir_ptr(g), be.create_vir_ptr(g)
            be.map(va1, g, h)
            be.map(va2, g, h)
            ctypes.memmove(va1, b"hostmem", 7)
            assert ctypes.string_at(va2, 7) == b"hostmem"
            x = torch.ones(256)
            graph = be.create_graph()
            with be.capture(graph):
                y = x * 3
            x.fill_(2.0)
            be.replay(graph)
            assert torch.equal(y, torch.full((256,), 6.0))
            be.release_graph(graph)
            del y
            for va in (va1, va2):
                be.unmap(va, g)
                be.release_vir_ptr(va, g)
            be.release_phy_mem_handle(h)
        print("worked without", [m for m, v in sys.modules.items() if m.startswith("hal.backends.fake") and v])
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(hostmem_site), str(ROOT)]))
    proc = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "worked without []", proc.stdout


def test_its_own_one_file_suite_passes(hostmem_site: Path, tmp_path: Path) -> None:
    tests = tmp_path / "tests"
    shutil.copytree(EXAMPLE / "tests", tests)
    result = run_pytest(["--rootdir", str(tmp_path), str(tests), "-k",
                         "TestErrors or TestAliasing or TestCapturedWork"], extra_paths=[hostmem_site])
    assert result.ok, result.output
    assert result.passed >= 19, result.output
