"""The value of GRAPHKIT_GRAPH_MEMORY (``graphkit.graphs.switch_value``): what leaves the switch off, what turns it
on and with which options, what is refused and how it is named, options made in code checked as the variable is,
and the value a ``graph_memory()`` block writes for its children read back as its options."""

from __future__ import annotations

import re
from typing import Any

import pytest

import _graphkit_startup
import graphkit
import hal
from graphkit import switch
from graphkit.switch import ENV, Options


@pytest.mark.parametrize("value", [None, "", "  ", "0", "off", "No", " false "])
def test_values_that_leave_the_switch_off(value: str | None) -> None:
    assert switch.parse(value) is None
    assert not _graphkit_startup.requested({} if value is None else {ENV: value})


@pytest.mark.parametrize(("value", "options"), [
    ("1", Options()), ("on", Options()), ("TRUE", Options()), ("yes", Options()),
    ("kind=shared,verify=0", Options(kind="shared", verify=False)),
    (" report=0 , hygiene=on ", Options(report=0.0, hygiene=True)),
    ("kind=private,", Options(kind="private")),
    ("report=2.5", Options(report=2.5)),
    ("1,kind=shared", Options(kind="shared")), ("yes,verify=1", Options(verify=True)),  # the word beside options
])
def test_values_that_turn_it_on(value: str, options: Options) -> None:
    assert switch.parse(value) == options
    assert _graphkit_startup.requested({ENV: value})


@pytest.mark.parametrize(("value", "named"), [
    ("2", "'2'"), ("bogus", "'bogus'"), ("kind=bogus", "'kind=bogus'"), ("verify=2", "'verify=2'"),
    ("hygiene=", "'hygiene='"), ("report=-1", "'report=-1'"), ("report=nan", "'report=nan'"),
    ("report=inf", "'report=inf'"), ("report=soon", "'report=soon'"), ("2,kind=shared", "'2'"),
    ("report=1e10", "'report=1e10'"),  # past what threading.Timer waits: every capture's timer thread would die
    ("=1", "'=1'"), ("kind=vmm,kind=shared", "'kind=shared' is given twice"),
])
def test_bad_values_are_refused_naming_the_variable_and_the_option(value: str, named: str) -> None:
    with pytest.raises(hal.InvalidArgumentError, match=re.escape(named)) as caught:
        switch.parse(value)
    assert caught.value.call == ENV
    assert str(caught.value).startswith(f"{ENV}: ") and str(caught.value).count(ENV) == 1
    assert _graphkit_startup.requested({ENV: value})  # the hook still waits for torch: the switch reports it


@pytest.mark.parametrize(("fields", "named"), [
    ({"report": 1e10}, "report=10000000000.0 must be seconds >= 0"), ({"report": -1}, "report=-1"),
    ({"kind": "bogus"}, "kind='bogus' must be one of"), ({"verify": "yes"}, "verify='yes' must be a bool"),
])
def test_options_made_in_code_are_checked_as_the_variable_is(fields: dict[str, Any], named: str) -> None:
    with pytest.raises(hal.InvalidArgumentError, match=named):
        Options(**fields)


@pytest.mark.parametrize("options", [Options(), Options(kind="shared", outputs="replay", verify=True, hygiene=True,
                                                             executables=3),
                                     Options(kind="private", executables=None)])
def test_the_value_a_block_writes_for_its_children_reads_back_as_its_options(options: Options) -> None:
    from graphkit.graphs.switch_value import written

    value = written(options.kind, options.outputs, options.verify, options.hygiene, options.executables)
    assert switch.parse(value) == options
    assert switch.parse is graphkit.graphs.switch_value.parse and switch.Options is graphkit.graphs.switch_value.Options
