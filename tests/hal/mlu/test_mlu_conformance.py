"""The hal conformance suite against the mlu backend over the CNDrv simulator, in a child process."""

from __future__ import annotations

import os

import pytest

from hal.testing.runner import run_suite
from tests.sim import compiler_reason, sim_env

pytestmark = pytest.mark.skipif(compiler_reason() is not None, reason=str(compiler_reason()))


def test_the_conformance_suite_passes_over_the_cndrv_simulator() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("HAL_BACKEND", "NEUWARE_HOME")}
    env.update(sim_env("mlu", capacity=1 << 30, granularity=1 << 16))
    # the simulator's memory is host memory: the suite may read and write it with ctypes
    result = run_suite("mlu", {"host_accessible": True}, env=env, timeout=240)
    assert result.ok, result.output[-6000:]
    assert result.passed >= 40 and result.failures == result.errors == 0
    # only the torch-tensor aliasing test may skip (no torch_mlu), and memory sharing (the adapter has none):
    # aliasing and OOM ran
    assert all("torch" in reason or "lacks capability memory_sharing" in reason
               for reason in result.skip_reasons), result.skip_reasons
