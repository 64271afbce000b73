"""The single-writer check the memory package's module tests share: a class's private fields are touched by its
own module alone (``obj._field`` elsewhere is a reach-in, even where that module has a field of the same name)."""

from __future__ import annotations

import ast

from tests.paths import ROOT


def private_fields(path: str, cls: str) -> set[str]:
    """The private fields class ``cls`` of ``path`` sets on ``self``."""
    tree = ast.parse((ROOT / path).read_text(), path)
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for inner in ast.walk(node):
                if (isinstance(inner, ast.Attribute) and isinstance(inner.ctx, ast.Store)
                        and isinstance(inner.value, ast.Name) and inner.value.id == "self"
                        and inner.attr.startswith("_") and not inner.attr.startswith("__")):
                    names.add(inner.attr)
    return names


def reach_ins(path: str, cls: str, sources: dict[str, str] | None = None) -> list[str]:
    """``obj._field`` (``obj`` not ``self``) of a private field of ``cls`` in a module of ``sources`` (default:
    every module of graphkit) other than ``path`` that names ``cls`` (one that can hold one: it imports it, or
    types with it)."""
    fields = private_fields(path, cls)
    assert fields, f"{path}: {cls} has no private fields: the check would pass vacuously"
    if sources is None:
        sources = {str(p.relative_to(ROOT)): p.read_text() for p in sorted((ROOT / "graphkit").rglob("*.py"))}
    found = []
    for where, text in sources.items():
        if where == path or cls not in text:
            continue
        for node in ast.walk(ast.parse(text, where)):
            if (isinstance(node, ast.Attribute) and node.attr in fields
                    and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
                found.append(f"{where}:{node.lineno} {ast.unparse(node)}")
    return found
