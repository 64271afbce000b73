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


def test_the_engine_guides_three_options_state_the_defaults() -> None:
    """docs/engines.md's five-minute table gives each option's default; the code has those defaults on every
    path (GraphPools, graph_memory, the switch)."""
    import inspect

    import graphkit
    import graphkit.switch

    text = (ROOT / "docs" / "engines.md").read_text()
    table = text[text.index("## Five minutes"):text.index("## The two ways in")]
    for name in ("outputs", "executables", "verify"):
        default = inspect.signature(graphkit.GraphPools.__init__).parameters[name].default
        assert inspect.signature(graphkit.graph_memory).parameters[name].default == default
        assert getattr(graphkit.switch.Options(), name) == default
        shown = f'"{default}"' if isinstance(default, str) else str(default)
        assert f"| `{name}` | `{shown}` |" in table, (name, default)


def test_every_switch_value_the_docs_show_is_accepted() -> None:
    import graphkit.switch

    values = set()
    for doc in (ROOT / "README.md", *(ROOT / "docs").glob("*.md")):
        for value in re.findall(r"GRAPHKIT_GRAPH_MEMORY=([\w=,|.<>]+)", doc.read_text()):
            value = value.rstrip(".,")
            if not re.search(r"[|<>]|SECONDS", value):  # option syntax (`kind=vmm|shared`), not a value
                values.add(value)
    assert {"1", "outputs=replay,executables=4,verify=1", "executables=off"} <= values, values
    for value in values:
        graphkit.switch.parse(value)  # raises hal.InvalidArgumentError for a value the switch refuses
