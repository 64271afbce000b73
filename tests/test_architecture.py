"""docs/architecture.md walks a capture under graph_memory(): the project files it names are the ones a capture on
fake enters, traced."""

from __future__ import annotations

import re
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any

import torch

import graphkit
import hal
from tests.conftest import G

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("hal", "graphkit")


def _documented() -> set[str]:
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = re.search(r"<!-- capture-files:begin -->(.*?)<!-- capture-files:end -->", text, re.S)
    assert block, "docs/architecture.md lost its list of the files a capture enters"
    return set(re.findall(r"`((?:hal|graphkit)/[\w/]+\.py)`", block.group(1)))


def _traced_capture() -> set[str]:
    """The project files a capture of an engine's own graph enters inside graph_memory() on fake."""
    entered: set[str] = set()
    prefixes = tuple(str(ROOT / p) + "/" for p in PACKAGES)

    def tracer(frame: FrameType, event: str, arg: Any) -> None:
        name = frame.f_code.co_filename
        if event == "call" and name.startswith(prefixes):
            entered.add(str(Path(name).relative_to(ROOT)))

    be = hal.get_backend("fake", granularity=G)
    w = torch.randn(64, 64)
    try:
        with graphkit.graph_memory(be):
            graph, x = be.create_graph(), torch.zeros(8, 64)
            torch.tanh(x @ w)  # warm: torch's own first call is not the capture's
            sys.settrace(tracer)
            threading.settrace(tracer)
            try:
                with be.capture(graph):  # as torch.cuda.graph(g) in an engine: no pool named
                    out = torch.tanh(x @ w)
            finally:
                sys.settrace(None)
                threading.settrace(None)  # type: ignore[arg-type]
            be.replay(graph)
            torch.testing.assert_close(out, torch.tanh(x @ w))
            be.release_graph(graph)
            del out
    finally:
        be.close()
    return entered


def test_the_capture_walk_names_the_files_a_capture_enters() -> None:
    documented, traced = _documented(), _traced_capture()
    assert traced == documented, (f"entered, not in docs/architecture.md: {sorted(traced - documented)}; "
                                  f"listed there, not entered: {sorted(documented - traced)}")
