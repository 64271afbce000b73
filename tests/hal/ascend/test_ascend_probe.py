"""Finding libascendcl and saying why the ascend backend is unavailable."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import hal
from hal.backends.ascend import AscendBackend, locate
from tests.sim import built, compiler_reason, home, sim_env

needs_gcc = pytest.mark.skipif(compiler_reason() is not None, reason=str(compiler_reason()))
needs_no_torch_npu = pytest.mark.skipif(locate.extension_installed(), reason="torch_npu is installed here")


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.delenv(locate.ENV_LIBRARY, raising=False)
    monkeypatch.delenv(locate.ENV_HOME, raising=False)
    return monkeypatch


@needs_no_torch_npu
def test_the_default_probe_says_what_is_missing(clean_env: pytest.MonkeyPatch) -> None:
    reason = AscendBackend.probe()
    assert reason is not None
    assert reason.startswith("libascendcl.so not found: $ASCEND_HOME_PATH is unset")
    assert "$HAL_ASCEND_LIBRARY" in reason and reason.endswith("and torch_npu is not installed")


@needs_gcc
@needs_no_torch_npu
def test_ascend_home_path_finds_the_runtime_but_the_default_needs_torch_npu(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv(locate.ENV_HOME, str(home("ascend")))
    reason = AscendBackend.probe()
    assert reason == (f"torch_npu is not installed (found {home('ascend')}/lib64/libascendcl.so; set "
                      f"$HAL_ASCEND_LIBRARY={home('ascend')}/lib64/libascendcl.so to use the VMM hooks without it)")


@needs_gcc
def test_the_library_override_makes_the_vmm_hooks_available(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv(locate.ENV_LIBRARY, str(built("ascend")))
    assert AscendBackend.probe() is None


def test_an_override_that_does_not_exist_is_named(clean_env: pytest.MonkeyPatch, tmp_path) -> None:
    clean_env.setenv(locate.ENV_LIBRARY, str(tmp_path / "libascendcl.so"))
    assert AscendBackend.probe() == (f"libascendcl.so not found: {tmp_path}/libascendcl.so does not exist "
                                     "(from $HAL_ASCEND_LIBRARY)")


def test_a_library_without_the_vmm_api_is_refused() -> None:
    with pytest.raises(hal.BackendUnavailableError, match=r"lacks aclInit.*aclrtMallocPhysical"):
        AscendBackend(library="libc.so.6", use_torch=False)


@needs_gcc
def test_the_library_option_wins_over_the_environment(clean_env: pytest.MonkeyPatch, tmp_path) -> None:
    clean_env.setenv(locate.ENV_LIBRARY, str(tmp_path / "missing.so"))
    plugin = AscendBackend(library=str(built("ascend")), use_torch=False)
    assert plugin.library.path == str(built("ascend"))
    assert plugin.granularity(recommended=False) == 2 << 20  # the simulator's default, like the devices'


@needs_no_torch_npu
@needs_gcc
def test_use_torch_true_needs_torch_npu() -> None:
    with pytest.raises(hal.BackendUnavailableError, match="torch_npu is not installed"):
        AscendBackend(library=str(built("ascend")), use_torch=True)


@needs_gcc
@needs_no_torch_npu
def test_python_m_hal_lists_ascend_over_the_simulator_and_says_why_mlu_is_not() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("HAL_MLU_LIBRARY", "NEUWARE_HOME", "HAL_BACKEND")}
    env.update(sim_env("ascend", capacity=1 << 30, granularity=1 << 16))
    out = subprocess.run([sys.executable, "-m", "hal"], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    ascend = next(i for i, line in enumerate(lines) if line.split()[:2] == ["ascend", "available"])
    assert "granularity: 64.0 KiB" in lines[ascend + 1] and "1.0 GiB free of 1.0 GiB" in lines[ascend + 1]
    assert "capabilities: -" in lines[ascend + 1]
    assert any("reason: libcndrv.so not found" in line and "torch_mlu is not installed" in line for line in lines)
