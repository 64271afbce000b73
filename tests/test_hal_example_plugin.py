"""The example plugin package, installed the way a user installs it, found and conformant."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

import hal
from hal.registry import THIRD_PARTY_PRIORITY
from hal.testing.distributions import importable
from hal.testing.runner import run_pytest, run_suite

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "hal-hostmem"


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
    assert info.priority == THIRD_PARTY_PRIORITY
    with hal.get_backend("hostmem") as be:
        assert be.origin == "hal-hostmem 0.1.0"
        module = sys.modules[type(be.plugin).__module__]
        assert module.__name__ == "hal_hostmem.backend"
        assert Path(module.__file__).is_relative_to(hostmem_site), "not the installed copy"


def test_third_party_is_preferred_over_fake(hostmem_site: Path) -> None:
    names = [i.name for i in hal.list_backends()]
    assert names.index("hostmem") < names.index("fake")


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


def test_passes_the_conformance_suite(hostmem_site: Path) -> None:
    result = run_suite("hostmem", extra_paths=[hostmem_site])
    assert result.ok, result.output
    assert result.passed >= 40 and not result.failed_tests
    # a vmm-only plugin: the torch-based byte checks and the whole graph half skip, saying why
    graph_skips = [r for r in result.skip_reasons if "hostmem lacks capability" in r]
    assert len(graph_skips) >= 15 and all("(it declares: none)" in r for r in graph_skips), result.skip_reasons
    others = [r for r in result.skip_reasons if r not in graph_skips]
    assert others and all("torch" in r or "tensor_at" in r for r in others), others


def test_its_own_one_file_suite_passes(hostmem_site: Path, tmp_path: Path) -> None:
    tests = tmp_path / "tests"
    shutil.copytree(EXAMPLE / "tests", tests)
    result = run_pytest(["--rootdir", str(tmp_path), str(tests), "-k", "TestErrors or TestAliasing"],
                        extra_paths=[hostmem_site])
    assert result.ok, result.output
    assert result.passed >= 15, result.output
