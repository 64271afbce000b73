"""Finding libcndrv and saying why the mlu backend is unavailable."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import hal
from hal.backends.mlu import MluBackend, locate
from tests.sim import Simulator, built, compiler_reason, home, private_copy, sim_env

needs_gcc = pytest.mark.skipif(compiler_reason() is not None, reason=str(compiler_reason()))
needs_no_torch_mlu = pytest.mark.skipif(locate.extension_installed(), reason="torch_mlu is installed here")


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.delenv(locate.ENV_LIBRARY, raising=False)
    monkeypatch.delenv(locate.ENV_HOME, raising=False)
    return monkeypatch


@needs_no_torch_mlu
def test_the_default_probe_says_what_is_missing(clean_env: pytest.MonkeyPatch) -> None:
    reason = MluBackend.probe()
    assert reason is not None
    assert reason.startswith("libcndrv.so not found: $NEUWARE_HOME is unset")
    assert "$HAL_MLU_LIBRARY" in reason and reason.endswith("and torch_mlu is not installed")


@needs_gcc
@needs_no_torch_mlu
def test_neuware_home_finds_the_driver_but_the_default_needs_torch_mlu(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv(locate.ENV_HOME, str(home("mlu")))
    path = f"{home('mlu')}/lib64/libcndrv.so"
    assert MluBackend.probe() == (f"torch_mlu is not installed (found {path}; set $HAL_MLU_LIBRARY={path} "
                                  "to use the VMM hooks without it)")


@needs_gcc
def test_the_library_override_makes_the_vmm_hooks_available(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv(locate.ENV_LIBRARY, str(built("mlu")))
    assert MluBackend.probe() is None


def test_an_override_that_does_not_exist_is_named(clean_env: pytest.MonkeyPatch, tmp_path) -> None:
    clean_env.setenv(locate.ENV_LIBRARY, str(tmp_path / "libcndrv.so"))
    assert MluBackend.probe() == f"libcndrv.so not found: {tmp_path}/libcndrv.so does not exist (from $HAL_MLU_LIBRARY)"


def test_a_library_without_the_vmm_api_is_refused() -> None:
    with pytest.raises(hal.BackendUnavailableError, match=r"lacks cnInit.*cnMemCreate"):
        MluBackend(library="libc.so.6", use_torch=False)


@needs_gcc
def test_the_library_option_wins_over_the_environment(clean_env: pytest.MonkeyPatch, tmp_path) -> None:
    clean_env.setenv(locate.ENV_LIBRARY, str(tmp_path / "missing.so"))
    plugin = MluBackend(library=str(built("mlu")), use_torch=False)
    assert plugin.library.path == str(built("mlu"))
    assert plugin.granularity(recommended=False) == 2 << 20  # the simulator's default, like the devices'


@needs_no_torch_mlu
@needs_gcc
def test_use_torch_true_needs_torch_mlu() -> None:
    with pytest.raises(hal.BackendUnavailableError, match="torch_mlu is not installed"):
        MluBackend(library=str(built("mlu")), use_torch=True)


@needs_gcc
@needs_no_torch_mlu
def test_python_m_hal_lists_mlu_over_the_simulator_and_says_why_ascend_is_not() -> None:
    env = {k: v for k, v in os.environ.items()
           if k not in ("HAL_ASCEND_LIBRARY", "ASCEND_HOME_PATH", "HAL_BACKEND")}
    env.update(sim_env("mlu", capacity=1 << 30, granularity=1 << 16))
    out = subprocess.run([sys.executable, "-m", "hal"], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    mlu = next(i for i, line in enumerate(lines) if line.split()[:2] == ["mlu", "available"])
    assert "granularity: 64.0 KiB" in lines[mlu + 1] and "1.0 GiB free of 1.0 GiB" in lines[mlu + 1]
    assert "capabilities: -" in lines[mlu + 1]
    assert any("reason: libascendcl.so not found" in line and "torch_npu is not installed" in line
               for line in lines)


@needs_gcc
def test_the_probe_asks_a_child_and_leaves_this_process_without_cninit(clean_env: pytest.MonkeyPatch) -> None:
    path = str(private_copy("mlu"))  # a library no other test has loaded in this process
    clean_env.setenv(locate.ENV_LIBRARY, path)
    assert MluBackend.probe() is None
    assert locate.count_devices(path) == ("cnDeviceGetCount", 0, 1)
    assert Simulator(locate.open_library().cdll, "mlu").count("init") == 0  # free to fork


@needs_gcc
def test_a_probe_whose_child_fails_says_why(clean_env: pytest.MonkeyPatch, tmp_path) -> None:
    clean_env.setenv(locate.ENV_LIBRARY, str(built("mlu")))
    clean_env.setenv("CNDRV_SIM_DEVICES", "0")
    assert MluBackend.probe() == f"{built('mlu')} sees no MLU (cnDeviceGetCount returned 0)"
    clean_env.setattr(locate.sys, "executable", str(tmp_path / "no-python"))
    reason = MluBackend.probe()
    assert reason is not None and reason.startswith(f"{built('mlu')} cannot be probed: the probe's child process")
