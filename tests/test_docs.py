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


# -- the plugin guide ----------------------------------------------------------------------------------------------

MORE = '''
"""A host device that declares more than the host recorder gives, as docs/plugins.md shows."""

import hal
from hal.host import HostGraphs, vm
from hal.types import MemInfo


class MoreBackend(HostGraphs):
    hal_priority = 3000

    def __init__(self, device=0, *, granularity=64 << 10):
        self.g = granularity
        self.init_host_graphs("more", alloc=lambda n: vm.alloc(n, backend="more"),
                              free=lambda p, n: vm.free(p, n, backend="more"), segment_size=granularity)

    @classmethod
    def probe(cls):
        return vm.unavailable_reason()

    @hal.hookimpl
    def capabilities(self):
        return super().capabilities() | {"memory_sharing"}

    @hal.hookimpl
    def export_phy_mem_handle(self, handle):
        return vm.export_chunk(handle, backend="more")

    @hal.hookimpl
    def import_phy_mem_handle(self, fd, size):
        return vm.import_chunk(fd, size, backend="more")

    @hal.hookimpl
    def device_count(self):
        return 1

    @hal.hookimpl
    def granularity(self, recommended):
        return self.g

    @hal.hookimpl
    def mem_info(self):
        return MemInfo(free=1 << 30, total=1 << 30)

    @hal.hookimpl
    def create_vir_ptr(self, size):
        return vm.reserve(size, self.g, backend="more")

    @hal.hookimpl
    def release_vir_ptr(self, ptr, size):
        vm.release(ptr, size, backend="more")

    @hal.hookimpl
    def create_phy_mem_handle(self, size):
        return vm.create_chunk(size, backend="more")

    @hal.hookimpl
    def release_phy_mem_handle(self, handle):
        vm.release_chunk(handle, backend="more")

    @hal.hookimpl
    def map(self, ptr, size, handle):
        vm.map_chunk(ptr, size, handle, backend="more")

    @hal.hookimpl
    def unmap(self, ptr, size):
        vm.unmap_chunk(ptr, size, backend="more")
'''


def test_a_host_plugin_declares_more_than_the_host_recorder_with_super(tmp_path: Path) -> None:
    """docs/plugins.md §7: ``super().capabilities() | {...}``, marked again, adds a capability whose hooks the
    class has, through the ordinary entry-point load."""
    import hal
    from hal.host.graphs import CAPABILITIES
    from hal.testing.distributions import importable, write_distribution

    site = write_distribution(tmp_path / "site", "hal-more", "0.1", {"hal_more": MORE},
                              {"hal.backends": {"more": "hal_more:MoreBackend"}})
    with importable(site):
        info = {i.name: i for i in hal.list_backends()}["more"]
        assert info.available, info.reason
        with hal.get_backend("more") as be:
            assert be.capabilities == CAPABILITIES | {"memory_sharing"}
    guide = (ROOT / "docs" / "plugins.md").read_text()
    assert "return super().capabilities() | {\"memory_sharing\"}" in guide


def test_the_host_recorder_and_the_guide_list_the_same_capabilities() -> None:
    import hal.host
    import hal.host.graphs
    from hal.host.graphs import CAPABILITIES

    guide = (ROOT / "docs" / "plugins.md").read_text()
    said = guide[guide.index("That is all: the mixin implements"):guide.index("and declares them from its")]
    docstrings = {"hal.host.graphs": hal.host.graphs.__doc__ or "", "hal.host": hal.host.__doc__ or "",
                  "the guide": said}
    for where, text in docstrings.items():
        named = set(re.findall(r"`+\"?([a-z_]+)\"?`+", text)) & hal.CAPABILITIES
        assert named == CAPABILITIES, (where, sorted(named ^ CAPABILITIES))


def test_the_guide_says_what_the_suite_needs() -> None:
    guide = (ROOT / "docs" / "plugins.md").read_text()
    suite = guide[guide.index("## 10. The conformance suite"):]
    assert "pytest" in suite and "Hypothesis" in suite and 'pip install "hal-graphkit[test]"' in suite
    test_extra = re.search(r"^test = \[(.*)\]$", (ROOT / "pyproject.toml").read_text(), re.M)
    assert test_extra and "pytest" in test_extra.group(1) and "hypothesis" in test_extra.group(1)


# -- the README's statements ---------------------------------------------------------------------------------------


def test_the_readmes_driver_memory_command_takes_its_flags(tmp_path: Path) -> None:
    from graphkit_bench import drivermem

    text = (ROOT / "README.md").read_text()
    m = re.search(r"^python -m graphkit_bench\.graphmem sweep (.*)$", text, re.M)
    assert m, "the README gives no sweep command"
    args = drivermem.parser().parse_args([str(tmp_path) if a == "DIR" else a for a in m.group(1).split()])
    assert args.backend == "cuda" and args.parts == "nodes,variants,levers" and args.out_dir == tmp_path


def test_the_readmes_executables_paragraph_states_the_default() -> None:

    import graphkit
    from graphkit.graphs.executables import DEFAULT

    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Executables"):text.index("## Adopting it in an engine")]
    assert DEFAULT == "lazy" and 'By default (`executables="lazy"`)' in section
    assert graphkit.RunnerOptions().executables == DEFAULT
    assert "docs/executables.md" in section
