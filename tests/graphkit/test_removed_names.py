"""Names removed before 1.0 are refused, each with an error that names it, never silently taken."""

from __future__ import annotations

import pytest

import graphkit
import hal
from tests.conftest import G


def test_graph_runner_refuses_the_old_pool_keyword(be: hal.Backend) -> None:
    with pytest.raises(hal.InvalidArgumentError, match="pool"):
        graphkit.GraphRunner(lambda x: x * 2, sizes=[2, 4], backend=be, progress=False, pool="vmm")
    assert be.live.zero, be.live


def test_graph_pools_refuse_the_old_capacity_keyword(be: hal.Backend) -> None:
    with pytest.raises(hal.InvalidArgumentError, match="capacity"):
        graphkit.GraphPools(be, capacity=2 * G)
    assert be.live.zero, be.live


@pytest.mark.parametrize("old", ["ElasticPool"])
def test_old_module_names_are_gone(old: str) -> None:
    assert not hasattr(graphkit, old)


@pytest.mark.parametrize("cls,old", [(graphkit.GraphRunner, "graph_memory"), (graphkit.GraphRunner, "pool"),
                                     (graphkit.SharedVMMAllocator, "extend_mapping"),
                                     (graphkit.SharedVMMAllocator, "capacity"), (graphkit.ElasticBuffer, "pool"),
                                     (graphkit.ElasticBuffer, "capacity"), (graphkit.ElasticBuffer, "physical_bytes"),
                                     (graphkit.RunnerReport, "pool"), (graphkit.RunnerReport, "graph_memory"),
                                     (graphkit.TagReport, "bytes")])
def test_old_attribute_names_are_gone(cls: type, old: str) -> None:
    assert not hasattr(cls, old)
