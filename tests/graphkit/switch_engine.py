"""An engine that never calls graphkit: its ranks capture a step on ``fake`` through hal, in processes it starts.

    python tests/graphkit/switch_engine.py [spawn|fork|none|scope]...

Run with ``GRAPHKIT_GRAPH_MEMORY`` set, the start-up hook installed with the
package has to reach every rank by itself. Each rank (``none``: this process)
captures ``relu(x @ W)`` for three batch sizes, replays each against eager and
reports what it saw of the switch, read from ``sys.modules`` (the rank never
imports graphkit). ``scope``: the launcher starts a spawned rank inside a
``graphkit.graph_memory()`` block, without the variable, then one after the
block. The launcher prints one JSON line: its own view and the
ranks'. Each process's report line lands on stderr at exit; the forked rank
sets up its logging after the switch started (as engines' workers do), and its
line goes through that logging instead.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import sys
from typing import Any

import torch

import hal

SIZES = (4, 2, 1)
#: the graphs and their buffers live as long as the process, as an engine's do
GRAPHS: list[tuple[Any, torch.Tensor, torch.Tensor]] = []


def switch_seen() -> dict[str, Any]:
    """What this process has of the switch, without importing graphkit."""
    switch = sys.modules.get("graphkit.switch")
    scope = switch.active() if switch is not None else None  # type: ignore[attr-defined]
    return {"pid": os.getpid(), "graphkit_imported": "graphkit" in sys.modules,
            "served": sorted(f"{b}:{d}" for b, d in scope.pools) if scope is not None else None,
            "outputs": scope.options.outputs if scope is not None else None,
            "files": {name: getattr(sys.modules.get(name), "__file__", None) for name in ("_graphkit_startup", "hal")}}


def rank() -> dict[str, Any]:
    """Capture and replay the step for every size, as an engine's rank does; what it saw."""
    be = hal.get_backend("fake")
    weight = torch.randn(16, 16)
    worst = 0.0
    for n in SIZES:
        graph, x = be.create_graph(), torch.zeros(n, 16)
        with be.capture(graph):
            y = torch.relu(x @ weight)
        GRAPHS.append((graph, x, y))
    for graph, x, y in GRAPHS:
        x.copy_(torch.randn_like(x))
        be.replay(graph)
        worst = max(worst, (y - torch.relu(x @ weight)).abs().max().item())
    return {**switch_seen(), "worst": worst}


def _rank_main(queue: Any, configure_logging: bool) -> None:
    if configure_logging:
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    queue.put(rank())


def started(method: str) -> dict[str, Any]:
    """A rank started by ``method`` (spawn, fork), what it saw and its exit code."""
    ctx = multiprocessing.get_context(method)
    queue = ctx.Queue()
    proc = ctx.Process(target=_rank_main, args=(queue, method == "fork"))
    proc.start()
    seen = {"method": method, **queue.get(timeout=300)}
    proc.join(timeout=60)
    return {**seen, "exitcode": proc.exitcode}


def main(methods: list[str]) -> None:
    ranks = []
    for method in methods:
        if method == "none":
            ranks.append({"method": method, **rank()})
        elif method == "scope":  # ``with graph_memory(): llm = LLM(...)``: the engine spawns its ranks in the block
            import graphkit

            with graphkit.graph_memory(hal.get_backend("fake"), outputs="replay"):
                graphkit.switch.plugin()  # an engine's plugin entry point in the launcher: the block serves it
                ranks.append({**started("spawn"), "method": "scope", "launcher_switch": switch_seen()["served"]})
            ranks.append({**started("spawn"), "method": "after-scope"})
        else:
            ranks.append(started(method))
    print(json.dumps({"launcher": switch_seen(), "ranks": ranks}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or ["spawn"])
