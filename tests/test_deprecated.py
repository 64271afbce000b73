"""Old spellings of renamed public names: each still works and warns with a DeprecationWarning naming the new one."""

from __future__ import annotations

import pytest
import torch

import graphkit
import graphkit.elastic
import hal
from tests.conftest import G


def _runner(be: hal.Backend, **kw) -> graphkit.GraphRunner:
    return graphkit.GraphRunner(lambda x: x * 2, sizes=[2, 4], backend=be, progress=False, **kw)


def test_graph_runner_pool_keyword_is_kind(be: hal.Backend) -> None:
    with pytest.warns(DeprecationWarning, match=r"GraphRunner\(pool=\) is deprecated; use kind="):
        runner = _runner(be, pool="shared")
    assert runner.kind == "shared"
    runner.close()


def test_graph_runner_pool_attribute_is_kind(be: hal.Backend) -> None:
    runner = _runner(be, kind="private")
    with pytest.warns(DeprecationWarning, match=r"GraphRunner\.pool is deprecated; use kind"):
        assert runner.pool == "private"
    runner.close()


def test_graph_runner_graph_memory_is_graph_bytes(be: hal.Backend) -> None:
    runner = _runner(be).capture(x=torch.ones(4, 8))
    with pytest.warns(DeprecationWarning, match=r"GraphRunner\.graph_memory\(\) is deprecated; use graph_bytes"):
        old = runner.graph_memory()
    assert old == runner.graph_bytes() > 0
    runner.close()


def test_runner_report_old_field_names(be: hal.Backend) -> None:
    runner = _runner(be).capture(x=torch.ones(4, 8))
    report = runner.report()
    with pytest.warns(DeprecationWarning, match=r"RunnerReport\.pool is deprecated; use kind"):
        assert report.pool == report.kind == "vmm"
    with pytest.warns(DeprecationWarning, match=r"RunnerReport\.graph_memory is deprecated; use graph_bytes"):
        assert report.graph_memory == report.graph_bytes > 0
    runner.close()


def test_allocator_extend_mapping_is_precreate(be: hal.Backend) -> None:
    a = graphkit.SharedVMMAllocator(be)
    with pytest.warns(DeprecationWarning, match=r"extend_mapping\(\) is deprecated; use precreate\(\)"):
        a.extend_mapping(2 * G)
    assert a.physical_bytes == 2 * G
    a.close()


def test_allocator_capacity_keyword_and_attribute_are_max_physical_bytes(be: hal.Backend) -> None:
    with pytest.warns(DeprecationWarning, match=r"SharedVMMAllocator\(capacity=\) is deprecated"):
        a = graphkit.SharedVMMAllocator(be, capacity=2 * G)
    assert a.max_physical_bytes == 2 * G
    with pytest.warns(DeprecationWarning, match=r"SharedVMMAllocator\.capacity is deprecated"):
        assert a.capacity == 2 * G
    a.switch_to_new_virtual_space()
    with pytest.raises(hal.DeviceOutOfMemoryError, match="max_physical_bytes"):
        a.allocate(3 * G)
    a.close()


def test_allocator_option_capacity_still_caps_graph_pools_and_runners(be: hal.Backend) -> None:
    with pytest.warns(DeprecationWarning, match=r"capacity=\) is deprecated; use max_physical_bytes="):
        pools = graphkit.GraphPools(be, capacity=2 * G)
    assert pools.allocator is not None and pools.allocator.max_physical_bytes == 2 * G
    pools.close()
    with pytest.warns(DeprecationWarning, match=r"capacity=\) is deprecated; use max_physical_bytes="):
        runner = _runner(be, allocator_options={"capacity": 2 * G})
    assert runner.strategy is not None and runner.strategy.allocator.max_physical_bytes == 2 * G
    runner.close()


def test_elastic_buffer_capacity_is_max_bytes(be: hal.Backend) -> None:
    buf = graphkit.ElasticBuffer(be, max_bytes=3 * G)
    with pytest.warns(DeprecationWarning, match=r"ElasticBuffer\.capacity is deprecated; use max_bytes"):
        assert buf.capacity == buf.max_bytes == 3 * G
    buf.close()


@pytest.mark.parametrize("module", [graphkit, graphkit.elastic], ids=["graphkit", "graphkit.elastic"])
def test_elastic_pool_is_elastic_reservation(module) -> None:
    with pytest.warns(DeprecationWarning, match=r"ElasticPool is deprecated; use graphkit\.ElasticReservation"):
        cls = module.ElasticPool
    assert cls is graphkit.ElasticReservation
    with pytest.raises(AttributeError):
        module.NoSuchName  # noqa: B018


def test_graph_runner_refuses_kind_and_its_old_spelling_together(be: hal.Backend) -> None:
    with pytest.warns(DeprecationWarning), pytest.raises(hal.InvalidArgumentError, match=r"pool='vmm' and kind="):
        _runner(be, kind="private", pool="vmm")
    with pytest.warns(DeprecationWarning), pytest.raises(hal.InvalidArgumentError, match=r"pool=.* and kind='vmm'"):
        _runner(be, kind="vmm", pool="shared")  # the default spelled out is a choice too
    assert be.live.zero, be.live


def test_allocator_refuses_max_physical_bytes_and_its_old_spelling_together(be: hal.Backend) -> None:
    with pytest.warns(DeprecationWarning), pytest.raises(hal.InvalidArgumentError,
                                                         match=r"capacity=.* and max_physical_bytes=.* both given"):
        graphkit.SharedVMMAllocator(be, max_physical_bytes=G, capacity=16 * G)
    with pytest.warns(DeprecationWarning), pytest.raises(hal.InvalidArgumentError, match="capacity="):
        graphkit.GraphPools(be, max_physical_bytes=G, capacity=16 * G)
    assert be.live.zero, be.live
