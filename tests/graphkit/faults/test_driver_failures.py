"""Every public operation of graphkit with each driver call it makes failing, once or twice in a row.

For each scenario, hook and call number: the operation either raises a hal
error or recovers cleanly; afterwards everything still gives right results
(bit-exact where data was backed up), and after close nothing is live.

Every hook a scenario calls is failed at every call position it reaches,
once and twice in a row (so that the immediate retry of a rollback step
fails too). Leaks are checked mid-life as well (close() drops every key,
which would hide them): after each failed step of the pool scenarios, the
backend holds exactly what the objects still hold. The objects of earlier tests are frozen out of the garbage
collector's way: the library collects at every close, and a run of a
few thousand cases stays at seconds.
"""

from __future__ import annotations

import collections
import contextlib
import gc
import itertools
import threading
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


@contextlib.contextmanager
def faulted(be: hal.Backend) -> Iterator[None]:
    """Like ``suppress(hal.HalError)`` for an error an injected fault explains: one raised before any fault
    fired (a run without faults included) is the library's own, a wrong outcome -- but for a capability the
    backend lacks (the simulators have no tensors)."""
    try:
        yield
    except hal.HalError as exc:
        if not be.faults.fired and not isinstance(exc, hal.UnsupportedError):
            raise AssertionError(f"{type(exc).__name__} with no fault injected: {exc}") from exc


def release(be: hal.Backend, graph: object) -> None:
    """Release a graph; a release that met a fault is retried once (it must then work)."""
    try:
        be.release_graph(graph)
    except hal.HalError:
        be.release_graph(graph)


def holds_exactly(be: hal.Backend, pools: graphkit.GraphPools | None, graphs: int) -> None:
    """The backend's live pools, ranges, chunks, mappings and graphs are exactly what ``pools`` (its keys and
    allocator) and the caller (``graphs``) still hold: nothing leaked mid-life, nothing counted twice."""
    alloc = pools.allocator if pools is not None else None
    spaces = list(alloc.spaces.values()) if alloc is not None else []
    held = (sum(e.pool is not None for e in pools._keys.entries.values()) if pools is not None else 0,
            alloc.num_arenas if alloc is not None else 0,
            len(alloc.chunks) + alloc.pending_release + alloc.survivor_bytes // alloc.granularity
            if alloc is not None else 0,
            sum(s.mapped - len(s.holes) for s in spaces), graphs)
    live = be.live
    assert (live.pools, live.ranges, live.chunks, live.mappings, live.graphs) == held, (live, held)


def scope_scenario(be: hal.Backend) -> None:
    """Three captures routed by graph_memory (with hygiene: its queries fail too); a failed one leaves no key."""
    pools = graphkit.GraphPools(be, hygiene=True)
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
        except hal.HalError as exc:  # a failed capture's key went with it (or waits for a retry of its release)
            assert be.faults.fired, exc
            gc.collect()
            holds_exactly(be, pools, len(graphs))
            assert len(pools.keys) == len(graphs) + len(pools._keys._pending), pools.keys
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
            with faulted(be):
                saver.pause()
            with faulted(be):
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
            except hal.HalError as exc:
                assert be.faults.fired, exc
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


def runner_graphs(runner: graphkit.GraphRunner) -> int:
    """The graphs a runner holds (those of buckets whose release failed included)."""
    return sum(len(b.graphs) for b in [*runner._buckets.values(), *runner._pending])


def runner_scenario(be: hal.Backend) -> None:
    """Capture three sizes, call each, release one, call again, close: right answers throughout."""
    runner = graphkit.GraphRunner(step, sizes=[2, 4, 8], backend=be, progress=False, on_demand=True)
    try:
        runner.capture(x=torch.zeros(8, 64))
        for n in (8, 3, 1, 5):
            try:
                x = torch.randn(n, 64)
                torch.testing.assert_close(runner(x=x), step(x))
            except hal.HalError as exc:
                assert be.faults.fired, exc
                gc.collect()
                holds_exactly(be, runner.pools, runner_graphs(runner))
        with faulted(be):
            runner.release_size(8)
        be.faults.clear()
        x = torch.randn(7, 64)
        torch.testing.assert_close(runner(x=x), step(x))
    finally:
        be.faults.clear()
        close_twice(runner.close)


def pools_scenario(be: hal.Backend) -> None:
    """GraphPools handles asked for up front, in another order than the captures (which outgrow one granule),
    one key captured through ``pools.group(key)`` outside any scope, keys released one by one."""
    pools = graphkit.GraphPools(be)
    kept: dict = {}
    try:
        handles = {}
        for n in (2, 8, 4):
            with faulted(be):
                handles[n] = pools.pool(n)
            holds_exactly(be, pools, 0)
        for n in (8, 2, 4):
            graph = be.create_graph()
            x = torch.zeros(64 * n, 64)
            try:
                with pools.group(n) if n == 2 else contextlib.nullcontext(handles.get(n) or pools.pool(n)) as h:
                    with be.capture(graph, pool=h):
                        out = step(x)
            except hal.HalError as exc:
                assert be.faults.fired, exc
                release(be, graph)
                gc.collect()
                holds_exactly(be, pools, len(kept))
                continue
            kept[n] = (graph, x, out)
        be.faults.clear()
        for n, (graph, x, out) in list(kept.items()):
            x.copy_(torch.randn(*x.shape))
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


def threads_scenario(be: hal.Backend) -> None:
    """Two threads capture into two keys: the second key's space is leased while the first capture runs, and the
    second capture starts as soon as it may (a host device's captures take turns, ``hal.host.capture_turn``; on a
    GPU they would overlap)."""
    pools = graphkit.GraphPools(be)
    started, b_leased = threading.Event(), threading.Event()
    kept: dict = {}
    failures: list[BaseException] = []

    def capture_into(n: int, between: Callable[[], object]) -> None:
        try:
            graph = be.create_graph()
        except hal.HalError as exc:
            if not be.faults.fired:
                failures.append(exc)
            return
        x = torch.zeros(64 * n, 64)
        try:
            with be.capture(graph, pool=pools.pool(n)):
                h = step(x)
                between()
                out = step(h)
            kept[n] = (graph, x, out)
        except hal.HalError as exc:
            release(be, graph)
            if not be.faults.fired:
                failures.append(exc)
        except BaseException as exc:  # noqa: BLE001 - a wrong outcome: raised in the main thread
            failures.append(exc)

    def first() -> None:
        try:
            capture_into(8, lambda: (started.set(), b_leased.wait(5)))
        finally:
            started.set()

    def second() -> None:
        started.wait(5)
        try:
            pools.lease(4)  # the second key's space, made while the first capture runs
        except hal.HalError as exc:
            if not be.faults.fired:
                failures.append(exc)
            return
        finally:
            b_leased.set()
        capture_into(4, lambda: None)

    try:
        threads = [threading.Thread(target=first), threading.Thread(target=second)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if failures:
            raise failures[0]
        gc.collect()
        holds_exactly(be, pools, len(kept))
        be.faults.clear()
        for graph, x, out in kept.values():
            x.copy_(torch.randn(*x.shape))
            be.replay(graph)
            torch.testing.assert_close(out, step(step(x)))
    finally:
        be.faults.clear()
        for graph, _, _ in kept.values():
            release(be, graph)
        kept.clear()
        gc.collect()
        close_twice(pools.close)


def update_scenario(be: hal.Backend) -> None:
    """An RL weight update: pause, ``resume(restore=False)`` and write the weights again. A failed resume leaves
    the tag paused with the backup of its pause: the last ``resume()`` brings the weights back bit-exact."""
    saver = graphkit.MemorySaver(be)
    bufs: list[graphkit.ElasticBuffer] = []
    weights = [torch.arange(2 * G // 4, dtype=torch.int32) + i for i in range(2)]

    def write() -> None:
        for buf, w in zip(bufs, weights, strict=True):
            buf.view(torch.int32, (w.numel(),)).copy_(w)

    try:
        for _ in weights:
            bufs.append(graphkit.ElasticBuffer(be, max_bytes=4 * G, saver=saver, tag="weights", backup=True))
            bufs[-1].resize(2 * G)
        write()
        for _ in range(2):
            with faulted(be):
                saver.pause("weights")
            try:
                saver.resume("weights", restore=False)
            except hal.HalError as exc:
                assert be.faults.fired, exc
                break  # paused still, with the backup of its pause: the resume below restores it
            write()
        be.faults.clear()
        saver.resume("weights")
        intact = [torch.equal(buf.view(torch.int32, (w.numel(),)), w) for buf, w in zip(bufs, weights, strict=True)]
        assert all(intact), intact  # no view outlives the check: a close that refuses would hide a failure
    finally:
        be.faults.clear()
        gc.collect()
        for buf in bufs:
            close_twice(buf.close)
        close_twice(saver.close)


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
        kept = pools.pool("kept")  # a key kept for later captures
        for _ in range(2):
            with faulted(be):
                saver.pause()
            if pools.allocator is not None and pools.allocator.paused:  # its pool would hand out unmapped memory
                refused = be.create_graph()
                graphs.append(refused)
                with pytest.raises(hal.InvalidStateError, match="paused"), be.capture(refused, pool=kept):
                    pass
            with faulted(be):
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
        intact = torch.equal(view, torch.arange(view.numel(), dtype=torch.int32))
        del view, out  # before the check: a close refusing a live view would hide its failure
        assert intact
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
             "runner": runner_scenario, "pools": pools_scenario, "sleep": sleep_scenario,
             "threads": threads_scenario, "update": update_scenario}


def run(scenario: str, be: hal.Backend) -> None:
    """A hal error out of the scenario is an accepted outcome once a fault fired (a wrong result, another error
    or a hal error with no fault behind it is not)."""
    with faulted(be):
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
    """How often each hook is called in a run of the scenario without faults (which must raise nothing)."""
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
            with faulted(be):
                saver.pause()
            with faulted(be):
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
