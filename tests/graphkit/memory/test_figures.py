"""graphkit.memory.figures: every figure names a field its owner annotates and a public figure of that part."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import typing

import pytest

import graphkit
from graphkit.memory.figures import figure


def _figures() -> list[tuple[type, str, figure]]:
    found = []
    for info in pkgutil.walk_packages(graphkit.__path__, "graphkit."):
        module = importlib.import_module(info.name)
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ == module.__name__:
                found += [(cls, name, value) for name, value in vars(cls).items() if isinstance(value, figure)]
    return found


def test_every_figure_reads_a_public_figure_of_a_part_its_owner_annotates() -> None:
    figures = _figures()
    assert len(figures) >= 20  # the allocator's, the elastic ones, the backups', the chunks'
    wrong = []
    for owner, attr, fig in figures:
        hints = {}
        for klass in owner.__mro__:  # a part annotated by a base class (HostBacked's backup) counts
            if fig.part in getattr(klass, "__annotations__", {}):
                hints = typing.get_type_hints(klass)
                break
        part = hints.get(fig.part)
        if not isinstance(part, type) or (not hasattr(part, fig.name) and fig.name not in _instance_fields(part)):
            wrong.append(f"{owner.__qualname__}.{attr} = figure({fig.part!r}, {fig.name!r}): the part is {part!r}")
    assert not wrong, wrong


def _instance_fields(cls: type) -> set[str]:
    """The fields ``cls.__init__`` sets on ``self``."""
    source = inspect.getsource(cls.__init__)
    return {line.split("self.", 1)[1].split("=")[0].split(":")[0].strip()
            for line in source.splitlines() if line.strip().startswith("self.") and "=" in line}


@pytest.mark.parametrize("part, name", [("_chunks.backing", "paused"), ("_chunks", "_held"), ("_a", "b.c")])
def test_a_figure_is_one_field_and_one_public_name(part: str, name: str) -> None:
    with pytest.raises(ValueError, match="a field of the owner and a public name of that part"):
        figure(part, name, "doc")
