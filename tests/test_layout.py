"""The library's shape stays readable, checked by what matters rather than by how long a class is: no function
over 60 lines (the bench's measurements aside), a private module imported only inside the package that holds it,
each module's private names its own (no reach-ins), no floor importing from the floors above it, no import cycle
in graphkit, the key table's lock taken in its module alone, and the bench and the command line outside the
library, in graphkit_bench. Which module owns which record is checked in ``test_layout_owners.py``."""

from __future__ import annotations

import ast
import importlib.metadata
from pathlib import Path

import pytest

from tests.paths import ROOT

PACKAGES = ("hal", "graphkit")
#: the package of the bench and the command line, beside the library
BENCH = "graphkit_bench"
#: its modules held to the library's limits all the same: the command line and its entry point
BENCH_CLI = ("cli.py", "__main__.py")


def _exempt(where: str) -> bool:
    """A definition of the bench's measurements, which may run long (the command line may not)."""
    path = Path(where.partition(":")[0])
    return path.parts[0] == BENCH and path.name not in BENCH_CLI


def _functions(package: str) -> list[tuple[str, int]]:
    """``(where, lines)`` of every function and method of ``package``."""
    found = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                found.append((f"{path.relative_to(ROOT)}:{node.lineno} {node.name}", lines))
    return found


@pytest.mark.parametrize("package", [*PACKAGES, BENCH])
def test_no_function_is_over_60_lines_outside_the_bench(package: str) -> None:
    long = [f"{where} ({n} lines)" for where, n in _functions(package) if n > 60 and not _exempt(where)]
    assert not long, long


# -- private modules ---------------------------------------------------------------------------------------


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
    base = ROOT.joinpath(*name.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def _owner(module: str) -> str | None:
    """The package a private module is private to (the one holding its first ``_name`` part); None: public."""
    parts = module.split(".")
    for i, part in enumerate(parts):
        if part.startswith("_") and not part.startswith("__"):
            return ".".join(parts[:i])
    return None


def _imported(path: Path, module: str, tree: ast.AST | None = None) -> list[tuple[int, str]]:
    """``(line, module)`` of every module of hal or graphkit that ``path`` imports, anywhere in it (in ``tree``:
    a part of it)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree if tree is not None else ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names
                      if _is_module(f"{base}.{alias.name}")]
    return [(line, name) for line, name in found if name.split(".")[0] in PACKAGES]


def _private_imports(package: str) -> list[str]:
    wrong = []
    for path in sorted((ROOT / package).rglob("*.py")):
        module = _module_name(path)
        if _owner(module) is not None:
            continue  # a private module may use what its own package keeps private
        for line, name in _imported(path, module):
            owner = _owner(name)
            if owner is not None and not module.startswith(f"{owner}."):
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports {name} (private to {owner})")
    return wrong


@pytest.mark.parametrize("package", PACKAGES)
def test_no_public_module_imports_a_private_module_of_another_package(package: str) -> None:
    """A module is private when a part of its dotted name starts with ``_``; it is private to the package
    that holds that part (``hal.backends._native.hooks`` to ``hal.backends``, ``graphkit.graphs._x`` to
    ``graphkit``). A public module of hal or graphkit imports a private module only from inside the package it
    is private to: ``hal.backends.cuda.backend`` may import ``hal.backends._native.hooks``, while
    ``hal.host.graphs`` may not, nor any graphkit module a private module of hal (nor hal one of graphkit)."""
    wrong = _private_imports(package)
    assert not wrong, wrong


def _top_level_imports(path: Path) -> set[str]:
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
    launcher of the command line the bench registers; no module of graphkit imports the bench."""
    assert not list((ROOT / "graphkit" / "bench").glob("*.py"))
    modules = {p.relative_to(ROOT).as_posix(): _top_level_imports(p) for p in sorted((ROOT / "graphkit").rglob("*.py"))}
    assert not [m for m, names in modules.items() if "argparse" in names]
    assert not [m for m, names in modules.items() if BENCH in names]
    assert len((ROOT / "graphkit" / "__main__.py").read_text().splitlines()) <= 40


def test_python_m_graphkit_runs_the_command_line_registered_for_it() -> None:
    """The bench registers its command line under ``graphkit.commands`` (pyproject.toml); the launcher takes the
    one named ``bench``, and the bench's own registration where the installed metadata predates the group."""
    from graphkit.__main__ import GROUP, REGISTERED, command
    from graphkit_bench.cli import main

    here = importlib.metadata.EntryPoint(name="bench", value=f"{__name__}:_a_command_line", group=GROUP)
    other = importlib.metadata.EntryPoint(name="other", value="graphkit_nothing:main", group=GROUP)
    assert command([other, here]) is _a_command_line
    assert command([]) is main
    declared = (ROOT / "pyproject.toml").read_text().partition(f'[project.entry-points."{GROUP}"]')[2]
    assert declared.strip().splitlines()[0] == f'{REGISTERED.name} = "{REGISTERED.value}"'


def _a_command_line(argv: list[str] | None) -> int:
    return len(argv or ())


def test_python_m_graphkit_reads_the_installed_entry_points(monkeypatch: pytest.MonkeyPatch) -> None:
    import graphkit.__main__ as launcher

    here = importlib.metadata.EntryPoint(name="bench", value=f"{__name__}:_a_command_line", group=launcher.GROUP)
    asked = []

    def entry_points(group: str) -> list[importlib.metadata.EntryPoint]:
        asked.append(group)
        return [here]

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)
    assert launcher.main(["demo", "--help"]) == 2 and asked == [launcher.GROUP]


# -- ownership: private names stay with the module that defines them ----------------------------------------

#: the packages whose private names are checked, the bench's included
OWNED = (*PACKAGES, BENCH)


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _own_private_names(tree: ast.AST) -> set[str]:
    """The private names a module defines: its functions, classes and globals, and what ``self``/``cls`` set."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and isinstance(node.value, ast.Name)
              and node.value.id in ("self", "cls")):
            names.add(node.attr)
    return {name for name in names if _private(name)}


def _foreign_private_uses(sources: dict[str, str]) -> list[str]:
    """``obj._name`` reads and writes, ``obj`` not ``self`` or ``cls``, of a private name another module of
    ``sources`` (path -> text) defines and the module itself does not. A private name of a third party
    (``torch._C``, ``sys._getframe``) is not the project's to keep: it is left to the registry of them."""
    trees = {path: ast.parse(text, path) for path, text in sources.items()}
    own = {path: _own_private_names(tree) for path, tree in trees.items()}
    everyone = set().union(*own.values()) if own else set()
    found = []
    for path, tree in trees.items():
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and _private(node.attr)):
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            if node.attr in everyone and node.attr not in own[path]:
                found.append(f"{path}:{node.lineno} {ast.unparse(node)}")
    return found


def test_no_module_reads_or_writes_another_modules_private_names() -> None:
    """A class's private fields are written and read by the module that holds it alone; others use its public
    methods and read-only properties (``pools.own_backend()``, not ``pools._owns_backend = True``)."""
    sources = {str(p.relative_to(ROOT)): p.read_text()
               for package in OWNED for p in sorted((ROOT / package).rglob("*.py"))}
    wrong = _foreign_private_uses(sources)
    assert not wrong, wrong


def test_the_private_name_check_finds_a_reach_in_and_lets_a_module_use_its_own() -> None:
    owner = "class Pools:\n    def __init__(self):\n        self._owns = False\n        self._count = 0\n"
    user = "def start(pools):\n    pools._owns = True\n    return pools._count, pools.public, torch._C\n"
    same = "def close(pools):\n    pools._count = 0\n"
    sources = {"owner.py": owner + same, "user.py": user}
    assert _foreign_private_uses(sources) == ["user.py:2 pools._owns", "user.py:3 pools._count"]


FLOORS = ("graphkit.memory", "graphkit.saver", "graphkit.graphs")


def test_a_floor_imports_nothing_from_the_floors_above_it() -> None:
    """The memory floor knows nothing of savers or graphs, the saver floor nothing of graphs, and no floor the
    public face (``graphkit``, ``graphkit.switch``)."""
    wrong = []
    for level, floor in enumerate(FLOORS):
        above = (*FLOORS[level + 1:], "graphkit.switch")
        for path in sorted((ROOT / "graphkit" / floor.split(".")[1]).rglob("*.py")):
            for line, name in _imported(path, _module_name(path)):
                if name == "graphkit" or any(name == a or name.startswith(f"{a}.") for a in above):
                    wrong.append(f"{path.relative_to(ROOT)}:{line} imports {name}")
    assert not wrong, wrong


def test_every_logger_of_graphkit_is_named_for_its_module() -> None:
    """``logging.getLogger(__name__)``: a record's name says which module logged it, and a package's loggers are
    one subtree (``graphkit.graphs``) to turn up or down."""
    wrong = []
    for path in sorted((ROOT / "graphkit").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "getLogger"
                    and not (len(node.args) == 1 and isinstance(node.args[0], ast.Name)
                             and node.args[0].id == "__name__")):
                wrong.append(f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(node)}")
    assert not wrong, wrong


# -- imports: no cycle, and the key table's lock kept by the key table ------------------------------------------


def _module_level(tree: ast.Module) -> list[ast.stmt]:
    """The statements a module runs when imported (``if``/``try`` blocks included, ``TYPE_CHECKING`` ones too;
    the bodies of functions and classes not)."""
    found, todo = [], list(tree.body)
    while todo:
        node = todo.pop()
        found.append(node)
        if isinstance(node, (ast.If, ast.Try)):
            todo += [*node.body, *node.orelse, *getattr(node, "finalbody", []),
                     *(s for handler in getattr(node, "handlers", []) for s in handler.body)]
    return found


def _import_graph(package: str) -> dict[str, set[str]]:
    """Module -> the modules of ``package`` it imports at module level."""
    graph: dict[str, set[str]] = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        module = _module_name(path)
        names = set()
        for node in _module_level(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names.update(name for _, name in _imported(path, module, node))
        graph[module] = {name for name in names if name.split(".")[0] == package and _is_module(name)
                         and name != module}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected group of modules that import each other (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for other in sorted(graph.get(module, ())):
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == module:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return groups


def test_no_two_modules_of_graphkit_import_each_other() -> None:
    """The modules of graphkit, with the imports they run when imported (``TYPE_CHECKING`` blocks included),
    form no cycle: each module can be read knowing only those it imports."""
    assert not _cycles(_import_graph("graphkit"))


def test_the_cycle_check_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert not _cycles({"a": {"b"}, "b": set(), "c": {"a", "b"}})
#: the key table's lock, which only the table takes (its verbs are whole steps)
KEY_TABLE = "graphkit/graphs/keys.py"


def _locks_taken(path: Path) -> list[str]:
    """``x.lock`` / ``x._lock`` of an object other than the module's own ``self``/``cls``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if (isinstance(node, ast.Attribute) and node.attr in ("lock", "_lock")
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(node)}")
    return found


def test_the_key_tables_lock_is_taken_in_keys_py_alone() -> None:
    """GraphPools, the routing, the verifier, the scope, the runner and the switch call the key table's verbs;
    none of them takes its lock."""
    users = [*sorted((ROOT / "graphkit" / "graphs").rglob("*.py")), ROOT / "graphkit" / "switch.py"]
    wrong = [use for path in users if path.relative_to(ROOT).as_posix() != KEY_TABLE for use in _locks_taken(path)]
    assert not wrong, wrong


def test_what_a_capture_left_gets_bytes_of_its_own_in_one_place() -> None:
    """The key table's promotion (``capture_ended``) has one caller, whatever ended: a routed capture, a group, or
    an owner's captures."""
    calls = [f"{path.relative_to(ROOT)}:{node.lineno}" for path in sorted((ROOT / "graphkit").rglob("*.py"))
             for node in ast.walk(ast.parse(path.read_text(), str(path)))
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
             and node.func.attr == "capture_ended"]
    assert len(calls) == 1, calls
