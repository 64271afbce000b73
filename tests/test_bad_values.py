"""Public entry points driven with bad values: only hal errors may come out (no TypeError, no ctypes error)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import graphkit
import hal

G = 1 << 16

#: values that are never a valid byte count: not ints, bools, negatives, beyond 64 bits
NOT_A_SIZE = st.one_of(
    st.integers(max_value=-1), st.integers(min_value=2 ** 64, max_value=2 ** 80), st.floats(allow_nan=True),
    st.booleans(), st.text(max_size=3), st.none(), st.lists(st.integers(), max_size=2), st.just(torch.ones(1)),
)
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def be():
    backend = hal.get_backend("fake", granularity=G)
    yield backend
    backend.close()


@SETTINGS
@given(value=st.one_of(NOT_A_SIZE, st.just(0)))
def test_facade_sizes(be: hal.Backend, value: object) -> None:
    for call in (be.create_vir_ptr, be.create_phy_mem_handle):
        with pytest.raises(hal.HalError):
            call(value)  # type: ignore[arg-type]
    if value != 0:  # an empty tensor is fine
        with pytest.raises(hal.HalError):
            be.tensor_at(0x1000, value)  # type: ignore[arg-type]
    assert be.live.ranges == 0 and be.live.chunks == 0


@SETTINGS
@given(value=NOT_A_SIZE)
def test_allocator(be: hal.Backend, value: object) -> None:
    if value is not None:  # None: the default, the device's memory
        with pytest.raises(hal.HalError):
            graphkit.SharedVMMAllocator(be, reserve_bytes=value)  # type: ignore[arg-type]
    alloc = graphkit.SharedVMMAllocator(be, reserve_bytes=8 * G)
    alloc.switch_to_new_virtual_space()
    with pytest.raises(hal.HalError):
        alloc.allocate(value)  # type: ignore[arg-type]
    with pytest.raises(hal.HalError):
        alloc.allocate(16, alignment=value)  # type: ignore[arg-type]
    alloc.close()


@SETTINGS
@given(value=st.one_of(NOT_A_SIZE, st.just(0)))
def test_elastic(be: hal.Backend, value: object) -> None:
    with pytest.raises(hal.HalError):
        graphkit.ElasticBuffer(be, max_bytes=value)  # type: ignore[arg-type]
    with graphkit.ElasticBuffer(be, max_bytes=4 * G) as buf:
        with pytest.raises(hal.HalError):
            buf.view(value, (4,))  # type: ignore[arg-type]
        if value != 0:  # resizing to 0 and an empty view are fine
            with pytest.raises(hal.HalError):
                buf.resize(value)  # type: ignore[arg-type]
            with pytest.raises(hal.HalError):
                buf.view(torch.float32, (value,))  # type: ignore[arg-type]


@SETTINGS
@given(value=st.one_of(st.integers(), st.none(), st.just(""), st.lists(st.text(), max_size=2), st.floats()))
def test_saver_tags(be: hal.Backend, value: object) -> None:
    saver = graphkit.MemorySaver(be)
    with pytest.raises(hal.HalError):
        with saver.region(value):  # type: ignore[arg-type]
            pass
    with pytest.raises(hal.HalError):
        saver.pause("unknown" if value is None else str(value) + "?")
    saver.close()
    with pytest.raises(hal.InvalidStateError):
        saver.pause()


@SETTINGS
@given(kind=st.one_of(st.text(max_size=5), st.integers(), st.none()), key=st.one_of(
    st.lists(st.integers(), max_size=2), st.dictionaries(st.text(max_size=2), st.integers(), max_size=1)))
def test_graph_pools(be: hal.Backend, kind: object, key: object) -> None:
    if kind not in ("vmm", "shared"):
        with pytest.raises(hal.HalError):
            graphkit.GraphPools(be, kind=kind)  # type: ignore[arg-type]
    with graphkit.GraphPools(be) as pools:
        with pytest.raises(hal.HalError):
            pools.pool(key)  # type: ignore[arg-type]
        with pytest.raises(hal.HalError):
            pools.release(("never", 1))
    with pytest.raises(hal.HalError):
        pools.pool(1)


@SETTINGS
@given(sizes=st.one_of(st.lists(NOT_A_SIZE, min_size=1, max_size=3), st.just([]), st.lists(st.just(0), min_size=1,
                                                                                             max_size=2)))
def test_runner_sizes(be: hal.Backend, sizes: list) -> None:
    with pytest.raises(hal.HalError):
        graphkit.GraphRunner(lambda x: x, sizes=sizes, backend=be, progress=False)
