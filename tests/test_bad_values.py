"""Public entry points driven with bad values: only hal errors may come out (no TypeError, no ctypes error)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import graphkit
import hal
from tests.conftest import G

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
    if kind not in ("vmm", "shared", "private"):
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


class _BadHash:
    def __hash__(self) -> int:
        raise ValueError("no hash")


class _BadEq:
    def __hash__(self) -> int:
        return 1

    def __eq__(self, other: object) -> bool:
        raise RuntimeError("no eq")


BAD_CALLS = {
    "precreate(1.5)": lambda o: o["pool"].precreate(1.5),
    "precreate('x')": lambda o: o["pool"].precreate("x"),
    "ElasticBuffer(pool=object())": lambda o: graphkit.ElasticBuffer(o["be"], max_bytes=G, pool=object()),
    "ElasticBuffer(saver=object())": lambda o: graphkit.ElasticBuffer(o["be"], max_bytes=G, saver=object()),
    "is_paused(['x'])": lambda o: o["saver"].is_paused(["x"]),
    "check_awake(['x'])": lambda o: o["saver"].check_awake(["x"], "c"),
    "awake(['x'])": lambda o: o["saver"].awake(["x"]).__enter__(),
    "region(backup='yes')": lambda o: o["saver"].region("tb", backup="yes").__enter__(),
    "adopt(object())": lambda o: o["saver"].adopt(object(), "zz"),
    "MemorySaver('fake')": lambda o: graphkit.MemorySaver("fake"),
    "pool(a key that will not hash)": lambda o: o["pools"].pool(_BadHash()),
    "pool(a key that will not compare)": lambda o: o["pools"].pool(_BadEq()),
    "release([1])": lambda o: o["pools"].release([1]),
    "leftovers([1])": lambda o: o["pools"].leftovers([1], None),
    "warm_up(1)": lambda o: o["pools"].warm_up(1),
    "warm_up(runs='x')": lambda o: o["pools"].warm_up(lambda: None, runs="x"),
    "GraphPools(bogus=1)": lambda o: graphkit.GraphPools(o["be"], bogus=1),
    "GraphPools(saver=object())": lambda o: graphkit.GraphPools(o["be"], saver=object()),
    "GraphPools('fake')": lambda o: graphkit.GraphPools("fake"),
    "GraphRunner(saver=object())": lambda o: graphkit.GraphRunner(lambda x: x, [1], o["be"], saver=object()),
    "graph_memory(pools=object())": lambda o: graphkit.graph_memory(o["be"], pools=object()).__enter__(),
    "graph_memory('fake')": lambda o: graphkit.graph_memory("fake").__enter__(),
}


@pytest.mark.parametrize("name", sorted(BAD_CALLS))
def test_bad_values_of_sleep_elastic_and_pools_give_hal_errors(name: str) -> None:
    be = hal.get_backend("fake", granularity=G)
    objects = {"be": be, "saver": graphkit.MemorySaver(be),
               "pool": graphkit.ElasticReservation(be, reserve_bytes=8 * G), "pools": graphkit.GraphPools(be)}
    objects["pools"].pool(_BadEq())  # the next key of that hash gets compared with it
    before = be.live
    with pytest.raises(hal.InvalidArgumentError):
        BAD_CALLS[name](objects)
    assert be.live == before  # nothing made on the way to the error
    objects["pools"].close()
    objects["pool"].close()
    objects["saver"].close()
    be.close()
    assert be.live.zero
