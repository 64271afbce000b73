"""pytest plugin of the hal conformance suite (entry point ``pytest11: hal``).

Adds ``--hal-backend NAME``, ``--hal-option KEY=VALUE`` and ``--hal-half vmm|graph``
(run one half of the suite) and the fixtures the suite uses. Every fixture
can be overridden in a ``conftest.py``, e.g. a plugin's own repository can
pin ``hal_backend_name``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import hal
from hal.testing.memory import MemoryAccess, memory_access
from hal.testing.options import parse_options, split_options
from hal.testing.requirements import Requirements

ENV_VAR = "HAL_BACKEND"
#: ``--hal-half`` values -> the module whose test classes make up that half.
HALVES = {"vmm": "hal.testing.suite", "graph": "hal.testing.graph_suite"}


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("hal", "hal conformance suite: python -m pytest --pyargs hal.testing --hal-backend NAME")
    group.addoption(
        "--hal-backend", dest="hal_backend", default=None, metavar="NAME",
        help=f"backend to run the hal conformance suite against (default: ${ENV_VAR}; "
             "without either the suite is skipped)",
    )
    group.addoption(
        "--hal-half", dest="hal_half", choices=HALVES, default=None,
        help="run one half of the suite: 'vmm' (queries, reserve/create/map, errors, faults, lifecycle) or "
             "'graph' (streams, pools, capture, replay, routing); default: both",
    )
    group.addoption(
        "--hal-option", dest="hal_option", action="append", default=[], metavar="KEY=VALUE",
        help="option passed to hal.get_backend (repeatable; ints and true/false are parsed, "
             f"e.g. granularity=65536); keys naming a requirement ({', '.join(Requirements.fields())}) "
             "configure the suite instead",
    )


def _parsed(config: pytest.Config) -> tuple[dict[str, Any], dict[str, Any]]:
    try:
        options, overrides = split_options(parse_options(config.getoption("hal_option") or []))
        Requirements().with_overrides(overrides, "--hal-option")  # wrong types fail here
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from exc
    return options, overrides


def pytest_configure(config: pytest.Config) -> None:
    _parsed(config)  # bad KEY=VALUE syntax is a usage error, reported once


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """With ``--hal-half``, deselect the suite's tests of the other half (a plugin's own tests stay)."""
    half = config.getoption("hal_half")
    if not half:
        return
    keep: list[pytest.Item] = []
    drop: list[pytest.Item] = []
    for item in items:
        module = getattr(getattr(item, "cls", None), "__module__", None)
        (drop if module in HALVES.values() and module != HALVES[half] else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def pytest_report_header(config: pytest.Config) -> list[str]:
    name = config.getoption("hal_backend") or os.environ.get(ENV_VAR)
    if not name:
        return []
    options, overrides = _parsed(config)
    half = config.getoption("hal_half") or "both"
    requirements = _requirements(name, overrides)
    return [f"hal conformance: backend={name} options={options} requirements={requirements} half={half}"]


def _requirements(name: str, overrides: dict[str, Any]) -> dict[str, Any]:
    """What the suite assumes of backend ``name``: its class's ``hal_requirements``, then ``overrides``."""
    try:
        cls = hal.registry.plugin_class(name)
    except hal.HalError:  # the fixtures say why, once the tests run
        cls = None
    try:
        return dataclasses.asdict(Requirements.for_plugin(cls, overrides))
    except ValueError:  # a bad hal_requirements: hal_requirements fails with the reason
        return overrides


@pytest.fixture(scope="session")
def hal_backend_name(request: pytest.FixtureRequest) -> str:
    """The backend under test: ``--hal-backend``, else ``$HAL_BACKEND``, else skip."""
    name = request.config.getoption("hal_backend") or os.environ.get(ENV_VAR)
    if not name:
        pytest.skip(f"no hal backend chosen: pass --hal-backend NAME or set {ENV_VAR}")
    return name


@pytest.fixture(scope="session")
def hal_options(request: pytest.FixtureRequest) -> dict[str, Any]:
    """Backend options from ``--hal-option`` (requirement keys removed)."""
    return _parsed(request.config)[0]


@pytest.fixture(scope="session")
def hal_requirement_overrides(request: pytest.FixtureRequest) -> dict[str, Any]:
    """Requirement fields given on the command line through ``--hal-option``."""
    return _parsed(request.config)[1]


@pytest.fixture(scope="session")
def hal_backend_factory(hal_backend_name: str, hal_options: dict[str, Any]) -> Callable[[], hal.Backend]:
    """A callable that opens a fresh backend; fails once, clearly, when the backend cannot be used."""
    infos = {i.name: i for i in hal.list_backends()}
    info = infos.get(hal_backend_name)
    if info is None:
        pytest.fail(f"hal backend {hal_backend_name!r} is not installed; known: {', '.join(sorted(infos))}",
                    pytrace=False)
    if not info.available:
        pytest.fail(f"hal backend {hal_backend_name!r} is unavailable: {info.reason}", pytrace=False)

    def open_backend() -> hal.Backend:
        return hal.get_backend(hal_backend_name, **hal_options)

    problem = None
    try:
        open_backend().close()  # bad options fail here, clearly
    except hal.HalError as exc:
        problem = f"cannot open hal backend {hal_backend_name!r} with options {hal_options}: {exc}"
    if problem:
        pytest.fail(problem, pytrace=False)
    return open_backend


@pytest.fixture
def hal_backend(hal_backend_factory: Callable[[], hal.Backend]) -> Iterator[hal.Backend]:
    """A fresh backend; closed afterwards, and nothing may be live after ``close()``."""
    be = hal_backend_factory()
    yield be
    be.close()
    assert be.live.zero, f"{be.name}: still live after close(): {be.live}"


@pytest.fixture
def hal_requirements(hal_backend: hal.Backend, hal_requirement_overrides: dict[str, Any]) -> Requirements:
    """What the backend under test claims, with command-line overrides applied."""
    return Requirements.for_plugin(hal_backend.plugin, hal_requirement_overrides)


@pytest.fixture
def hal_memory(hal_backend: hal.Backend, hal_requirements: Requirements) -> MemoryAccess:
    """Reads and writes mapped bytes (ctypes or torch); skips with the reason when neither works."""
    access, reason = memory_access(hal_backend, hal_requirements)
    if access is None:
        pytest.skip(reason)
    return access
