"""Shared fixtures: device markers skip with the backend's own reason when it is unavailable."""

from __future__ import annotations

import gc
import os
import sys
from collections.abc import Iterator

# every fake backend of the suite, in this process and in the processes it starts, behaves as a device that runs
# behind the host: an unmap that did not wait for the work queued over the range fails the test that did it
os.environ.setdefault("HAL_FAKE_ASYNC", "1")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # several test processes share the machine's cores (-n auto): one intra-op thread each, for them and the
    # processes they start: the tests' tensors are tiny, and more threads per process only contend
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if "torch" in sys.modules:  # imported before this file: the variable came too late for it
        sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

import pytest

import hal

DEVICE_MARKERS = ("cuda", "ascend", "mlu")

#: the granule of the fake backend the tests make: small, so tests run small
G = 1 << 16

#: the step a CUDA driver's used-memory figure moves by: it hands out device memory in 2 MiB pages, so any growth a
#: test measures is a whole number of them (how many, for a given workload, differs by GPU generation)
DRIVER_STEP = 2 << 20


def _reasons() -> dict[str, str]:
    return {i.name: ("" if i.available else i.reason) for i in hal.list_backends()}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpus(n): needs n GPUs (multi_gpu: 2); skipped with the count found")


def gpus_needed(item: pytest.Item) -> int:
    """The GPUs a test needs: ``@pytest.mark.gpus(n)``, 2 for ``multi_gpu``, else 0."""
    marker = item.get_closest_marker("gpus")
    return max(int(marker.args[0]) if marker is not None else 0, 2 if item.get_closest_marker("multi_gpu") else 0)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reasons = _reasons()
    found: tuple[int, str] | None = None  # the GPUs here, counted once
    for item in items:
        for marker in DEVICE_MARKERS:
            if item.get_closest_marker(marker) and reasons.get(marker, "not installed"):
                item.add_marker(pytest.mark.skip(reason=f"{marker} unavailable: {reasons.get(marker)}"))
        needed = gpus_needed(item)
        if needed and not reasons.get("cuda"):
            if found is None:
                try:
                    with hal.get_backend("cuda") as be:
                        found = (be.device_count(), "")
                except hal.HalError as exc:  # pragma: no cover - device machines only
                    found = (0, f" ({exc})")
            if found[0] < needed:
                item.add_marker(pytest.mark.skip(reason=f"needs {needed} GPUs, found {found[0]}{found[1]}"))


#: a device test whose call takes longer than this and is not marked ``slow`` is named at the end of the run
SLOW_S = 10.0
_unmarked_slow: list[tuple[str, float]] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if (report.when == "call" and report.duration > SLOW_S and "slow" not in report.keywords
            and any(marker in report.keywords for marker in DEVICE_MARKERS)):
        _unmarked_slow.append((report.nodeid, report.duration))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _unmarked_slow:
        terminalreporter.section(f"slower than {SLOW_S:.0f} s and not marked slow (mark them)")
        for nodeid, seconds in sorted(_unmarked_slow, key=lambda item: -item[1]):
            terminalreporter.write_line(f"{seconds:7.1f} s  {nodeid}")


#: parametrize a test over every backend that can run graphs: fake always, cuda where present
GRAPH_BACKENDS = [pytest.param("fake", id="fake"), pytest.param("cuda", id="cuda", marks=pytest.mark.cuda)]


def backend_options(name: str) -> dict:
    """Small granules on fake so tests run small; the driver's own on devices."""
    return {"granularity": 1 << 16} if name == "fake" else {}


@pytest.fixture(params=GRAPH_BACKENDS)
def graph_backend(request: pytest.FixtureRequest):
    """A fresh backend of each graph-capable kind; checks that nothing is left live at the end."""
    be = hal.get_backend(request.param, requires=("graphs",), **backend_options(request.param))
    yield be
    leftover = be.live
    be.close()
    assert leftover.zero, f"{be.name}: the test left {leftover} live (close() had to release it)"
    assert be.live.zero, f"{be.name}: still live after close(): {be.live}"


@pytest.fixture
def be() -> Iterator[hal.Backend]:
    """A fresh fake backend with granule ``G``; objects the test dropped are collected before it closes.

    A test file that needs another backend (a device, a simulator) defines its own ``be``.
    """
    backend = hal.get_backend("fake", granularity=G)
    yield backend
    gc.collect()
    backend.close()
