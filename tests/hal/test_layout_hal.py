"""hal's capture corridor has one owner, and hal writes its undo once: one module is named for routing, and a
catch-all ``except BaseException`` is either the undo stack's own or says on its line why it is not an undo."""

from __future__ import annotations

import io
import itertools
import tokenize
from pathlib import Path

from tests.paths import ROOT

HAL = ROOT / "hal"
#: the one module allowed to catch everything for an undo: the undo stack itself
UNDO_STACK = HAL / "transaction.py"
#: what a catch-all that is not an undo says on its line
NOT_AN_UNDO = "# not an undo"


def _modules(package: Path) -> list[Path]:
    return sorted(p for p in package.rglob("*.py") if "__pycache__" not in p.parts)


def _catch_alls(path: Path) -> list[tuple[int, str]]:
    """``(line, comments)`` of every ``except BaseException`` clause of ``path`` (the comments on its line)."""
    tokens = list(tokenize.generate_tokens(io.StringIO(path.read_text()).readline))
    comments: dict[int, list[str]] = {}
    for token in tokens:
        if token.type == tokenize.COMMENT:
            comments.setdefault(token.start[0], []).append(token.string)
    return [(token.start[0], " ".join(comments.get(token.start[0], ())))
            for token, following in itertools.pairwise(tokens)
            if token.type == tokenize.NAME and token.string == "except" and following.string == "BaseException"]


def _unexplained_catch_alls(package: Path, root: Path = ROOT) -> list[str]:
    """``path:line`` (relative to ``root``) of every catch-all of ``package`` outside the undo stack that does
    not say it is not an undo."""
    return [f"{path.relative_to(root).as_posix()}:{line}" for path in _modules(package) if path != UNDO_STACK
            for line, comment in _catch_alls(path) if NOT_AN_UNDO not in comment]


def test_exactly_one_module_of_hal_is_named_for_routing() -> None:
    """Patching a framework's graph class, the device's routers then the process's, a graph's release: all in
    ``hal/routing.py``."""
    named = [p.relative_to(ROOT).as_posix() for p in sorted(HAL.rglob("*routing*")) if "__pycache__" not in p.parts]
    assert named == ["hal/routing.py"], named


def test_every_catch_all_in_hal_is_the_undo_stack_or_says_it_is_not_an_undo() -> None:
    """An undo is a :class:`hal.Transaction`; a catch-all that translates, logs or keeps an error says so on its
    line (``# not an undo: ...``)."""
    wrong = _unexplained_catch_alls(HAL)
    assert not wrong, wrong


def test_the_catch_all_check_finds_an_unexplained_one_and_passes_an_explained_one(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "undo.py").write_text("try:\n    step()\nexcept BaseException:\n    undo()\n    raise\n")
    (package / "kept.py").write_text("try:\n    step()\nexcept BaseException as exc:  # not an undo: kept\n"
                                     "    keep(exc)\n")
    (package / "narrow.py").write_text("try:\n    step()\nexcept Exception:\n    undo()\n    raise\n")
    assert _unexplained_catch_alls(package, tmp_path) == ["pkg/undo.py:3"]
