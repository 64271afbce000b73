"""hal.host: the public recorder a plugin wires to its memory to get graphs (fake uses it too)."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import gc
import signal
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import hal
from hal.backends.fake import FakeBackend
from hal.host import CAPABILITIES, BlockPool, HostGraph, HostGraphs, vm
from tests.conftest import G


class Renamed(FakeBackend):
    """fake's memory under another backend name: what a plugin's errors should name."""

    def __init__(self, device: int = 0, **options: Any) -> None:
        super().__init__(device, granularity=G, **options)
        self.init_host_graphs("renamed", alloc=self.device_malloc, free=self.device_free, segment_size=G)


@pytest.fixture
def be() -> Any:
    with hal.Backend("renamed", Renamed(capacity=1 << 20)) as backend:
        yield backend


def test_a_plugin_wired_to_its_memory_has_every_capability(be: hal.Backend) -> None:
    # every graph capability from the recorder, memory sharing from fake; its unmap does not wait for queued work
    assert be.capabilities == hal.CAPABILITIES - {"unmap_waits"}
    assert hal.CAPABILITIES - {"memory_sharing", "unmap_waits"} == CAPABILITIES
    x = torch.ones(256)
    graph = be.create_graph()
    assert isinstance(graph, HostGraph) and graph.backend == "renamed"
    pool = be.create_pool()
    assert isinstance(pool, BlockPool)
    with be.capture(graph, pool, be.create_stream(), inspect=True):
        y = x * 3
    x.fill_(2.0)
    be.replay(graph)
    assert torch.equal(y, torch.full((256,), 6.0))
    spans = be.graph_addresses(graph).spans
    assert any(a <= y.data_ptr() < a + n for a, n in spans)
    be.release_graph(graph)
    del y
    gc.collect()
    be.release_pool(pool)


def test_errors_name_the_plugin_not_fake(be: hal.Backend) -> None:
    x = torch.ones(4)
    for fn in (lambda: (x * 2).sum().item(), lambda: (x * 2).tolist()):
        graph = be.create_graph()
        with pytest.raises(hal.CaptureError) as info:
            with be.capture(graph, None, be.create_stream()):
                fn()
        assert info.value.backend == "renamed", info.value
        be.release_graph(graph)
    with pytest.raises(hal.InvalidStateError) as state:
        be.plugin.replay(HostGraph(backend="renamed"))
    assert state.value.backend == "renamed"


def test_ops_whose_output_shape_depends_on_the_data_are_refused_naming_the_op(be: hal.Backend) -> None:
    a, x, repeats = torch.arange(24.0).view(4, 6), torch.arange(6.0), torch.full((6,), 2)
    mask = a > 5
    cases = {"aten.index.Tensor": lambda: a[mask], "aten.bincount": lambda: torch.bincount(repeats),
             "aten.repeat_interleave.Tensor": lambda: x.repeat_interleave(repeats)}
    for op, fn in cases.items():
        graph = be.create_graph()
        with pytest.raises(hal.CaptureError, match=f"{op}.* gives an output whose shape depends on the data") as info:
            with be.capture(graph, None, be.create_stream()):
                fn()
        assert info.value.backend == "renamed"
        be.release_graph(graph)
    graph = be.create_graph()
    with be.capture(graph, None, be.create_stream()):  # the same ops with a shape known from shapes alone
        picked = a[torch.tensor([0, 2])]
        spread = x.repeat_interleave(repeats, output_size=12)
        a[mask] = 0.0  # a masked write keeps the shape
    a.copy_(torch.arange(24.0).view(4, 6) + 1)
    be.replay(graph)
    assert torch.equal(picked, (torch.arange(24.0).view(4, 6) + 1)[[0, 2]]) and spread.shape == (12,)
    assert int((a == 0).sum()) == int(mask.sum())
    be.release_graph(graph)


def test_out_of_memory_in_a_capture_is_the_devices_error(be: hal.Backend) -> None:
    x = torch.ones(1 << 19)  # 2 MiB of float32: more than the device's 1 MiB
    graph = be.create_graph()
    with pytest.raises(hal.DeviceOutOfMemoryError, match="renamed private pool: no memory for a segment") as info:
        with be.capture(graph, None, be.create_stream()):
            x * 2
    assert isinstance(info.value, MemoryError) and info.value.backend == "renamed"
    be.release_graph(graph)
    assert be.plugin._anon == {}


def test_a_failed_capture_gives_its_private_pool_back_at_once(be: hal.Backend) -> None:
    x = torch.ones(1024)
    graph = be.create_graph()
    with pytest.raises(hal.CaptureError):
        with be.capture(graph, None, be.create_stream()):
            y = x * 2
            y.sum().item()
    assert graph.own_pool is None
    del y
    gc.collect()
    assert be.plugin._anon == {}, "the failed attempt's private pool still holds device memory"
    with be.capture(graph, None, be.create_stream()):  # the same graph may be captured again
        y = x + 1
    be.replay(graph)
    assert torch.equal(y, torch.full((1024,), 2.0)) and len(be.plugin._anon) == 1
    be.release_graph(graph)
    del y
    gc.collect()
    assert be.plugin._anon == {}


def test_a_bad_segment_size_is_refused() -> None:
    with pytest.raises(hal.InvalidArgumentError, match="segment_size=0 must be a positive int") as info:
        HostGraphs().init_host_graphs("mine", alloc=lambda n: 0, free=lambda p, n: None, segment_size=0)
    assert info.value.backend == "mine" and info.value.call == "init_host_graphs"


def test_blocks_are_rounded_to_the_allocation_alignment_and_segments_to_the_segment_size() -> None:
    got: list[tuple[int, int]] = []
    freed: list[tuple[int, int]] = []
    base = 1 << 30

    def alloc(n: int) -> int:
        got.append((base + len(got) * (1 << 24), n))
        return got[-1][0]

    pool = BlockPool(alloc, lambda p, n: freed.append((p, n)), segment_size=G, name="p", backend="mine")
    a = pool.malloc(1)
    b = pool.malloc(hal.ALLOCATION_ALIGNMENT + 1)
    assert (a, b - a) == (got[0][0], hal.ALLOCATION_ALIGNMENT)
    assert pool.active_blocks() == [(a, hal.ALLOCATION_ALIGNMENT), (b, 2 * hal.ALLOCATION_ALIGNMENT)]
    big = pool.malloc(G + 1)
    assert got[1][1] == 2 * G and big == got[1][0]  # a block bigger than a segment: one of its own
    pool.free(a)
    assert pool.malloc(10) == a  # reused within the pool
    pool.free(big)
    pool.release()  # the idle segment goes back now, the busy one when its last block does
    assert freed == [got[1]]
    pool.free(a)
    pool.free(b)
    assert freed == [got[1], got[0]]


# -- graphs that cannot be captured or replayed now ----------------------------------------------------


@contextlib.contextmanager
def fails_after(seconds: float) -> Iterator[None]:
    """A block that has not ended after ``seconds`` raises ``TimeoutError`` (main thread only): a hang fails."""
    def expire(signum: int, frame: Any) -> None:
        raise TimeoutError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_a_capture_of_a_graph_inside_its_own_capture_is_refused(be: hal.Backend) -> None:
    x = torch.ones(4, 4)
    graph = be.create_graph()
    with fails_after(30), pytest.raises(hal.InvalidStateError, match="being captured already") as info:
        with be.capture(graph):
            with be.capture(graph):
                (x * 2).t()
    assert info.value.backend == "renamed" and info.value.call == "capture"
    assert graph.own_pool is None and not graph.entries
    with be.capture(graph):  # refused as a whole: the graph can be captured again
        y = (x * 2).t()
    x.fill_(3.0)
    be.replay(graph)
    assert torch.equal(y, torch.full((4, 4), 6.0))
    be.release_graph(graph)


def test_captures_of_one_device_take_turns_across_threads_and_nest_on_one(be: hal.Backend) -> None:
    """The recorder runs a capture's work as it records it: two captures at once over shared memory would run
    over each other (graphkit's spaces share chunks), so a capture from another thread waits for the device's
    turn, from its routing to its end; a capture inside a capture on the same thread goes on."""
    import threading
    import time

    order: list[str] = []
    inside = threading.Event()

    def other() -> None:
        inside.wait(10)
        graph = be.create_graph()
        with be.capture(graph):
            order.append("other runs")
        be.release_graph(graph)

    thread = threading.Thread(target=other)
    thread.start()
    outer, inner = be.create_graph(), be.create_graph()
    with be.capture(outer):
        inside.set()
        time.sleep(0.2)  # the other thread's capture asks for its turn now
        with be.capture(inner):  # nested on this thread: no wait
            torch.ones(4) * 2
        order.append("outer ends")
    thread.join(10)
    assert order == ["outer ends", "other runs"]
    for graph in (outer, inner):
        be.release_graph(graph)


def test_a_released_graph_refuses_to_replay_even_through_the_plugin(be: hal.Backend) -> None:
    x = torch.ones(4)
    graph = be.create_graph()
    with be.capture(graph):
        y = x * 2
    be.release_graph(graph)
    x.fill_(5.0)
    for replay in (be.replay, be.plugin.replay):
        with pytest.raises(hal.InvalidStateError, match=r"released \(release_graph\); capture a new graph") as info:
            replay(graph)
        assert info.value.backend == "renamed" and info.value.call == "replay"
    assert torch.equal(y, torch.full((4,), 2.0)), "the refused replay wrote its output"


def test_a_graph_whose_pool_was_released_refuses_to_replay_even_through_the_plugin(be: hal.Backend) -> None:
    x = torch.ones(1024)
    pool = be.create_pool()
    graph = be.create_graph()
    with be.capture(graph, pool=pool):
        y = x * 2  # alive, so its segment stays mapped whatever the replay does
    be.release_pool(pool)
    x.fill_(3.0)
    for replay in (be.replay, be.plugin.replay):
        with pytest.raises(hal.InvalidStateError, match="was released") as info:
            replay(graph)
        assert "capture the graph again" in str(info.value) and info.value.call == "replay"
    assert torch.equal(y, torch.full((1024,), 2.0)), "the refused replay ran"
    be.release_graph(graph)
    del y
    gc.collect()
    assert be.plugin._anon == {}, "the released pool's memory did not go back after its last tensor"


# -- the addresses a graph touches -------------------------------------------------------------------


@pytest.mark.parametrize("shape_of", [
    torch.zeros_like, torch.empty_like, torch.ones_like, torch.rand_like, lambda o: torch.full_like(o, 2.0),
    lambda o: o.new_zeros(o.shape), lambda o: o.new_empty(o.size()), lambda o: o.new_full((o.size(0),), 1.0),
    lambda o: torch.zeros(o.size()), lambda o: torch.ones(o.shape[0], o.dim())],
    ids=["zeros_like", "empty_like", "ones_like", "rand_like", "full_like", "new_zeros", "new_empty", "new_full",
         "size", "shape"])
def test_a_tensor_used_only_for_its_shape_is_not_an_address_of_the_graph(be: hal.Backend,
                                                                          shape_of: Any) -> None:
    other = torch.randn(8, 64)  # another graph's output, say
    x = torch.randn(8)
    graph = be.create_graph()
    with be.capture(graph, inspect=True):
        y = shape_of(other).sum() + x
    spans = be.graph_addresses(graph).spans
    mine = other.untyped_storage().data_ptr()
    assert not any(a <= mine < a + n for a, n in spans), "a shape-only use counts as a read of the bytes"
    assert any(a <= x.data_ptr() < a + n for a, n in spans) and any(a <= y.data_ptr() < a + n for a, n in spans)
    be.release_graph(graph)


def test_a_tensor_whose_bytes_an_op_reads_is_an_address_of_the_graph(be: hal.Backend) -> None:
    other = torch.randn(8, 64)
    for use in (lambda o: o + 0, lambda o: torch.zeros_like(o).copy_(o), lambda o: o.new_zeros(o.shape).add_(o),
                lambda o: o.t().contiguous(), lambda o: o.new_empty(0).resize_(3).copy_(o[0, :3])):
        graph = be.create_graph()
        with be.capture(graph, inspect=True):
            use(other)
        mine = other.untyped_storage().data_ptr()
        assert any(a <= mine < a + n for a, n in be.graph_addresses(graph).spans)
        be.release_graph(graph)


def test_an_integer_argument_that_could_be_an_address_is_a_bare_word_of_the_graph(be: hal.Backend) -> None:
    """As a device backend reports its kernels' argument words: whether an op dereferences one, only a replay
    tells (the verifier's confirmation); small integers (sizes, factors) are none."""
    x = torch.zeros(8, dtype=torch.int64)
    graph = be.create_graph()
    with be.capture(graph, inspect=True):
        (x + (1 << 40)) * 3
    spans = be.graph_addresses(graph).spans
    assert (1 << 40, 1) in spans and not any(n == 1 and a < 1 << 16 for a, n in spans)
    be.release_graph(graph)


# -- routing: hal.routing's choice, as the recorder asks for it ---------------------------------------------


def test_a_capture_takes_the_innermost_router_of_its_device_then_the_process_router(be: hal.Backend) -> None:
    from hal import routing

    pools = {name: be.create_pool() for name in ("outer", "inner", "process")}
    asked: list[tuple[str, int]] = []

    def process_router(backend: str, device: int, graph: Any, requested_pool: Any) -> hal.types.Route:
        asked.append((backend, device))
        return hal.types.Route(pools["process"])

    x = torch.ones(64)
    with hal.route_every_capture(process_router):
        assert routing.has_process_routers()
        with be.route_captures(lambda g, p: hal.types.Route(pools["outer"])), \
                be.route_captures(lambda g, p: None), \
                be.route_captures(lambda g, p: hal.types.Route(pools["inner"])):
            inner = be.create_graph()
            with be.capture(inner):
                y = x * 2
        with be.route_captures(lambda g, p: None):  # passed on by the device's only router
            free = be.create_graph()
            with be.capture(free):
                z = x * 3
    assert not routing.has_process_routers()
    assert asked == [("renamed", 0)]  # only for the capture no router of the device took
    assert be.pool_active_blocks(pools["inner"]) and be.pool_active_blocks(pools["process"])
    assert not be.pool_active_blocks(pools["outer"])
    refused = be.create_graph()
    returns_a_str = be.route_captures(lambda g, p: "a pool")
    with returns_a_str, pytest.raises(hal.InvalidArgumentError, match=r"must return a hal\.types\.Route"):
        with be.capture(refused):
            pass
    del y, z
    for graph in (inner, free, refused):
        be.release_graph(graph)


# -- a plugin's mistakes, named ----------------------------------------------------------------------------


def test_a_plugin_that_forgot_init_host_graphs_is_told_what_to_call() -> None:
    class NoInit(HostGraphs):
        def __init__(self, device: int = 0) -> None:
            self.device = device  # and no init_host_graphs

    with hal.Backend("noinit", NoInit()) as backend:
        for call in (backend.create_graph, backend.create_pool, lambda: backend.capture(HostGraph()).__enter__()):
            with pytest.raises(hal.PluginValidationError, match=r"did not call self\.init_host_graphs\(name, "
                                                                r"alloc=\.\.\., free=\.\.\., segment_size=\.\.\.\)"):
                call()
    assert not hasattr(NoInit(), "no_such_attribute")  # other attributes still say AttributeError


# -- hal.host.vm: the OS's virtual memory, for a host-like device ---------------------------------------------


def test_vm_maps_one_chunk_at_two_addresses_and_unmaps_back_to_a_reservation() -> None:
    g = 4 * vm.PAGE_SIZE
    fd = vm.create_chunk(g, backend="mine")
    va = vm.reserve(3 * g, 2 * g, backend="mine")
    assert va % (2 * g) == 0
    vm.map_chunk(va, g, fd, backend="mine")
    vm.map_chunk(va + 2 * g, g, fd, backend="mine")
    ctypes.memmove(va + 5, b"host vm", 7)
    assert ctypes.string_at(va + 2 * g + 5, 7) == b"host vm"  # one chunk, two addresses
    vm.unmap_chunk(va + 2 * g, g, backend="mine")
    vm.map_chunk(va + 2 * g, g, fd, backend="mine")  # still reserved: the same address maps again
    assert ctypes.string_at(va + 2 * g + 5, 7) == b"host vm"
    for ptr in (va, va + 2 * g):
        vm.unmap_chunk(ptr, g, backend="mine")
    vm.release(va, 3 * g, backend="mine")
    vm.release_chunk(fd, backend="mine")
    ptr = vm.alloc(100, backend="mine")
    ctypes.memset(ptr, 1, 100)
    vm.free(ptr, 100, backend="mine")


def test_vm_errors_are_hal_errors_naming_the_backend_and_the_hook() -> None:
    with pytest.raises(hal.InvalidArgumentError, match=f"size=100 must be a positive multiple of the page size "
                                                       f"{vm.PAGE_SIZE}") as bad:
        vm.reserve(100, backend="mine")
    assert (bad.value.backend, bad.value.call) == ("mine", "create_vir_ptr")
    with pytest.raises(hal.DeviceOutOfMemoryError, match="mmap") as full:  # more address space than there is
        vm.reserve(1 << 62, backend="mine")
    assert isinstance(full.value, MemoryError) and full.value.call == "create_vir_ptr"
    for size in (1 << 70, (1 << 64) + vm.PAGE_SIZE, (1 << 64) - vm.PAGE_SIZE):  # size + alignment would wrap
        with pytest.raises(hal.InvalidArgumentError, match="together they pass 2\\*\\*64 bytes"):
            vm.reserve(size, backend="mine")
    with pytest.raises(hal.InvalidArgumentError, match="below 2\\*\\*64"):
        vm.alloc(1 << 64, backend="mine")
    with pytest.raises(hal.DriverError) as driver:
        vm.release_chunk(-1, backend="mine")
    assert (driver.value.code, driver.value.code_name, driver.value.native_call) == (errno.EBADF, "EBADF", "close")
    assert driver.value.backend == "mine" and driver.value.call == "release_phy_mem_handle"


def test_the_plugin_guide_lists_every_public_helper_of_hal_host_vm() -> None:
    import inspect

    from tests.paths import ROOT

    text = (ROOT / "docs" / "plugins.md").read_text()
    section = text[text.index("### Host memory as a device: `hal.host.vm`"):]
    section = section[:section.index("\n## ")]
    public = sorted(name for name, obj in vars(vm).items()
                    if not name.startswith("_") and inspect.isfunction(obj) and obj.__module__ == vm.__name__)
    assert sorted(set(public) - set(vm.__all__)) == []  # every public helper is exported
    missing = [name for name in public if f"`{name}(" not in section and f"vm.{name}()" not in section]
    assert not missing, f"docs/plugins.md does not list {missing}"


def test_an_imported_chunk_is_not_charged_to_the_importers_capacity() -> None:
    import os

    with hal.get_backend("fake", granularity=G) as exporter, \
            hal.get_backend("fake", granularity=G, capacity=4 * G) as importer:
        handle = exporter.create_phy_mem_handle(2 * G)
        fd = exporter.export_phy_mem_handle(handle)
        try:
            free = importer.mem_info().free
            imported = importer.import_phy_mem_handle(fd, 2 * G)
        finally:
            os.close(fd)
        assert importer.mem_info().free == free == 4 * G  # the exporter counted those bytes
        importer.release_phy_mem_handle(imported)
        assert importer.mem_info().free == 4 * G  # and its release gives nothing back that was not taken
        exporter.release_phy_mem_handle(handle)
