"""The documentation's links lead somewhere, and its claims that can be checked on a CPU hold."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.paths import ROOT

DOCS = sorted([ROOT / "README.md", ROOT / "BENCHMARKS.md", ROOT / "CHANGELOG.md", *(ROOT / "docs").rglob("*.md")])
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"```.*?```", re.S)


def anchors(path: Path) -> set[str]:
    """The heading anchors of a markdown file, as GitHub makes them (lower case, punctuation dropped, spaces to
    hyphens, a counter for repeats)."""
    seen: dict[str, int] = {}
    out = set()
    for line in _FENCE.sub("", path.read_text()).splitlines():
        m = re.match(r"#{1,6}\s+(.*)", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower().replace("`", "")).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_exists(doc: Path) -> None:
    broken = []
    for target in _LINK.findall(_FENCE.sub("", doc.read_text())):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading makes #{anchor}")
    assert not broken, broken


def test_the_benchmarks_page_keeps_its_history_apart_and_names_a_machine_per_section() -> None:
    text = (ROOT / "BENCHMARKS.md").read_text()
    assert "(docs/bench/history.md)" in text
    sections = re.split(r"\n## ", text)[1:]
    for section in sections:
        title = section.splitlines()[0]
        if title.startswith(("What each strategy", "JSON schema", "Machines", "Targets of")):
            continue
        assert re.search(r"H200|H100|CPU", section), f"section {title!r} names no machine"
