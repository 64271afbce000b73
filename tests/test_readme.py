"""CI runs exactly the README's test command."""

from __future__ import annotations

import re

from tests.paths import ROOT


def readme_test_commands() -> list[str]:
    """The lines of the fenced bash block that follows "Run the tests:" in the README."""
    text = (ROOT / "README.md").read_text()
    m = re.search(r"Run the tests:\s*\n+```bash\n(.*?)\n```", text, re.S)
    assert m, 'README.md has no ```bash block right after "Run the tests:"'
    return [line for line in m.group(1).splitlines() if line.strip()]


def test_ci_runs_the_readme_test_command() -> None:
    commands = readme_test_commands()
    assert commands, "the README's test block is empty"
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
                if line.strip() and not line.lstrip().startswith("#")]
    for command in commands:
        assert any(line.startswith(command) for line in ci_lines), (
            f"the README's test command {command!r} is not run verbatim by .ci/run")


def _snippet_after(marker: str) -> str:
    text = (ROOT / "README.md").read_text()
    m = re.search(re.escape(marker) + r".*?```python\n(.*?)\n```", text, re.S)
    assert m, f"README.md has no python block after {marker!r}"
    return m.group(1)


def test_the_allocator_snippet_runs_and_ends_without_warnings(caplog, recwarn) -> None:
    import logging

    with caplog.at_level(logging.WARNING):
        exec(compile(_snippet_after("is the allocator itself:"), "README.md", "exec"), {})
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    assert not list(recwarn), [str(w.message) for w in recwarn]


def test_the_elastic_buffer_snippet_runs() -> None:
    exec(compile(_snippet_after("copy nothing."), "README.md", "exec"), {})


def test_the_runner_snippet_shows_different_memory_per_size_and_per_strategy(capsys) -> None:
    exec(compile(_snippet_after("## Using it"), "README.md", "exec"), {})
    lines = capsys.readouterr().out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.split()[:2] == ["batch", "capture"])
    per_size = [" ".join(line.split()[2:4]) for line in lines[head + 1:head + 8]]  # the "memory +" column
    assert len(set(per_size)) > 1, per_size
    kinds = dict(line.strip().split(": ") for line in lines if line.strip().split(":")[0] in ("vmm", "shared",
                                                                                                "private"))
    kib = {kind: int(text.split()[0]) for kind, text in kinds.items()}
    assert set(kib) == {"vmm", "shared", "private"} and 0 < kib["vmm"] < kib["shared"] < kib["private"], kinds


def test_the_cpu_engine_loop_runs_through_the_graph_api(capsys) -> None:
    exec(compile(_snippet_after("through hal's own graph calls"), "README.md", "exec"), {})
    header = capsys.readouterr().out.splitlines()[0]
    assert header.startswith("graph pools on fake (vmm): 4 key(s) holding 4 graph(s)"), header


def test_the_readme_lists_every_graph_call_of_the_backend() -> None:
    import hal.graph_calls

    text = (ROOT / "README.md").read_text()
    table = text[text.index("The graph half of `hal.Backend`"):text.index("`python -m hal` lists backends")]
    for call in ("create_graph", "capture", "replay", "release_graph", "create_stream", "create_pool", "use_pool",
                 "route_captures", "release_pool", "synchronize", "use_stream"):
        assert f"be.{call}(" in table, call
        assert ">>>" in (getattr(hal.graph_calls.GraphCalls, call).__doc__ or ""), f"{call} has no example"


def test_the_readmes_costs_of_kept_and_replay_scoped_outputs_hold() -> None:
    """The figures the README states for its CPU engine loop: 320 KiB with kept outputs, 128 KiB with
    outputs="replay" in both capture orders, one shared pool 128 KiB largest first (256 KiB smallest first)."""
    import torch

    import graphkit
    import hal

    text = (ROOT / "README.md").read_text()
    assert "320 KiB" in text and "128 KiB" in text
    be = hal.get_backend("fake", granularity=64 << 10)
    w = torch.randn(256, 256)

    def loop(order: tuple[int, ...], outputs: str | None) -> int:
        graphs, kept = [], []
        if outputs is None:  # one shared pool of the device, as engines pass it
            pool, used = be.create_pool(), be.mem_info().used
        scope = graphkit.graph_memory(be, outputs=outputs) if outputs else None
        pools = scope.__enter__() if scope else None
        for n in order:
            graph, x = be.create_graph(), torch.zeros(n, 256)
            with be.capture(graph, pool=None if scope else pool):
                kept.append(torch.relu(x @ w))
            graphs.append(graph)
        if scope:
            scope.__exit__(None, None, None)
        cost = pools.report().chunk_bytes if pools else be.mem_info().used - used
        for graph in graphs:
            be.release_graph(graph)
        del kept
        if pools:
            pools.close()
        else:
            be.release_pool(pool)
        return cost >> 10

    largest, smallest = (64, 32, 16, 8), (8, 16, 32, 64)
    assert loop(largest, "kept") == 320
    assert loop(largest, "replay") == loop(smallest, "replay") == 128
    assert (loop(largest, None), loop(smallest, None)) == (128, 256)
    be.close()
