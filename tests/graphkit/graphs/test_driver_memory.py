"""The driver's own memory of instantiated graphs in every report: measured where the device has a driver
(device growth less the pools' bytes), "not measured" with the reason elsewhere, never a made-up number."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

import graphkit
import hal
from graphkit.graphs.report import driver_memory
from graphkit_bench import graphmem
from graphkit_bench.model import DecoderConfig
from tests.conftest import backend_options


def device(kind: str) -> Any:
    """A stand-in backend whose framework device is of ``kind`` (only that is asked)."""
    return SimpleNamespace(name=kind, torch_device=lambda: torch.device(kind, 0) if kind != "cpu" else
                           torch.device("cpu"))


def test_the_figure_is_the_device_growth_less_the_pools_and_each_gap_says_why() -> None:
    assert driver_memory(device("cuda"), 10 << 20, 4 << 20) == (6 << 20, "")
    assert driver_memory(device("cuda"), 10 << 20, 0) == (10 << 20, "")
    none, why = driver_memory(device("cuda"), 10 << 20, None)
    assert none is None and "framework's allocator" in why and "graphkit_bench.graphmem" in why
    none, why = driver_memory(device("cuda"), None, 4 << 20)
    assert none is None and "measure=False" in why
    none, why = driver_memory(device("cpu"), 10 << 20, 4 << 20)
    assert none is None and "the host" in why


def step_and_input(be: hal.Backend) -> tuple[Any, torch.Tensor]:
    w = torch.randn(64, 64, device=be.torch_device())
    return (lambda x: torch.relu(x @ w) @ w.t()), torch.zeros(8, 64, device=be.torch_device())


def test_on_fake_every_report_says_not_measured(be: hal.Backend) -> None:
    step, x = step_and_input(be)
    runner = graphkit.GraphRunner(step, sizes=[2, 4, 8], backend=be, kind="vmm", progress=False)
    runner.capture(x=x)
    report = runner.report()
    assert report.graphs == 3 and report.driver_bytes is None and "the host" in report.driver_why
    assert "driver memory of 3 graph(s): not measured: fake's device is the host" in str(report)
    runner.close()
    with graphkit.graph_memory(be) as pools:
        graph = be.create_graph()
        with torch.no_grad(), be.capture(graph):
            y = step(x)
    report = pools.report()
    assert report.driver_bytes is None and "driver memory of the graphs of 1 key(s): not measured" in str(report)
    del y
    be.release_graph(graph)
    pools.close()


def test_the_bench_script_says_not_measured_on_fake() -> None:
    result = graphmem.measure("fake", 1, [1, 2], DecoderConfig.tiny())
    assert [row["graphs"] for row in result["rows"]] == [1, 2]
    assert result["driver_bytes"] is None and result["driver_per_graph_bytes"] is None
    assert result["nodes_per_graph"] and result["nodes_per_graph"] > 0
    assert "n/m: not measured" in graphmem.table([result])


@pytest.mark.cuda
def test_on_cuda_every_report_measures_it_and_it_is_not_negative() -> None:
    be = hal.get_backend("cuda", **backend_options("cuda"))
    try:
        step, x = step_and_input(be)
        runner = graphkit.GraphRunner(step, sizes=[2, 4, 8], backend=be, kind="vmm", progress=False,
                                      measure_memory=True)
        runner.capture(x=x)
        report = runner.report()
        assert report.graphs == 3 and report.driver_bytes is not None and report.driver_bytes >= 0, report
        assert "driver memory of 3 graph(s): " in str(report) and "not measured" not in str(report)
        runner.close()
        with graphkit.graph_memory(be) as pools:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                y = step(x)
        report = pools.report()
        assert report.driver_bytes is not None and report.driver_bytes >= 0, report
        del y
        graph.reset()
        pools.close()
    finally:
        be.close()


@pytest.mark.cuda
def test_on_cuda_the_bench_script_measures_it_per_graph_and_node() -> None:
    result = graphmem.measure("cuda", 2, [1, 2, 4, 8], DecoderConfig.tiny())
    assert result["driver_bytes"] is not None and result["driver_bytes"] >= 0, result
    assert all(row["driver_bytes"] is not None and row["driver_bytes"] >= 0 for row in result["rows"])
    assert result["nodes_per_graph"] and result["driver_per_node_bytes"] is not None
    print(graphmem.table([result]))
