"""A vLLM-style custom all-reduce reading graph buffers in place over graphkit memory (graphkit.graphs.allreduce),
on fake, two processes.

``VllmStyleOps`` keeps the books of the C++ class that vLLM, FlashInfer and SGLang share
(``vllm_custom_all_reduce.cuh``): a captured call takes the next free slot of ``rank_data`` and notes the buffer;
the library's own registration asks for legacy IPC handles, which the driver refuses on memory mapped through
its virtual memory API -- here: on graphkit memory; :meth:`VllmStyleOps.kernel` reads a slot as the kernel does
(eight addresses, one per rank) and sums the ranks' buffers.
"""

from __future__ import annotations

import ctypes
import importlib
import json
import logging
import multiprocessing
import os
import socket
import struct
import sys
import traceback
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import graphkit
import hal
from graphkit import switch
from graphkit.graphs.allreduce import CALLS, SLOT_BYTES, ServedAllReduce, serve, serve_on_import
from graphkit.memory.allocator import allocator_holding
from tests.conftest import G
from tests.graphkit.memory.test_peers import gather

COUNT = 1024  # int32 elements per all-reduce


class VllmStyleOps:
    """The calls of a vLLM-style all-reduce binding and its C++ class's bookkeeping (see the module's text)."""

    def __init__(self, be: hal.Backend) -> None:
        self.be = be
        self.state: dict[int, dict[str, Any]] = {}
        self.own_meta_calls = 0

    def init_custom_ar(self, ipc_ptrs: list[int], rank_data: torch.Tensor, rank: int, full_nvlink: bool) -> int:
        fa = 100 + len(self.state)
        self.state[fa] = {"base": rank_data.data_ptr(), "unregistered": [], "world": len(ipc_ptrs)}
        return fa

    def register_buffer(self, fa: int, ptrs: list[int]) -> None:
        st = self.state[fa]
        ctypes.memmove(st["base"], struct.pack("=8Q", *ptrs, *[0] * (8 - len(ptrs))), SLOT_BYTES)
        st["base"] += SLOT_BYTES

    def all_reduce(self, fa: int, inp: torch.Tensor, out: torch.Tensor, reg_buffer: int, reg_bytes: int,
                   num_ctas: int) -> None:
        st = self.state[fa]
        assert self.be.capturing(), "this emulation runs registered buffers in graphs only"
        st["unregistered"].append(reg_buffer or inp.data_ptr())

    def get_graph_buffer_ipc_meta(self, fa: int) -> tuple[list[int], list[int]]:
        self.own_meta_calls += 1
        for ptr in self.state[fa]["unregistered"]:
            if allocator_holding(ptr) is not None:
                raise RuntimeError("CUDA error: invalid argument (cudaIpcGetMemHandle)")
        return [7] * 64 * len(self.state[fa]["unregistered"]), [0] * len(self.state[fa]["unregistered"])

    def register_graph_buffers(self, fa: int, handles: list[list[int]], offsets: list[list[int]]) -> None:
        st = self.state[fa]
        st["base"] += SLOT_BYTES * len(st["unregistered"])
        st["unregistered"].clear()

    def dispose(self, fa: int) -> None:
        del self.state[fa]

    @staticmethod
    def kernel(slot: int, world: int) -> list[int]:
        """The sum over the ranks of the int32 buffers slot ``slot`` names (the kernel's read, in place)."""
        ptrs = struct.unpack("=8Q", ctypes.string_at(slot, SLOT_BYTES))[:world]
        rows = [torch.frombuffer(bytearray(ctypes.string_at(p, 4 * COUNT)), dtype=torch.int32) for p in ptrs]
        return sorted(set(torch.stack(rows).sum(0).tolist()))


def capture_all_reduce(be: hal.Backend, ops: Any, fa: int, inp: torch.Tensor) -> None:
    """One graph whose all-reduce reads ``inp`` (the engine's capture, cut to the call that matters)."""
    graph = be.create_graph()
    with be.capture(graph):
        ops.all_reduce(fa, inp, inp, 0, 0, 36)


def register(ops: Any, fa: int, sock: socket.socket, rank: int) -> None:
    """What the engine does after its captures, on every rank: the handles, an all-gather, the registration."""
    handles, offsets = ops.get_graph_buffer_ipc_meta(fa)
    every = [json.loads(d) for d in gather(sock, rank, json.dumps([handles, offsets]).encode())]
    ops.register_graph_buffers(fa, [h for h, _ in every], [o for _, o in every])


def rank_steps(rank: int, sock: socket.socket) -> None:
    sync = lambda: gather(sock, rank, b".")  # noqa: E731 - a barrier
    be = hal.get_backend("fake", granularity=G)
    alloc = graphkit.SharedVMMAllocator(be, reserve_bytes=64 * G)
    saver = graphkit.MemorySaver(be)
    saver.adopt(alloc)
    ops = VllmStyleOps(be)
    serving = serve(ops, backend=be, timeout=30)
    rank_data = torch.zeros(16 * SLOT_BYTES, dtype=torch.uint8)
    fa = ops.init_custom_ar([0, 0], rank_data, rank, True)
    ops.register_buffer(fa, [1, 2])  # the staging buffer: slot 0
    tensor = lambda ptr: be.tensor_at(ptr, 4 * COUNT).view(torch.int32)  # noqa: E731
    first = alloc.switch_to_new_virtual_space()
    one = tensor(alloc.allocate(4 * COUNT))
    capture_all_reduce(be, ops, fa, one)  # slot 1
    alloc.switch_to_new_virtual_space()
    two = tensor(alloc.allocate(4 * COUNT))  # the same chunks as one
    capture_all_reduce(be, ops, fa, two)  # slot 2
    slot = lambda i: rank_data.data_ptr() + i * SLOT_BYTES  # noqa: E731
    register(ops, fa, sock, rank)
    assert ops.own_meta_calls == 0  # served: the library's legacy IPC never asked
    one.fill_(rank + 1)
    sync()
    assert ops.kernel(slot(1), 2) == [3] and ops.kernel(slot(2), 2) == [3]
    sync()
    two.fill_(10 * (rank + 1))
    sync()
    assert ops.kernel(slot(1), 2) == [30]  # both keys read the same chunks, on every rank

    # after the registration key one's survivor is held off (its granule stays shared: the peers map it); a
    # later key's survivor on the same granule gets a copy of its own, and the next registration maps that
    sync()
    alloc.keep_private(first, [(one.data_ptr(), 4 * COUNT)])
    third = alloc.switch_to_new_virtual_space()
    three = tensor(alloc.allocate(4 * COUNT))
    capture_all_reduce(be, ops, fa, three)  # slot 3
    alloc.keep_private(third, [(three.data_ptr(), 4 * COUNT)])
    register(ops, fa, sock, rank)
    three.fill_(100 * (rank + 1))
    two.fill_(rank + 1)
    sync()
    assert ops.kernel(slot(1), 2) == [3] and ops.kernel(slot(2), 2) == [3] and ops.kernel(slot(3), 2) == [300]

    # sleep: the peers' chunks go with the rank's own; after the resume, the same slots read the new chunks
    sync()
    saver.pause()
    assert be.live.chunks == 0, be.live
    saver.resume()
    three.fill_(1000 * (rank + 1))
    two.fill_(7 * (rank + 1))
    sync()
    assert ops.kernel(slot(3), 2) == [3000] and ops.kernel(slot(1), 2) == [21] and ops.kernel(slot(2), 2) == [21]
    sync()

    serving.close()
    assert all(getattr(ops, name).__func__ is getattr(VllmStyleOps, name) for name in CALLS)
    ops.dispose(fa)
    saver.close()
    alloc.close()
    be.close()
    assert be.live.zero, be.live


def two_allocators_steps(rank: int, sock: socket.socket) -> None:
    """Buffers of one all-reduce in two allocators, one asleep with a saver (a block's), one not (the switch's):
    each peer buffer is mapped by the peer memory of the allocator of this rank's buffer at the same place, so
    the sleeping one's follow the sleep."""
    sync = lambda: gather(sock, rank, b".")  # noqa: E731 - a barrier
    be = hal.get_backend("fake", granularity=G)
    awake, sleeper = (graphkit.SharedVMMAllocator(be, reserve_bytes=16 * G) for _ in range(2))
    saver = graphkit.MemorySaver(be)
    saver.adopt(sleeper)
    ops = VllmStyleOps(be)
    serving = serve(ops, backend=be, timeout=30)
    rank_data = torch.zeros(4 * SLOT_BYTES, dtype=torch.uint8)
    fa = ops.init_custom_ar([0, 0], rank_data, rank, True)
    buffers = []
    for allocator in (awake, sleeper):
        allocator.switch_to_new_virtual_space()
        buffers.append(be.tensor_at(allocator.allocate(4 * COUNT), 4 * COUNT).view(torch.int32))
        capture_all_reduce(be, ops, fa, buffers[-1])
        register(ops, fa, sock, rank)  # the second registration publishes both, one set per allocator
    sync()
    saver.pause()
    saver.resume()
    for i, buffer in enumerate(buffers):
        buffer.fill_((10 * i + 1) * (rank + 1))
    sync()
    assert ops.kernel(rank_data.data_ptr(), 2) == [3] and ops.kernel(rank_data.data_ptr() + SLOT_BYTES, 2) == [33]
    sync()
    serving.close()
    saver.close()
    for allocator in (awake, sleeper):
        allocator.close()
    be.close()


def _run_rank(rank: int, sock: socket.socket, steps: Any = None) -> None:
    try:
        sock.settimeout(60)
        (steps or rank_steps)(rank, sock)
    except BaseException:  # noqa: BLE001 - reported through stderr and the exit code
        traceback.print_exc()
        os._exit(1)
    os._exit(0)


def test_two_ranks_read_each_others_graph_buffers_in_place_through_swaps_and_sleep() -> None:
    ctx = multiprocessing.get_context("fork")
    a, b = socket.socketpair(socket.AF_UNIX)
    ranks = [ctx.Process(target=_run_rank, args=(rank, s)) for rank, s in enumerate((a, b))]
    for p in ranks:
        p.start()
    try:
        for p in ranks:
            p.join(120)
    finally:
        for p in ranks:
            p.kill()
        a.close()
        b.close()
    assert [p.exitcode for p in ranks] == [0, 0]


# -- one process ----------------------------------------------------------------------------------------------


@pytest.fixture
def alloc(be: hal.Backend) -> Iterator[graphkit.SharedVMMAllocator]:
    with graphkit.SharedVMMAllocator(be, reserve_bytes=64 * G) as allocator:
        yield allocator


def test_without_serving_the_librarys_registration_is_refused_on_graphkit_memory(
        be: hal.Backend, alloc: graphkit.SharedVMMAllocator) -> None:
    ops = VllmStyleOps(be)
    fa = ops.init_custom_ar([0, 0], torch.zeros(4 * SLOT_BYTES, dtype=torch.uint8), 0, True)
    alloc.switch_to_new_virtual_space()
    capture_all_reduce(be, ops, fa, be.tensor_at(alloc.allocate(4 * COUNT), 4 * COUNT).view(torch.int32))
    with pytest.raises(RuntimeError, match="cudaIpcGetMemHandle"):
        ops.get_graph_buffer_ipc_meta(fa)


def test_memory_outside_graphkit_goes_to_the_library_and_is_refused_after_a_graphkit_registration(
        be: hal.Backend, alloc: graphkit.SharedVMMAllocator) -> None:
    ops = VllmStyleOps(be)
    with serve(ops, backend=be, timeout=5):
        rank_data = torch.zeros(4 * SLOT_BYTES, dtype=torch.uint8)
        fa = ops.init_custom_ar([0], rank_data, 0, True)
        outside = torch.zeros(COUNT, dtype=torch.int32)
        capture_all_reduce(be, ops, fa, outside)
        handles, offsets = ops.get_graph_buffer_ipc_meta(fa)  # the library's own answer
        assert ops.own_meta_calls == 1 and handles == [7] * 64
        ops.register_graph_buffers(fa, [handles], [offsets])
        alloc.switch_to_new_virtual_space()
        inside = be.tensor_at(alloc.allocate(4 * COUNT), 4 * COUNT).view(torch.int32)
        capture_all_reduce(be, ops, fa, inside)  # slot 1: the library moved past slot 0
        handles, offsets = ops.get_graph_buffer_ipc_meta(fa)
        ops.register_graph_buffers(fa, [handles], [offsets])
        inside.fill_(5)
        assert ops.kernel(rank_data.data_ptr() + SLOT_BYTES, 1) == [5]
        capture_all_reduce(be, ops, fa, outside)
        with pytest.raises(hal.InvalidStateError, match="outside graphkit memory"):
            ops.get_graph_buffer_ipc_meta(fa)


def test_a_binding_without_the_calls_is_refused_by_name() -> None:
    with pytest.raises(hal.InvalidArgumentError, match="lacks register_graph_buffers"):
        serve(type("Ops", (), {n: staticmethod(lambda *a: None) for n in CALLS if n != "register_graph_buffers"})())


# -- served from its import on (the switch's allreduce= option) -------------------------------------------------

BINDING = "\n".join(f"def {name}(*args):\n    return ('library', {name!r})\n" for name in CALLS)

FLASHINFER_VLLM_AR = """
import functools
from types import SimpleNamespace

@functools.cache
def get_vllm_comm_module():
    return SimpleNamespace(**{name: (lambda *args, _n=name: ("library", _n)) for name in NAMES})

def dispose(fa):
    return get_vllm_comm_module().dispose(fa)
""".replace("NAMES", repr(CALLS))


@pytest.fixture
def fresh_modules(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> Any:
    """``tmp_path`` on the import path; what a test imports from it is forgotten after, and so is a finder."""
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    before = set(sys.modules)
    yield tmp_path
    for name in set(sys.modules) - before:
        del sys.modules[name]


def test_a_binding_module_is_served_once_it_is_imported(fresh_modules: Any) -> None:
    (fresh_modules / "gk_vllm_style_ops.py").write_text(BINDING)
    serve_on_import("gk_vllm_style_ops")
    serve_on_import("gk_vllm_style_ops")  # once: one finder
    assert sum(type(f).__name__ == "_ServeOnImport" for f in sys.meta_path) == 1
    ops = importlib.import_module("gk_vllm_style_ops")
    assert isinstance(ops.all_reduce.__self__, ServedAllReduce)
    ops.all_reduce.__self__.close()
    assert ops.all_reduce(0, None, None) == ("library", "all_reduce")  # the library's own again


def test_flashinfers_namespace_is_served_once_built(fresh_modules: Any) -> None:
    package = fresh_modules / "flashinfer" / "comm"
    package.mkdir(parents=True)
    (fresh_modules / "flashinfer" / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "vllm_ar.py").write_text(FLASHINFER_VLLM_AR)
    serve_on_import("flashinfer")
    vllm_ar = importlib.import_module("flashinfer.comm.vllm_ar")
    namespace = vllm_ar.get_vllm_comm_module()
    assert namespace is vllm_ar.get_vllm_comm_module()  # built once, served once
    assert isinstance(namespace.register_graph_buffers.__self__, ServedAllReduce)
    assert vllm_ar.dispose(7) == ("library", "dispose")  # the module's calls go through the served namespace
    namespace.dispose.__self__.close()


def test_a_binding_without_the_calls_is_left_alone_with_a_warning(fresh_modules: Any,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    (fresh_modules / "gk_other_ops.py").write_text("def all_reduce(*args):\n    return None\n")
    importlib.import_module("gk_other_ops")
    with caplog.at_level(logging.WARNING, logger="graphkit.graphs.allreduce"):
        serve_on_import("gk_other_ops")  # imported already: served now, or refused
    assert "not served" in caplog.text and "lacks" in caplog.text


def test_the_switchs_allreduce_option_serves_the_binding_in_every_process_it_starts(fresh_modules: Any) -> None:
    options = switch.parse("1,allreduce=gk_switch_ops")
    assert options is not None and options.allreduce == "gk_switch_ops"
    (fresh_modules / "gk_switch_ops.py").write_text(BINDING)
    scope = switch.ProcessGraphMemory(options)
    try:
        ops = importlib.import_module("gk_switch_ops")
        assert isinstance(ops.init_custom_ar.__self__, ServedAllReduce)
        ops.init_custom_ar.__self__.close()
    finally:
        scope.stop()
    with pytest.raises(hal.InvalidArgumentError, match="allreduce="):
        switch.parse("allreduce=not-a-module")


def test_buffers_in_two_allocators_follow_the_one_that_sleeps() -> None:
    ctx = multiprocessing.get_context("fork")
    a, b = socket.socketpair(socket.AF_UNIX)
    ranks = [ctx.Process(target=_run_rank, args=(rank, s, two_allocators_steps)) for rank, s in enumerate((a, b))]
    for p in ranks:
        p.start()
    try:
        for p in ranks:
            p.join(120)
    finally:
        for p in ranks:
            p.kill()
        a.close()
        b.close()
    assert [p.exitcode for p in ranks] == [0, 0]
