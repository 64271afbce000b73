"""Run the conformance suite in a child process and read back its counts.

The programmatic twin of ``python -m pytest --pyargs hal.testing --hal-backend NAME``,
for a plugin's own CI or tests::

    result = run_suite("hostmem", {"granularity": 1 << 16})
    assert result.ok, result.output
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

PLUGIN_MODULE = "hal.testing.plugin"


@dataclass(frozen=True)
class SuiteResult:
    """Exit status, JUnit counts and output of one suite run."""

    returncode: int
    tests: int
    failures: int
    errors: int
    skipped: int
    output: str
    skip_reasons: tuple[str, ...] = ()
    failed_tests: tuple[str, ...] = ()
    """``Class.test`` of every test that failed or errored."""

    @property
    def passed(self) -> int:
        return self.tests - self.failures - self.errors - self.skipped

    @property
    def ok(self) -> bool:
        """The run succeeded and at least one test passed."""
        return self.returncode == 0 and self.passed > 0 and not (self.failures or self.errors)


def suite_command(backend: str | None, options: Mapping[str, Any] | None = None) -> list[str]:
    """The documented command line, as an argv list."""
    argv = [sys.executable, "-m", "pytest", "--pyargs", "hal.testing"]
    if backend is not None:
        argv += ["--hal-backend", backend]
    for key, value in (options or {}).items():
        argv += ["--hal-option", f"{key}={value}"]
    return argv


def _plugin_installed() -> bool:
    return any(ep.value == PLUGIN_MODULE for ep in metadata.entry_points(group="pytest11"))


def run_suite(
    backend: str | None,
    options: Mapping[str, Any] | None = None,
    *,
    extra_paths: Sequence[str | os.PathLike[str]] = (),
    extra_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    timeout: float = 300,
) -> SuiteResult:
    """Run the suite against ``backend`` in a fresh interpreter; return what happened.

    :param extra_paths: prepended to ``PYTHONPATH`` (e.g. where a plugin was installed).
    :param extra_args: more pytest arguments (``-k TestErrors``...).
    :param env: the child's environment (default: this one, without ``HAL_BACKEND``).
    """
    argv = suite_command(backend, options)[3:] + list(extra_args)  # without "python -m pytest"
    return run_pytest(argv, extra_paths=extra_paths, env=env, timeout=timeout)


def run_pytest(
    args: Sequence[str],
    *,
    extra_paths: Sequence[str | os.PathLike[str]] = (),
    env: Mapping[str, str] | None = None,
    timeout: float = 300,
) -> SuiteResult:
    """Run ``python -m pytest *args`` in a temporary directory; return its counts."""
    hal_root = Path(__file__).resolve().parents[2]
    child_env = dict(os.environ if env is None else env)
    if env is None:
        child_env.pop("HAL_BACKEND", None)
    paths = [str(p) for p in extra_paths] + [str(hal_root)]
    if child_env.get("PYTHONPATH"):
        paths.append(child_env["PYTHONPATH"])
    child_env["PYTHONPATH"] = os.pathsep.join(paths)
    with tempfile.TemporaryDirectory(prefix="hal-suite-") as tmp:
        report = Path(tmp) / "junit.xml"
        argv = [sys.executable, "-m", "pytest", *args, "-p", "no:cacheprovider", "-rs", f"--junitxml={report}"]
        if not _plugin_installed():  # running from a source checkout that was never installed
            argv += ["-p", PLUGIN_MODULE]
        proc = subprocess.run(argv, cwd=tmp, env=child_env, capture_output=True, text=True, timeout=timeout)
        counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
        reasons: list[str] = []
        failed: list[str] = []
        if report.exists():
            root = ET.parse(report).getroot()
            suite = root if root.tag == "testsuite" else root.find("testsuite")
            if suite is not None:
                counts = {k: int(suite.get(k, 0)) for k in counts}
                reasons = [s.get("message", "") for s in suite.iter("skipped")]
                failed = [f"{case.get('classname', '').rpartition('.')[2]}.{case.get('name')}"
                          for case in suite.iter("testcase")
                          if case.find("failure") is not None or case.find("error") is not None]
    return SuiteResult(proc.returncode, output=proc.stdout + proc.stderr, skip_reasons=tuple(reasons),
                       failed_tests=tuple(failed), **counts)
