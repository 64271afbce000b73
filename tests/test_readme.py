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
