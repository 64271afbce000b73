"""The conformance suite: the vmm half of the hal contract, through the facade only.

Run it against any installed backend::

    python -m pytest --pyargs hal.testing --hal-backend NAME [--hal-option KEY=VALUE ...]

or, from a plugin's own test directory, with one file::

    from hal.testing.suite import *  # noqa: F401,F403

    @pytest.fixture(scope="session")
    def hal_backend_name() -> str:
        return "mybackend"

The fixtures (``hal_backend``, ``hal_memory``...) come from :mod:`hal.testing.plugin`.
The graph half (streams, pools, capture, replay, routing) lives in
:mod:`hal.testing.graph_suite` and comes with the same import; its tests
skip, naming the capability, on backends that do not declare it.
"""

from __future__ import annotations

import functools
import itertools
import os
from collections.abc import Callable
from typing import Any

import pytest

import hal
from hal.api import VMM_HOOKS
from hal.testing.graph_suite import *  # noqa: F403  (the graph half)
from hal.testing.graph_suite import __all__ as _GRAPH_TESTS
from hal.testing.memory import MemoryAccess, memory_access, torch_access
from hal.testing.requirements import Requirements
from hal.testing.state import snapshot
from hal.types import round_up

__all__ = [
    "TestQueries",
    "TestReserveCreateMap",
    "TestAliasing",
    "TestErrors",
    "TestOutOfMemory",
    "TestFaultRollback",
    "TestMemorySharing",
    "TestLifecycle",
    "TestStateMachine",
    *_GRAPH_TESTS,
]

PROBE = 64  # bytes written at each probed offset


def pattern(tag: int, size: int = PROBE) -> bytes:
    """``size`` bytes that differ for every ``tag``."""
    return bytes((tag * 37 + i * 11 + 1) % 256 for i in range(size))


def probe_offsets(size: int) -> list[int]:
    """Offsets that cover the start, the middle and the end of a chunk of ``size`` bytes."""
    return sorted({0, (size // 2) // PROBE * PROBE, size - PROBE})


def expect(be: hal.Backend, error: type[hal.HalError], call: str, fn: Callable[[], Any],
           *, from_driver: bool = False) -> hal.HalError:
    """``fn()`` raises ``error`` naming the backend and ``call``, and nothing live changes.

    Errors the facade raises carry ``be.name``; ``from_driver`` errors only need to name a backend.
    """
    before = snapshot(be)
    with pytest.raises(error) as info:
        fn()
    assert (info.value.backend if from_driver else info.value.backend == be.name), info.value
    assert info.value.call == call, info.value
    assert snapshot(be) == before, f"{call} failed but changed the bookkeeping"
    return info.value


class TestQueries:
    """Granularity, device count, memory info."""

    def test_minimum_granularity_is_positive(self, hal_backend: hal.Backend) -> None:
        g = hal_backend.granularity
        assert isinstance(g, int) and g > 0

    def test_recommended_granularity_is_a_multiple(self, hal_backend: hal.Backend) -> None:
        rec = hal_backend.recommended_granularity
        assert rec >= hal_backend.granularity
        assert rec % hal_backend.granularity == 0

    def test_device_count(self, hal_backend: hal.Backend) -> None:
        count = hal_backend.device_count()
        assert isinstance(count, int) and count >= 1
        assert 0 <= hal_backend.device < count

    def test_mem_info(self, hal_backend: hal.Backend) -> None:
        info = hal_backend.mem_info()
        assert isinstance(info, hal.MemInfo)
        assert info.total > 0
        assert 0 <= info.free <= info.total


class TestReserveCreateMap:
    """Round trips of the six vmm calls, checked by the accounting wrapper."""

    def test_reserve_is_aligned_and_released(self, hal_backend: hal.Backend) -> None:
        be, g = hal_backend, hal_backend.granularity
        va = be.create_vir_ptr(4 * g)
        assert va > 0 and va % g == 0
        assert (be.live.ranges, be.live.reserved_bytes) == (1, 4 * g)
        be.release_vir_ptr(va, 4 * g)
        assert be.live.zero

    def test_reservations_do_not_overlap(self, hal_backend: hal.Backend) -> None:
        be, g = hal_backend, hal_backend.granularity
        ranges = sorted((be.create_vir_ptr(n * g), n * g) for n in (1, 3, 2))
        for (lo, size), (next_lo, _) in itertools.pairwise(ranges):
            assert lo + size <= next_lo, "two live reservations overlap"
        for ptr, size in ranges:
            be.release_vir_ptr(ptr, size)
        assert be.live.zero

    def test_create_and_release_chunks(self, hal_backend: hal.Backend) -> None:
        be, g = hal_backend, hal_backend.granularity
        handles = [be.create_phy_mem_handle(g), be.create_phy_mem_handle(2 * g)]
        assert len(set(handles)) == 2, "two live chunks share a handle"
        assert (be.live.chunks, be.live.chunk_bytes) == (2, 3 * g)
        for h in handles:
            be.release_phy_mem_handle(h)
        assert be.live.zero

    def test_map_and_unmap(self, hal_backend: hal.Backend) -> None:
        be, g = hal_backend, hal_backend.granularity
        va = be.create_vir_ptr(4 * g)
        h = be.create_phy_mem_handle(2 * g)
        be.map(va + g, 2 * g, h)
        assert (be.live.mappings, be.live.mapped_bytes) == (1, 2 * g)
        be.unmap(va + g, 2 * g)
        assert be.live.mappings == 0
        be.release_phy_mem_handle(h)
        be.release_vir_ptr(va, 4 * g)
        assert be.live.zero

    def test_chunks_side_by_side_fill_a_range(self, hal_backend: hal.Backend) -> None:
        be, g = hal_backend, hal_backend.granularity
        va = be.create_vir_ptr(4 * g)
        handles = [be.create_phy_mem_handle(g) for _ in range(4)]
        for i, h in enumerate(handles):
            be.map(va + i * g, g, h)
        assert (be.live.mappings, be.live.mapped_bytes) == (4, 4 * g)
        for i in range(4):
            be.unmap(va + i * g, g)
        for h in handles:
            be.release_phy_mem_handle(h)
        be.release_vir_ptr(va, 4 * g)
        assert be.live.zero

    def test_one_chunk_mapped_into_many_ranges(self, hal_backend: hal.Backend) -> None:
        be, g = hal_backend, hal_backend.granularity
        h = be.create_phy_mem_handle(g)
        spaces = [be.create_vir_ptr(2 * g) for _ in range(3)]
        for va in spaces:
            be.map(va, g, h)
        assert be.live.mappings == 3 and be.live.chunks == 1
        with pytest.raises(hal.InvalidStateError):
            be.release_phy_mem_handle(h)
        for va in spaces:
            be.unmap(va, g)
            be.release_vir_ptr(va, 2 * g)
        be.release_phy_mem_handle(h)
        assert be.live.zero


class TestAliasing:
    """Bytes written through one mapping are read through another mapping of the same chunk."""

    def test_write_through_one_range_read_through_another(
        self, hal_backend: hal.Backend, hal_memory: MemoryAccess
    ) -> None:
        be, g, mem = hal_backend, hal_backend.granularity, hal_memory
        size = 2 * g
        h = be.create_phy_mem_handle(size)
        va1, va2 = be.create_vir_ptr(4 * g), be.create_vir_ptr(4 * g)
        be.map(va1, size, h)
        be.map(va2 + 2 * g, size, h)
        for i, off in enumerate(probe_offsets(size)):
            mem.write(va1 + off, pattern(i))
        for i, off in enumerate(probe_offsets(size)):
            assert mem.read(va2 + 2 * g + off, PROBE) == pattern(i), f"offset {off} does not alias"
        mem.write(va2 + 2 * g + size - PROBE, pattern(99))  # and back the other way
        assert mem.read(va1 + size - PROBE, PROBE) == pattern(99)

    def test_distinct_chunks_do_not_alias(self, hal_backend: hal.Backend, hal_memory: MemoryAccess) -> None:
        be, g, mem = hal_backend, hal_backend.granularity, hal_memory
        va = be.create_vir_ptr(2 * g)
        h1, h2 = be.create_phy_mem_handle(g), be.create_phy_mem_handle(g)
        be.map(va, g, h1)
        be.map(va + g, g, h2)
        mem.write(va, pattern(1))
        mem.write(va + g, pattern(2))
        assert mem.read(va, PROBE) == pattern(1)
        assert mem.read(va + g, PROBE) == pattern(2)

    def test_spaces_over_the_same_chunks(self, hal_backend: hal.Backend, hal_memory: MemoryAccess) -> None:
        """The allocator's pattern: every space maps the same chunks in the same order."""
        be, g, mem = hal_backend, hal_backend.granularity, hal_memory
        handles = [be.create_phy_mem_handle(g) for _ in range(2)]
        spaces = [be.create_vir_ptr(2 * g) for _ in range(3)]
        for va in spaces:
            for i, h in enumerate(handles):
                be.map(va + i * g, g, h)
        mem.write(spaces[-1] + g + PROBE, pattern(7))
        for va in spaces:
            assert mem.read(va + g + PROBE, PROBE) == pattern(7)

    def test_data_survives_unmap_and_remap(self, hal_backend: hal.Backend, hal_memory: MemoryAccess) -> None:
        be, g, mem = hal_backend, hal_backend.granularity, hal_memory
        h = be.create_phy_mem_handle(g)
        va1, va2 = be.create_vir_ptr(g), be.create_vir_ptr(3 * g)
        be.map(va1, g, h)
        mem.write(va1 + g - PROBE, pattern(5))
        be.unmap(va1, g)
        assert be.live.mappings == 0
        be.map(va2 + 2 * g, g, h)  # elsewhere
        assert mem.read(va2 + 3 * g - PROBE, PROBE) == pattern(5)
        be.unmap(va2 + 2 * g, g)
        be.map(va1, g, h)  # and back where it was
        assert mem.read(va1 + g - PROBE, PROBE) == pattern(5)

    def test_alias_through_torch(self, hal_backend: hal.Backend) -> None:
        """Tensors at two mappings of one chunk see each other's writes."""
        access, reason = torch_access(hal_backend)
        if access is None:
            pytest.skip(reason)
        be, g = hal_backend, hal_backend.granularity
        h = be.create_phy_mem_handle(g)
        va1, va2 = be.create_vir_ptr(g), be.create_vir_ptr(2 * g)
        be.map(va1, g, h)
        be.map(va2 + g, g, h)
        a, b = access.tensor_at(va1, g), access.tensor_at(va2 + g, g)
        a.fill_(42)
        assert int(b.min()) == int(b.max()) == 42
        b[-1] = 7
        assert int(a[-1]) == 7
        del a, b


class TestErrors:
    """Every misuse the facade refuses, with the error class, backend and call, and no side effect."""

    @pytest.fixture
    def mapped(self, hal_backend: hal.Backend) -> tuple[hal.Backend, int, int, Any]:
        """A 4-granule range with a 2-granule chunk mapped at its start."""
        be, g = hal_backend, hal_backend.granularity
        va, h = be.create_vir_ptr(4 * g), be.create_phy_mem_handle(2 * g)
        be.map(va, 2 * g, h)
        return be, g, va, h

    def test_misaligned_map(self, hal_backend: hal.Backend) -> None:
        be, g = hal_backend, hal_backend.granularity
        if g == 1:
            pytest.skip("granularity 1: every address is aligned")
        va, h = be.create_vir_ptr(4 * g), be.create_phy_mem_handle(g)
        expect(be, hal.InvalidArgumentError, "map", lambda: be.map(va + 1, g, h))
        expect(be, hal.InvalidArgumentError, "map", lambda: be.map(va + g // 2, g, h))
        be.map(va + g, g, h)  # still usable

    @pytest.mark.parametrize("call", ["create_vir_ptr", "create_phy_mem_handle"])
    def test_size_not_a_multiple_of_granularity(self, hal_backend: hal.Backend, call: str) -> None:
        be, g = hal_backend, hal_backend.granularity
        fn = getattr(be, call)
        for size in {g + 1, 2 * g - 1, g // 2} if g > 1 else ():
            expect(be, hal.InvalidArgumentError, call, functools.partial(fn, size))
        for size in (0, -g):
            expect(be, hal.InvalidArgumentError, call, functools.partial(fn, size))
        fn(g)  # a right size still works

    def test_map_size_must_equal_chunk_size(self, hal_backend: hal.Backend) -> None:
        be, g = hal_backend, hal_backend.granularity
        va, h = be.create_vir_ptr(4 * g), be.create_phy_mem_handle(2 * g)
        expect(be, hal.InvalidArgumentError, "map", lambda: be.map(va, g, h))
        expect(be, hal.InvalidArgumentError, "map", lambda: be.map(va, 4 * g, h))

    def test_map_outside_a_reserved_range(self, hal_backend: hal.Backend) -> None:
        be, g = hal_backend, hal_backend.granularity
        va, h = be.create_vir_ptr(4 * g), be.create_phy_mem_handle(2 * g)
        expect(be, hal.InvalidArgumentError, "map", lambda: be.map(va + 4 * g, 2 * g, h))  # just past the end
        expect(be, hal.InvalidArgumentError, "map", lambda: be.map(va + 3 * g, 2 * g, h))  # straddles the end
        expect(be, hal.InvalidArgumentError, "map", lambda: be.map(va - 2 * g, 2 * g, h))  # before the start

    def test_map_of_a_released_handle(self, hal_backend: hal.Backend) -> None:
        be, g = hal_backend, hal_backend.granularity
        va, h = be.create_vir_ptr(g), be.create_phy_mem_handle(g)
        be.release_phy_mem_handle(h)
        expect(be, hal.InvalidStateError, "map", lambda: be.map(va, g, h))

    def test_map_over_a_live_mapping(self, mapped: tuple[hal.Backend, int, int, Any]) -> None:
        be, g, va, _ = mapped
        other = be.create_phy_mem_handle(2 * g)
        expect(be, hal.InvalidStateError, "map", lambda: be.map(va + g, 2 * g, other))  # overlaps
        be.map(va + 2 * g, 2 * g, other)  # right after it is fine

    def test_release_handle_twice(self, hal_backend: hal.Backend) -> None:
        be, g = hal_backend, hal_backend.granularity
        h = be.create_phy_mem_handle(g)
        be.release_phy_mem_handle(h)
        expect(be, hal.InvalidStateError, "release_phy_mem_handle", lambda: be.release_phy_mem_handle(h))

    def test_release_a_mapped_handle(self, mapped: tuple[hal.Backend, int, int, Any]) -> None:
        be, _, _, h = mapped
        expect(be, hal.InvalidStateError, "release_phy_mem_handle", lambda: be.release_phy_mem_handle(h))

    def test_release_range_twice(self, hal_backend: hal.Backend) -> None:
        be, g = hal_backend, hal_backend.granularity
        va = be.create_vir_ptr(2 * g)
        be.release_vir_ptr(va, 2 * g)
        expect(be, hal.InvalidStateError, "release_vir_ptr", lambda: be.release_vir_ptr(va, 2 * g))

    def test_release_range_with_the_wrong_size(self, hal_backend: hal.Backend) -> None:
        be, g = hal_backend, hal_backend.granularity
        va = be.create_vir_ptr(2 * g)
        expect(be, hal.InvalidArgumentError, "release_vir_ptr", lambda: be.release_vir_ptr(va, g))

    def test_release_range_with_live_mappings(self, mapped: tuple[hal.Backend, int, int, Any]) -> None:
        be, g, va, _ = mapped
        expect(be, hal.InvalidStateError, "release_vir_ptr", lambda: be.release_vir_ptr(va, 4 * g))
        be.unmap(va, 2 * g)
        be.release_vir_ptr(va, 4 * g)

    def test_unmap_of_nothing(self, mapped: tuple[hal.Backend, int, int, Any]) -> None:
        be, g, va, _ = mapped
        expect(be, hal.InvalidStateError, "unmap", lambda: be.unmap(va + 2 * g, 2 * g))  # reserved, unmapped
        expect(be, hal.InvalidStateError, "unmap", lambda: be.unmap(va + g, g))  # inside a mapping
        be.unmap(va, 2 * g)
        expect(be, hal.InvalidStateError, "unmap", lambda: be.unmap(va, 2 * g))  # unmapped twice

    def test_partial_unmap(self, mapped: tuple[hal.Backend, int, int, Any]) -> None:
        be, g, va, _ = mapped
        expect(be, hal.InvalidArgumentError, "unmap", lambda: be.unmap(va, g))
        be.unmap(va, 2 * g)

    def test_calls_after_close(self, hal_backend: hal.Backend) -> None:
        be, g = hal_backend, hal_backend.granularity
        va, h = be.create_vir_ptr(g), be.create_phy_mem_handle(g)
        be.close()
        for call, fn in [
            ("create_vir_ptr", lambda: be.create_vir_ptr(g)),
            ("create_phy_mem_handle", lambda: be.create_phy_mem_handle(g)),
            ("map", lambda: be.map(va, g, h)),
            ("unmap", lambda: be.unmap(va, g)),
            ("release_vir_ptr", lambda: be.release_vir_ptr(va, g)),
            ("release_phy_mem_handle", lambda: be.release_phy_mem_handle(h)),
        ]:
            expect(be, hal.InvalidStateError, call, fn)


class TestOutOfMemory:
    def test_chunk_bigger_than_the_device(self, hal_backend: hal.Backend) -> None:
        be, g = hal_backend, hal_backend.granularity
        size = round_up(be.mem_info().total + 1, g)
        err = expect(be, hal.DeviceOutOfMemoryError, "create_phy_mem_handle",
                     lambda: be.create_phy_mem_handle(size), from_driver=True)
        assert isinstance(err, MemoryError)
        h = be.create_phy_mem_handle(g)  # the device still works
        be.release_phy_mem_handle(h)


def _rollback_case(be: hal.Backend, hook: str) -> tuple[Callable[[], Any], Callable[[], None]]:
    """Prepare ``be`` for a valid call of ``hook``; return that call and what undoes it."""
    g = be.granularity
    if hook == "create_vir_ptr":
        return (lambda: be.create_vir_ptr(2 * g)), (lambda: None)
    if hook == "create_phy_mem_handle":
        return (lambda: be.create_phy_mem_handle(2 * g)), (lambda: None)
    va = be.create_vir_ptr(2 * g)
    if hook == "release_vir_ptr":
        return (lambda: be.release_vir_ptr(va, 2 * g)), (lambda: None)
    h = be.create_phy_mem_handle(g)
    if hook == "release_phy_mem_handle":
        return (lambda: be.release_phy_mem_handle(h)), (lambda: None)
    if hook == "map":
        return (lambda: be.map(va + g, g, h)), (lambda: be.unmap(va + g, g))
    if hook == "unmap":
        be.map(va + g, g, h)
        return (lambda: be.unmap(va + g, g)), (lambda: None)
    if hook == "granularity":
        return (lambda: be.recommended_granularity), (lambda: None)
    if hook == "mem_info":
        return be.mem_info, (lambda: None)
    if hook == "device_count":
        return be.device_count, (lambda: None)
    raise AssertionError(hook)


class TestFaultRollback:
    """A call that fails in the driver leaves the facade and the accounting as they were."""

    @pytest.mark.parametrize("hook", [*VMM_HOOKS, "granularity", "mem_info", "device_count"])
    def test_failed_call_changes_nothing(self, hal_backend: hal.Backend, hook: str) -> None:
        be = hal_backend
        call, undo = _rollback_case(be, hook)
        before = snapshot(be)
        be.faults.fail(hook)
        with pytest.raises(hal.DriverError) as info:
            call()
        assert info.value.call == hook and info.value.code_name == "HAL_INJECTED_FAULT"
        assert be.faults.fired[-1] == hook and be.faults.pending == 0
        assert snapshot(be) == before, f"a failed {hook} changed the bookkeeping"
        call()  # the same call now succeeds: the backend still works
        undo()

    def test_the_nth_call_fails(self, hal_backend: hal.Backend) -> None:
        be, g = hal_backend, hal_backend.granularity
        be.faults.fail("create_phy_mem_handle", nth=3)
        be.create_phy_mem_handle(g)
        be.create_phy_mem_handle(g)
        with pytest.raises(hal.DriverError):
            be.create_phy_mem_handle(g)
        assert be.live.chunks == 2
        be.create_phy_mem_handle(g)
        assert be.live.chunks == 3

    def test_injected_error_is_raised_as_given(self, hal_backend: hal.Backend) -> None:
        be, g = hal_backend, hal_backend.granularity
        error = hal.DeviceOutOfMemoryError("injected", backend=be.name, call="create_vir_ptr")
        be.faults.fail("create_vir_ptr", error=error)
        with pytest.raises(hal.DeviceOutOfMemoryError) as info:
            be.create_vir_ptr(g)
        assert info.value is error and be.live.zero


class TestMemorySharing:
    """``"memory_sharing"``: a chunk exported as a file descriptor and imported again aliases the original."""

    @pytest.fixture(autouse=True)
    def _capable(self, hal_backend: hal.Backend) -> None:
        if not hal_backend.supports("memory_sharing"):
            has = ", ".join(sorted(hal_backend.capabilities)) or "none"
            pytest.skip(f"{hal_backend.name} lacks capability memory_sharing (it declares: {has}); these tests "
                        "export chunks as file descriptors and import them")

    def test_an_imported_chunk_aliases_the_exported_one(self, hal_backend: hal.Backend,
                                                        hal_memory: MemoryAccess) -> None:
        be, g, mem = hal_backend, hal_backend.granularity, hal_memory
        h = be.create_phy_mem_handle(2 * g)
        fd = be.export_phy_mem_handle(h)
        try:
            imported = be.import_phy_mem_handle(fd, 2 * g)
        finally:
            os.close(fd)
        va1, va2 = be.create_vir_ptr(2 * g), be.create_vir_ptr(2 * g)
        be.map(va1, 2 * g, h)
        be.map(va2, 2 * g, imported)
        for i, off in enumerate(probe_offsets(2 * g)):
            mem.write(va1 + off, pattern(i))
        for i, off in enumerate(probe_offsets(2 * g)):
            assert mem.read(va2 + off, PROBE) == pattern(i), f"offset {off} of the imported chunk does not alias"
        be.unmap(va1, 2 * g)
        be.release_phy_mem_handle(h)  # the importer's handle keeps the chunk
        mem.write(va2, pattern(9))
        assert mem.read(va2, PROBE) == pattern(9)
        be.unmap(va2, 2 * g)
        be.release_phy_mem_handle(imported)
        assert be.live.chunks == 0

    def test_export_and_import_are_checked(self, hal_backend: hal.Backend) -> None:
        be, g = hal_backend, hal_backend.granularity
        h = be.create_phy_mem_handle(g)
        be.release_phy_mem_handle(h)
        expect(be, hal.InvalidStateError, "export_phy_mem_handle", lambda: be.export_phy_mem_handle(h))
        expect(be, hal.InvalidArgumentError, "import_phy_mem_handle", lambda: be.import_phy_mem_handle(-1, g))
        expect(be, hal.InvalidArgumentError, "import_phy_mem_handle", lambda: be.import_phy_mem_handle(3, g + 1))


class TestLifecycle:
    """close() releases everything, is idempotent, and nothing stays live."""

    def test_close_releases_what_is_left(self, hal_backend: hal.Backend) -> None:
        be, g = hal_backend, hal_backend.granularity
        va, h = be.create_vir_ptr(4 * g), be.create_phy_mem_handle(g)
        be.map(va, g, h)
        be.map(va + 2 * g, g, h)
        be.create_phy_mem_handle(2 * g)
        assert not be.live.zero
        be.close()
        assert be.closed and be.live.zero

    def test_close_is_idempotent(self, hal_backend: hal.Backend) -> None:
        be = hal_backend
        be.create_vir_ptr(be.granularity)
        be.close()
        be.close()
        assert be.closed and be.live.zero

    def test_context_manager_closes(self, hal_backend_factory: Callable[[], hal.Backend]) -> None:
        with hal_backend_factory() as be:
            be.map(be.create_vir_ptr(be.granularity), be.granularity, be.create_phy_mem_handle(be.granularity))
        assert be.closed and be.live.zero

    def test_repeated_cycles_leave_nothing_live(self, hal_backend: hal.Backend) -> None:
        be, g = hal_backend, hal_backend.granularity
        for _ in range(10):
            va, h = be.create_vir_ptr(2 * g), be.create_phy_mem_handle(g)
            be.map(va + g, g, h)
            be.unmap(va + g, g)
            be.release_phy_mem_handle(h)
            be.release_vir_ptr(va, 2 * g)
            assert be.live.zero
        assert be.accounting.calls["map"] == 10


class TestStateMachine:
    """Random sequences of vmm calls against a model of ranges, chunks, mappings and bytes."""

    def test_random_call_sequences(self, hal_backend_factory: Callable[[], hal.Backend],
                                   hal_backend: hal.Backend, hal_requirements: Requirements) -> None:
        pytest.importorskip("hypothesis", reason="the state machine needs hypothesis")
        from hal.testing.machine import run_vmm_machine

        access, _ = memory_access(hal_backend, hal_requirements)  # None: no byte checks
        run_vmm_machine(hal_backend_factory, access)
