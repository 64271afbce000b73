"""GRAPHKIT_GRAPH_MEMORY: its value and the engines' plugin entry points."""

from __future__ import annotations

import importlib.metadata
import logging
import re
from collections.abc import Iterator

import pytest

import hal
from graphkit import switch
from graphkit.switch import ENV, Options

# -- the value ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [None, "", "  ", "0", "off", "No", " false "])
def test_values_that_leave_the_switch_off(value: str | None) -> None:
    assert switch.parse(value) is None


@pytest.mark.parametrize(("value", "options"), [
    ("1", Options()), ("on", Options()), ("TRUE", Options()), ("yes", Options()),
    ("kind=shared,verify=0", Options(kind="shared", verify=False)),
    (" report=0 , hygiene=on ", Options(report=0.0, hygiene=True)),
    ("kind=private,", Options(kind="private")),
    ("report=2.5", Options(report=2.5)),
])
def test_values_that_turn_it_on(value: str, options: Options) -> None:
    assert switch.parse(value) == options


@pytest.mark.parametrize(("value", "named"), [
    ("2", "'2'"), ("bogus", "'bogus'"), ("kind=bogus", "'kind=bogus'"), ("verify=2", "'verify=2'"),
    ("hygiene=", "'hygiene='"), ("report=-1", "'report=-1'"), ("report=nan", "'report=nan'"),
    ("report=inf", "'report=inf'"), ("report=soon", "'report=soon'"), ("1,kind=shared", "'1'"),
    ("=1", "'=1'"), ("kind=vmm,kind=shared", "'kind=shared' is given twice"),
])
def test_bad_values_are_refused_naming_the_variable_and_the_option(value: str, named: str) -> None:
    with pytest.raises(hal.InvalidArgumentError, match=re.escape(named)) as caught:
        switch.parse(value)
    assert caught.value.call == ENV
    assert str(caught.value).startswith(f"{ENV}: ") and str(caught.value).count(ENV) == 1


# -- the engines' plugin entry points -------------------------------------------------------------------------


@pytest.fixture
def switch_reset() -> Iterator[None]:
    """The process's switch is off before and after the test, and a bad value has not been reported yet."""
    assert switch.active() is None
    yield
    switch.stop()
    switch._reported = False


@pytest.mark.parametrize("group", ["vllm.general_plugins", "sglang.srt.plugins"])
def test_the_package_declares_the_engines_plugin_entry_points(group: str) -> None:
    found = [ep for ep in importlib.metadata.entry_points(group=group) if ep.name == "graphkit"]
    assert found, f"no 'graphkit' entry point in {group}: reinstall the package (pip install -e .)"
    assert found[0].load() is switch.plugin


def test_the_plugin_does_nothing_while_the_variable_is_unset(monkeypatch, switch_reset) -> None:
    monkeypatch.delenv(ENV, raising=False)
    switch.plugin()
    assert switch.active() is None


def test_the_plugin_starts_the_switch_once_however_often_it_is_called(monkeypatch, switch_reset) -> None:
    monkeypatch.setenv(ENV, "kind=shared,report=0")
    switch.plugin()
    scope = switch.active()
    assert scope is not None and scope.options == Options(kind="shared", report=0.0)
    switch.plugin()
    assert switch.active() is scope


def test_the_plugin_reports_a_bad_value_once_and_never_raises(monkeypatch, caplog, switch_reset) -> None:
    monkeypatch.setenv(ENV, "kind=bogus")
    with caplog.at_level(logging.WARNING, logger="graphkit.switch"):
        switch.plugin()
        switch.plugin()
    assert switch.active() is None
    warnings = [r.getMessage() for r in caplog.records if r.name == "graphkit.switch"]
    assert len(warnings) == 1, warnings
    assert "'kind=bogus' is not an option" in warnings[0] and "stays off" in warnings[0]
    assert warnings[0].count(ENV) == 1
