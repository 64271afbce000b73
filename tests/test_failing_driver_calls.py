"""Every public operation of graphkit with each driver call it makes failing, once or twice in a row.

For each scenario, hook and call number: the operation either raises a hal
error or recovers cleanly; afterwards everything still gives right results
(bit-exact where data was backed up), and after close nothing is live.

Every hook a scenario calls is failed at every call position it reaches,
once and twice in a row (so that the immediate retry of a rollback step
fails too). The objects of earlier tests are frozen out of the garbage
collector's way: the library collects at every close, and a run of a
few thousand cases stays at seconds.
"""

from __future__ import annotations

import collections
import contextlib
import gc
import itertools
from collections.abc import Callable, Iterator

import pytest
import torch

import graphkit
import hal
from hal.api import ALL_HOOKS, VMM_HOOKS
from tests.conftest import G

W = torch.randn(64, 64) / 8


def step(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ W) + x


def release(be: hal.Backend, graph: object) -> None:
    """Release a graph; a release that met a fault is retried once (it must then work)."""
    try:
        be.release_graph(graph)
    except hal.HalError:
        be.release_graph(graph)


def scope_scenario(be: hal.Backend) -> None:
    pools = graphkit.GraphPools(be)
    graphs = {}
    try:
        try:
            with graphkit.graph_memory(pools=pools):
                for n in (8, 2, 4):
                    x = torch.zeros(n, 64)
                    graph = be.create_graph()
                    try:
                        with be.capture(graph):
                            out = step(x)
                    except hal.HalError:
                        release(be, graph)
                        raise
                    graphs[n] = (graph, x, out)
        except hal.HalError:
            pass
        be.faults.clear()
        for n, (graph, x, out) in graphs.items():  # what was captured replays right
            x.copy_(torch.randn(n, 64))
            be.replay(graph)
            torch.testing.assert_close(out, step(x))
    finally:
        be.faults.clear()
        for graph, _, _ in graphs.values():
            release(be, graph)
        del graphs
        gc.collect()
        close_twice(pools.close)


def saver_scenario(be: hal.Backend) -> None:
    saver = graphkit.MemorySaver(be)
    try:
        try:
            with saver.region("weights", backup=True):
                w = torch.arange(4 * G // 4, dtype=torch.float32)
                w2 = torch.ones(2 * G // 4)
        except (hal.HalError, RuntimeError):  # torch turns a failed segment into its own out-of-memory error
            return
        expected = w.clone()
        for _ in range(2):
            with contextlib.suppress(hal.HalError):
                saver.pause()
            with contextlib.suppress(hal.HalError):
                saver.resume()
        be.faults.clear()
        saver.resume()
        assert torch.equal(w, expected) and float(w2.sum()) == w2.numel()
        del w, w2
    finally:
        be.faults.clear()
        gc.collect()
        close_twice(saver.close)


def elastic_scenario(be: hal.Backend) -> None:
    pool = graphkit.ElasticReservation(be, reserve_bytes=32 * G)
    try:
        buf = pool.buffer(16 * G)
        done = 0
        for target in (3 * G, 8 * G, 2 * G, 6 * G):
            try:
                buf.resize(target)
                done = target
            except hal.HalError:
                assert buf.mapped_bytes == done  # all or nothing
        be.faults.clear()
        buf.resize(5 * G)
        view = buf.view(torch.int64, (5 * G // 8,))
        view.copy_(torch.arange(view.numel()))
        assert int(view[-1]) == view.numel() - 1
        del view
    finally:
        be.faults.clear()
        close_twice(pool.close)


def runner_scenario(be: hal.Backend) -> None:
    """Capture three sizes, call each, release one, call again, close: right answers throughout."""
    runner = graphkit.GraphRunner(step, sizes=[2, 4, 8], backend=be, progress=False, on_demand=True)
    try:
        runner.capture(x=torch.zeros(8, 64))
        for n in (8, 3, 1, 5):
            try:
                x = torch.randn(n, 64)
                torch.testing.assert_close(runner(x=x), step(x))
            except hal.HalError:
                pass
        with contextlib.suppress(hal.HalError):
            runner.release_size(8)
        be.faults.clear()
        x = torch.randn(7, 64)
        torch.testing.assert_close(runner(x=x), step(x))
    finally:
        be.faults.clear()
        close_twice(runner.close)


def pools_scenario(be: hal.Backend) -> None:
    """GraphPools handles passed to captures by the caller, released key by key."""
    pools = graphkit.GraphPools(be)
    kept = {}
    try:
        for n in (8, 2, 4):
            graph = be.create_graph()
            x = torch.zeros(n, 64)
            try:
                with be.capture(graph, pool=pools.pool(n)):
                    out = step(x)
            except hal.HalError:
                release(be, graph)
                continue
            kept[n] = (graph, x, out)
        be.faults.clear()
        for n, (graph, x, out) in list(kept.items()):
            x.copy_(torch.randn(n, 64))
            be.replay(graph)
            torch.testing.assert_close(out, step(x))
            be.release_graph(graph)
            del out
            kept.pop(n)
            pools.release(n)
    finally:
        be.faults.clear()
        for graph, _, _ in kept.values():
            release(be, graph)
        kept.clear()
        gc.collect()
        close_twice(pools.close)


def sleep_scenario(be: hal.Backend) -> None:
    """The README's sleep set-up: a region, an ElasticBuffer, a GraphRunner and GraphPools under one saver.

    Capture, pause and resume twice under the fault, then: the runner and the
    pools' graph answer right, weights and KV cache are bit-exact.
    """
    saver = graphkit.MemorySaver(be)
    made: list[graphkit.ElasticBuffer | graphkit.GraphRunner | graphkit.GraphPools] = []
    graphs: list[object] = []
    try:
        with saver.region("weights", backup=True):
            w = torch.arange(G // 4, dtype=torch.float32)
        expected = w.clone()
        kv = graphkit.ElasticBuffer(be, max_bytes=4 * G, saver=saver, tag="kv", backup=True)
        made.append(kv)
        kv.resize(2 * G)
        view = kv.view(torch.int32, (2 * G // 4,))
        view.copy_(torch.arange(view.numel(), dtype=torch.int32))
        del view
        runner = graphkit.GraphRunner(step, sizes=[2, 4], backend=be, saver=saver, progress=False)
        made.append(runner)
        runner.capture(x=torch.zeros(4, 64))
        pools = graphkit.GraphPools(be, saver=saver, hygiene=True)
        made.append(pools)
        x = torch.zeros(4, 64)
        with graphkit.graph_memory(pools=pools):
            pools.warm_up(step, x)
            graph = be.create_graph()
            graphs.append(graph)
            with be.capture(graph):
                out = step(x)
        for _ in range(2):
            with contextlib.suppress(hal.HalError):
                saver.pause()
            with contextlib.suppress(hal.HalError):
                saver.resume()
        be.faults.clear()
        saver.resume()
        y = torch.randn(3, 64)
        torch.testing.assert_close(runner(x=y), step(y))
        x.copy_(torch.randn(4, 64))
        be.replay(graph)
        torch.testing.assert_close(out, step(x))
        assert torch.equal(w, expected)
        view = kv.view(torch.int32, (2 * G // 4,))
        assert torch.equal(view, torch.arange(view.numel(), dtype=torch.int32))
        del view, out
    finally:
        be.faults.clear()
        for graph in graphs:
            with contextlib.suppress(hal.HalError):
                be.release_graph(graph)
        for obj in reversed(made):
            close_twice(obj.close)
        gc.collect()
        close_twice(saver.close)


def close_twice(close: Callable[[], None]) -> None:
    """Close; a close that met a fault is retried once (it must then finish)."""
    try:
        close()
    except hal.HalError:
        close()


SCENARIOS = {"graph_memory": scope_scenario, "saver": saver_scenario, "elastic": elastic_scenario,
             "runner": runner_scenario, "pools": pools_scenario, "sleep": sleep_scenario}


def run(scenario: str, be: hal.Backend) -> None:
    """A hal error out of the scenario is an accepted outcome (a wrong result or another error is not)."""
    with contextlib.suppress(hal.HalError):
        SCENARIOS[scenario](be)
    be.faults.clear()


@pytest.fixture(scope="module", autouse=True)
def frozen_heap() -> Iterator[None]:
    """Objects made before these tests are left out of every collection the library triggers.

    One clean run of each scenario first: what it imports lazily is frozen too.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: threads only contend with each other (and with other test runs)
    for scenario in ("sleep", "runner", "elastic"):
        be = hal.get_backend("fake", granularity=G)
        run(scenario, be)
        be.close()
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()
    torch.set_num_threads(threads)


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize("hook", VMM_HOOKS)
@pytest.mark.parametrize("nth", [1, 2, 4])
def test_one_fault(scenario: str, hook: str, nth: int) -> None:
    be = hal.get_backend("fake", granularity=G)
    be.faults.fail(hook, nth=nth)
    run(scenario, be)
    gc.collect()
    live = be.live
    assert live.ranges == live.chunks == live.mappings == 0, live
    be.close()
    assert be.live.zero


PAIRS = list(itertools.combinations(["create_phy_mem_handle", "map", "unmap", "release_phy_mem_handle"], 2))


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize("first,second", PAIRS)
def test_two_faults(scenario: str, first: str, second: str) -> None:
    be = hal.get_backend("fake", granularity=G)
    be.faults.fail(first, nth=2)
    be.faults.fail(second, nth=1)
    run(scenario, be)
    gc.collect()
    live = be.live
    assert live.ranges == live.chunks == live.mappings == 0, live
    be.close()
    assert be.live.zero


# -- every hook a scenario calls, at every call position, once and twice in a row --------------------------------


def calls_of(scenario: str, make: Callable[[], hal.Backend]) -> collections.Counter[str]:
    """How often each hook is called in a run of the scenario without faults."""
    be = make()
    counts: collections.Counter[str] = collections.Counter()
    check = be.faults._check
    be.faults._check = lambda hook: (counts.update([hook]), check(hook))  # type: ignore[method-assign]
    run(scenario, be)
    be.faults._check = check  # type: ignore[method-assign]
    be.close()
    return counts


def fail_everywhere(scenario: str, make: Callable[[], hal.Backend], hooks: tuple[str, ...], repeats: tuple[int, ...],
             max_positions: int) -> tuple[int, list[str]]:
    """Fail each hook at each call position (``repeats`` times in a row); the cases run and what went wrong."""
    counts = calls_of(scenario, make)
    cases, wrong = 0, []
    for hook in hooks:
        n = counts.get(hook, 0)
        positions = sorted({1 + (k * n) // max_positions for k in range(max_positions)}) if n > max_positions \
            else range(1, n + 1)
        for nth, times in itertools.product(positions, repeats):
            be = make()
            for _ in range(times):
                be.faults.fail(hook, nth=nth)
            try:
                run(scenario, be)
            except Exception as exc:  # noqa: BLE001 - collected: the assertion below lists every case
                wrong.append(f"{hook}#{nth} x{times}: {type(exc).__name__}: {exc}")
            gc.collect()
            live = be.live
            if not (live.ranges == live.chunks == live.mappings == live.pools == 0):
                wrong.append(f"{hook}#{nth} x{times}: left {live}")
            be.close()
            cases += 1
    return cases, wrong


FAILED_HOOKS = tuple(h for h in ALL_HOOKS if h != "shutdown")  # shutdown is the backend's own close


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_every_hook_at_every_position_once_and_twice(scenario: str) -> None:
    cases, wrong = fail_everywhere(scenario, lambda: hal.get_backend("fake", granularity=G), FAILED_HOOKS, (1, 2),
                            max_positions=24)
    assert cases > 40 and not wrong, "\n".join(wrong[:20])


def test_the_sleep_scenario_reaches_the_hooks_of_the_contract() -> None:
    """These tests are only as good as the hooks its scenarios call: at least the 22 a backend does work in."""
    reached = calls_of("sleep", lambda: hal.get_backend("fake", granularity=G))
    assert len(reached) >= 22, sorted(reached)
    assert set(VMM_HOOKS) <= set(reached)


SIM_SCENARIOS = {"elastic": elastic_scenario}


def graph_memory_sleeps(be: hal.Backend) -> None:
    """Graph memory and an elastic buffer sleeping together on a vendor's VMM calls."""
    saver = graphkit.MemorySaver(be)
    alloc = graphkit.SharedVMMAllocator(be, reserve_bytes=8 * G)
    kv: graphkit.ElasticBuffer | None = None
    try:
        saver.adopt(alloc)
        alloc.switch_to_new_virtual_space()
        alloc.allocate(3 * G)
        kv = graphkit.ElasticBuffer(be, max_bytes=8 * G, saver=saver, tag="kv_cache")
        kv.resize(5 * G)
        for _ in range(2):
            with contextlib.suppress(hal.HalError):
                saver.pause()
            with contextlib.suppress(hal.HalError):
                saver.resume()
        be.faults.clear()
        saver.resume()
        assert not alloc.paused and not kv.paused and kv.mapped_bytes == 5 * G
        kv.resize(6 * G)
    finally:
        be.faults.clear()
        if kv is not None:
            close_twice(kv.close)
        saver.forget(alloc)
        close_twice(alloc.close)
        close_twice(saver.close)


SCENARIOS["vmm_sleep"] = graph_memory_sleeps  # run on the simulators only (regions need use_pool)


@pytest.mark.parametrize("name", ["ascend", "mlu"])
@pytest.mark.parametrize("scenario", ["elastic", "vmm_sleep"])
def test_every_vmm_hook_at_every_position_on_the_vendor_simulators(name: str, scenario: str) -> None:
    from tests.sim import compiler_reason, simulated_backend

    if compiler_reason() is not None:
        pytest.skip(str(compiler_reason()))
    stack = contextlib.ExitStack()

    def make() -> hal.Backend:
        return stack.enter_context(simulated_backend(name, capacity=64 * G, granularity=G))

    with stack:
        cases, wrong = fail_everywhere(scenario, make, VMM_HOOKS, (1, 2), max_positions=12)
    assert cases > 20 and not wrong, "\n".join(wrong[:20])
