"""Records with one owner: the key table of a GraphPools (and its entries) and a virtual space are written by
their own verbs alone. No other module of the library touches their private fields, and the public names
that show their state are read-only properties."""

from __future__ import annotations

import ast

import pytest

import hal
from graphkit.graphs.keys import KeyPool, PoolKeys
from graphkit.memory.ranges import Arena, VirtualSpace
from tests.paths import ROOT

#: module -> the classes whose private fields it alone touches
OWNERS = {
    "graphkit/graphs/keys.py": ("PoolKeys", "KeyPool"),
    "graphkit/memory/ranges.py": ("VirtualSpace",),
}

#: the public face of their state: read-only properties
READ_ONLY = [
    (PoolKeys, ("entries", "lock", "closed")),
    (KeyPool, ("graphs",)),
    (VirtualSpace, ("size", "offset", "live_allocations", "dying", "sealed", "places", "mapped", "holes")),
]


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _fields(tree: ast.AST, classes: tuple[str, ...]) -> set[str]:
    """The private fields ``classes`` of ``tree`` hold: what their methods set on ``self`` and what their bodies
    declare (dataclass fields)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if not (isinstance(node, ast.ClassDef) and node.name in classes):
            continue
        for item in node.body:
            if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                names.add(item.target.id)
        for inner in ast.walk(node):
            if (isinstance(inner, ast.Attribute) and isinstance(inner.ctx, ast.Store)
                    and isinstance(inner.value, ast.Name) and inner.value.id == "self"):
                names.add(inner.attr)
    return {name for name in names if _private(name)}


def _reach_ins(sources: dict[str, str], owners: dict[str, tuple[str, ...]]) -> list[str]:
    """``obj._field`` (read, write or delete; ``obj`` not ``self``) in a module of ``sources`` other than the
    owner, of a private field of an owned class. Unlike the general check of private names, a module that
    has a field of the same name of its own is no excuse."""
    trees = {path: ast.parse(text, path) for path, text in sources.items()}
    owned = {path: _fields(trees[path], classes) for path, classes in owners.items() if path in trees}
    found = []
    for path, tree in trees.items():
        foreign = set().union(*(fields for owner, fields in owned.items() if owner != path))
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr in foreign
                    and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
                found.append(f"{path}:{node.lineno} {ast.unparse(node)}")
    return found


def test_only_the_owner_module_touches_the_key_table_and_space_fields() -> None:
    sources = {str(p.relative_to(ROOT)): p.read_text() for p in sorted((ROOT / "graphkit").rglob("*.py"))}
    assert set(OWNERS) <= set(sources)
    wrong = _reach_ins(sources, OWNERS)
    assert not wrong, wrong


def test_the_owners_have_the_fields_the_check_looks_for() -> None:
    """The check would pass vacuously if the owners' fields were not found: they are."""
    trees = {path: ast.parse((ROOT / path).read_text(), path) for path in OWNERS}
    assert {"_entries", "_lock", "_closed", "_dead", "_graphs", "_shared", "_survivors"} <= _fields(
        trees["graphkit/graphs/keys.py"], OWNERS["graphkit/graphs/keys.py"])
    assert {"_offset", "_live", "_places", "_size", "_sealed", "_dying"} <= _fields(
        trees["graphkit/memory/ranges.py"], OWNERS["graphkit/memory/ranges.py"])


def test_the_check_finds_a_write_from_another_module_even_of_a_name_it_has_itself() -> None:
    owner = ("class Space:\n    def __init__(self):\n        self._offset = 0\n"
             "    def allocate(self, n):\n        self._offset += n\n"
             "def reset(space):\n    space._offset = 0\n")
    user = ("class Chunks:\n    def __init__(self):\n        self._offset = 1\n"
            "def grow(space, n):\n    space._offset += n\n    return space.offset, space._other\n")
    sources = {"owner.py": owner, "user.py": user}
    assert _reach_ins(sources, {"owner.py": ("Space",)}) == ["user.py:5 space._offset"]


@pytest.mark.parametrize(("cls", "names"), READ_ONLY, ids=lambda v: getattr(v, "__name__", "names"))
def test_the_state_an_owner_shows_is_read_only(cls: type, names: tuple[str, ...]) -> None:
    writable = [n for n in names if not isinstance(getattr(cls, n, None), property) or getattr(cls, n).fset]
    assert not writable, f"{cls.__name__}: {writable}"


def test_a_space_is_written_through_its_verbs(be: hal.Backend) -> None:
    """The bump pointer and the live count move only by allocate and free; what it shows cannot be changed."""
    space = VirtualSpace(1, 0x10000, 0x1000, Arena(0x10000, 0x1000))
    reached: list[int] = []
    assert space.allocate(100, 256, be, reached.append) == 0x10000
    assert space.allocate(10, 256, be, reached.append) == 0x10100
    assert (space.offset, space.live_allocations, reached) == (0x10A, 2, [100, 0x10A])
    space.free()
    assert space.live_allocations == 1 and not space.mark_dying() and space.dying
    with pytest.raises(AttributeError):
        space.offset = 0  # type: ignore[misc]
    with pytest.raises(AttributeError):
        space.places.append(None)  # type: ignore[attr-defined]
