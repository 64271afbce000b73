"""The library's shape stays readable: no graphkit class over 300 lines, no function over 60 (the bench's
measurements aside); the bench and the command line live outside the library, in graphkit_bench."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: the package of the bench and the command line, beside the library
BENCH = "graphkit_bench"
#: its modules held to the library's limits all the same: the command line and its entry point
BENCH_CLI = ("cli.py", "__main__.py")


def _exempt(where: str) -> bool:
    """A definition of the bench's measurements, which may run long (the command line may not)."""
    path = Path(where.partition(":")[0])
    return path.parts[0] == BENCH and path.name not in BENCH_CLI


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


@pytest.mark.parametrize("package", ["hal", "graphkit", BENCH])
def test_no_function_is_over_60_lines_outside_the_bench(package: str) -> None:
    long = [f"{where} ({n} lines)" for where, node, n in _definitions(package)
            if not isinstance(node, ast.ClassDef) and n > 60 and not _exempt(where)]
    assert not long, long


def _imported(path: Path) -> set[str]:
    """The top-level packages a module imports."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.partition(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.partition(".")[0])
    return names


def test_the_library_holds_no_bench_and_no_command_line() -> None:
    """graphkit is the library alone: no bench modules, no argument parsing, and ``python -m graphkit`` a short
    launcher, the one module that imports the bench."""
    assert not list((ROOT / "graphkit" / "bench").glob("*.py"))
    modules = {p.relative_to(ROOT).as_posix(): _imported(p) for p in sorted((ROOT / "graphkit").rglob("*.py"))}
    assert not [m for m, names in modules.items() if "argparse" in names]
    assert [m for m, names in modules.items() if BENCH in names] == ["graphkit/__main__.py"]
    assert len((ROOT / "graphkit" / "__main__.py").read_text().splitlines()) <= 40
