"""The TP report reads graphkit's own report text (the switch's line per device, a scope's report) and splits a
rank's graph memory per item: checked against the text graphkit writes today, so a change of its wording that
the report would no longer read fails here, on a CPU."""

from __future__ import annotations

import importlib.util
import sys
from typing import Any

import torch

import graphkit
import hal
from tests.paths import SCRIPTS


def _tp_report() -> Any:
    spec = importlib.util.spec_from_file_location("tp_report", SCRIPTS / "tp_report.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["tp_report"] = module
    spec.loader.exec_module(module)
    return module


def _pools_with_two_keys() -> graphkit.GraphPools:
    be = hal.get_backend("fake")
    with graphkit.graph_memory(be, children=False) as pools:
        for n in (4, 2):
            graph, x = be.create_graph(), torch.zeros(n, 64)
            with be.capture(graph):
                x * 2
            be.release_graph(graph)
    return pools


def test_the_report_reads_graphkits_report_text_and_splits_a_rank_per_item() -> None:
    tp = _tp_report()
    pools = _pools_with_two_keys()
    try:
        report = pools.report(measure=False)
        first = str(report).splitlines()[0]
        line = f"graphkit: process 123, cuda:2: {first}"
        assert tp.shared_bytes("switch", {"ranks": {}}, f"noise\n{line}\n") == {"2": report.chunk_bytes}
        result = {"ranks": {"0": {"pools_report": str(report)}}}
        assert tp.shared_bytes("port", result, "") == {"0": report.chunk_bytes}
        assert tp.shared_bytes("scope", {"ranks": {}, "scope_report": str(report)}, "") == {"0": report.chunk_bytes}
    finally:
        pools.close()
    rank = {"graph_bytes": 160 << 20, "shared_bytes": 54 << 20, "torch_default_bytes": 34 << 20,
            "torch_pool_bytes": 196 << 20, "survivor_bytes": 4 << 20, "graph_nodes": None}
    assert tp.items("switch", rank) == {"pool": 54.0, "torch_default": 34.0, "driver_rest": 72.0, "survivors": 4.0}
    own = {**rank, "shared_bytes": None, "survivor_bytes": None, "torch_pool_bytes": 100 << 20}
    assert tp.items("own", own) == {"pool": 100.0, "torch_default": 34.0, "driver_rest": 26.0}
