"""Shared fixtures: device markers skip with the backend's own reason when it is unavailable."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

import hal

DEVICE_MARKERS = ("cuda", "ascend", "mlu")

#: the granule of the fake backend the tests make: small, so tests run small
G = 1 << 16


def _reasons() -> dict[str, str]:
    return {i.name: ("" if i.available else i.reason) for i in hal.list_backends()}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reasons = _reasons()
    for item in items:
        for marker in DEVICE_MARKERS:
            if item.get_closest_marker(marker) and reasons.get(marker, "not installed"):
                item.add_marker(pytest.mark.skip(reason=f"{marker} unavailable: {reasons.get(marker)}"))
        if item.get_closest_marker("multi_gpu") and not reasons.get("cuda"):
            why = ""
            try:
                with hal.get_backend("cuda") as be:
                    n = be.device_count()
            except hal.HalError as exc:  # pragma: no cover - device machines only
                n, why = 0, f" ({exc})"
            if n < 2:
                item.add_marker(pytest.mark.skip(reason=f"needs 2 GPUs, found {n}{why}"))


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
