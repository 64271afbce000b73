"""The library's shape stays readable: no graphkit class over 300 lines, no function over 60 (the bench aside)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _definitions(package: str) -> list[tuple[str, ast.AST, int]]:
    found = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                found.append((f"{path.relative_to(ROOT)}:{node.lineno} {node.name}", node, lines))
    return found


def test_no_graphkit_class_is_over_300_lines() -> None:
    big = [f"{where} ({n} lines)" for where, node, n in _definitions("graphkit")
           if isinstance(node, ast.ClassDef) and n > 300]
    assert not big, big


@pytest.mark.parametrize("package", ["hal", "graphkit"])
def test_no_function_is_over_60_lines_outside_the_bench(package: str) -> None:
    long = [f"{where} ({n} lines)" for where, node, n in _definitions(package)
            if not isinstance(node, ast.ClassDef) and n > 60 and "/bench/" not in where]
    assert not long, long
