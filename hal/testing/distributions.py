"""Throwaway installed distributions, for testing how hal discovers backend plugins.

:func:`write_distribution` lays out modules and a minimal ``*.dist-info`` (with
``entry_points.txt``) in a directory; :func:`importable` puts such a directory
on ``sys.path`` and makes hal discover again, undoing both afterwards.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

import hal


def write_distribution(root: Path, name: str, version: str, modules: Mapping[str, str],
                       entry_points: Mapping[str, Mapping[str, str]]) -> Path:
    """Write ``modules`` (``{"pkg_mod": source}``) and ``name-version.dist-info`` under ``root``."""
    root.mkdir(parents=True, exist_ok=True)
    for module, source in modules.items():
        (root / f"{module}.py").write_text(source)
    info = root / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    sections = [f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items())
                for group, eps in entry_points.items()]
    (info / "entry_points.txt").write_text("\n".join(sections))
    return root


@contextlib.contextmanager
def importable(root: Path) -> Iterator[Path]:
    """``root`` is on ``sys.path`` and hal's backends are re-discovered, inside the block only.

    Modules of the same top-level names imported before (the same plugin
    installed for real, say) are set aside for the block, so imports inside
    it find ``root``'s copies; they are put back afterwards.
    """
    path = str(root)
    provided = {p.stem for p in root.glob("*.py")} | {p.name for p in root.iterdir() if (p / "__init__.py").is_file()}
    shadowed = {name: module for name, module in sys.modules.items() if name.partition(".")[0] in provided}
    for name in shadowed:
        del sys.modules[name]
    before = set(sys.modules)
    sys.path.insert(0, path)
    importlib.invalidate_caches()
    hal.list_backends(refresh=True)
    try:
        yield root
    finally:
        sys.path.remove(path)
        for name in set(sys.modules) - before:
            module_file = getattr(sys.modules[name], "__file__", None) or ""
            if module_file.startswith(path):
                del sys.modules[name]
        sys.modules.update(shadowed)
        importlib.invalidate_caches()
        hal.list_backends(refresh=True)
