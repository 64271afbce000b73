"""SharedVMMAllocator: the example of the docs, the state machine, rollback, threads."""

from __future__ import annotations

import ctypes
import itertools
import threading
from collections.abc import Callable

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import graphkit
import hal
from hal.api import VMM_HOOKS
from tests.conftest import G
from tests.sim import compiler_reason, simulated_backend
from tests.values import BAD_VALUE_SETTINGS, NOT_A_SIZE


def test_the_documented_example_works_as_written() -> None:
    be = hal.get_backend("fake", granularity=1 << 16)
    a = graphkit.SharedVMMAllocator(be)
    a.switch_to_new_virtual_space()
    p1 = a.allocate(3 * (1 << 16) + 5)
    a.switch_to_new_virtual_space()
    p2 = a.allocate(1 << 16)
    assert p1 != p2 and a.physical_bytes == 4 * (1 << 16) and a.num_virtual_spaces == 2
    ctypes.memmove(p2, b"shared!!", 8)
    assert ctypes.string_at(p1, 8) == b"shared!!"
    a.close()
    assert be.live.zero
    be.close()


@pytest.mark.parametrize("hook", VMM_HOOKS)
@pytest.mark.parametrize("step", ["switch", "extend", "release"])
def test_a_fault_in_any_driver_call_rolls_back(be: hal.Backend, hook: str, step: str) -> None:
    a = graphkit.SharedVMMAllocator(be, reserve_bytes=16 * G)
    s1 = a.switch_to_new_virtual_space()
    a.allocate(3 * G)
    s2 = a.switch_to_new_virtual_space()
    a.allocate(G)
    before = (be.live, a.physical_bytes, a.num_virtual_spaces, a.chunks, a.spaces)
    be.faults.fail(hook, nth=2 if hook == "map" else 1)
    action = {"switch": a.switch_to_new_virtual_space,
              "extend": lambda: a.precreate(2 * G),
              "release": lambda: a.release_virtual_space(s1)}[step]
    try:
        action()
    except hal.DriverError as exc:
        assert "injected" in str(exc)
        assert (be.live, a.physical_bytes, a.num_virtual_spaces, a.chunks, a.spaces) == before
    be.faults.clear()
    # usable afterwards, and nothing leaks
    a.switch_to_new_virtual_space()
    p = a.allocate(4 * G)
    ctypes.memmove(p + 3 * G, b"ok", 2)
    assert ctypes.string_at(a.spaces[s2].base, 2) == ctypes.string_at(p, 2)  # chunk 0 is shared
    if s1 in a.spaces:  # s1 used 3 granules: it maps chunks 0-2
        ctypes.memmove(p + 2 * G, b"s1", 2)
        assert ctypes.string_at(a.spaces[s1].base + 2 * G, 2) == b"s1"
    a.close()
    assert be.live.zero


def test_requests_beyond_the_reserved_space_raise_clearly(be: hal.Backend) -> None:
    a = graphkit.SharedVMMAllocator(be, reserve_bytes=4 * G)
    a.switch_to_new_virtual_space()
    with pytest.raises(hal.DeviceOutOfMemoryError, match="reserve_bytes"):
        a.allocate(5 * G)
    assert a.physical_bytes == 0
    with pytest.raises(hal.InvalidStateError, match="switch_to_new_virtual_space"):
        graphkit.SharedVMMAllocator(be).allocate(1)
    a.close()


def test_physical_limit_and_pool_callbacks_keep_the_reason(be: hal.Backend) -> None:
    a = graphkit.SharedVMMAllocator(be, max_physical_bytes=2 * G)
    sid = a.switch_to_new_virtual_space()
    alloc, free = a.pool_callbacks(sid)
    assert alloc(G) != 0
    with pytest.raises(hal.DeviceOutOfMemoryError, match="max_physical_bytes"):
        alloc(4 * G)
    assert "max_physical_bytes" in (a.last_error or "")
    free(12345, 1)  # unknown pointer: accepted, no exception
    assert a.physical_bytes == G
    a.close()


def test_a_space_still_in_use_is_released_when_its_last_block_is_freed(be: hal.Backend) -> None:
    a = graphkit.SharedVMMAllocator(be, reserve_bytes=16 * G)
    old = a.switch_to_new_virtual_space()
    p = a.allocate(2 * G)
    assert a.release_when_idle(old) is False and a.num_virtual_spaces == 1
    ctypes.memmove(p, b"alive", 5)  # still mapped: a tensor may still read it
    new = a.switch_to_new_virtual_space()
    assert a.spaces[new].base != a.spaces[old].base
    a.deallocate(p)  # may come from a destructor at any moment: nothing is unmapped there
    assert old in a.spaces
    assert a.release_when_idle(new) is True  # the allocator's next operation releases both
    assert not a.spaces and be.live.ranges == 0
    a.close()


def test_default_reserve_is_the_device_memory(be: hal.Backend) -> None:
    a = graphkit.SharedVMMAllocator(be)
    assert a.reserve_bytes == be.mem_info().total
    a.close()


def test_threads_allocating_concurrently_get_disjoint_memory(be: hal.Backend) -> None:
    a = graphkit.SharedVMMAllocator(be, reserve_bytes=256 * G)
    a.switch_to_new_virtual_space()
    got: list[tuple[int, int]] = []
    lock = threading.Lock()

    def work() -> None:
        for i in range(200):
            n = 1000 + 37 * i
            p = a.allocate(n)
            with lock:
                got.append((p, p + n))

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    got.sort()
    assert len(got) == 800 and all(e <= s for (_, e), (s, _) in itertools.pairwise(got))
    assert a.physical_bytes == -(-(got[-1][1] - a.spaces[a.current].base) // G) * G
    assert a.stats().map_calls == a.physical_bytes // G
    a.close()


def test_a_second_fault_during_a_rollback_loses_nothing(be: hal.Backend) -> None:
    """The rollback of a failed allocation cannot release a chunk: it is kept and released later."""
    a = graphkit.SharedVMMAllocator(be, reserve_bytes=16 * G)
    a.switch_to_new_virtual_space()
    be.faults.fail("map", nth=3)  # the third chunk's map fails: the allocation rolls back...
    be.faults.fail("release_phy_mem_handle", nth=1)  # ...and releasing the third chunk fails too,
    be.faults.fail("release_phy_mem_handle", nth=1)  # twice (a failed release is retried at once)
    with pytest.raises(hal.DriverError):
        a.allocate(3 * G)
    be.faults.clear()
    assert a.physical_bytes == 0 and a.pending_release == 1
    assert be.live.chunks == 1 and be.live.mappings == 0  # tracked, not leaked
    a.switch_to_new_virtual_space()  # the next operation retries the release
    assert a.pending_release == 0 and be.live.chunks == 0
    a.allocate(2 * G)
    a.close()
    assert be.live.zero


# -- two faults: a rollback step that fails too leaves an exact record, never a silent hole -------------------


def _two_spaces(be: hal.Backend) -> tuple[graphkit.SharedVMMAllocator, int, int]:
    a = graphkit.SharedVMMAllocator(be, reserve_bytes=8 * G)
    a.switch_to_new_virtual_space()
    p1 = a.allocate(3 * G)
    a.switch_to_new_virtual_space()
    p2 = a.allocate(2 * G)
    ctypes.memmove(p1, b"graphs!!", 8)
    return a, p1, p2


def test_a_resume_whose_rollback_fails_keeps_the_chunk_and_can_be_retried(be: hal.Backend) -> None:
    a, p1, p2 = _two_spaces(be)
    a.release_physical()
    asleep = be.live
    be.faults.fail("map", nth=3)
    be.faults.fail("unmap", nth=1)
    be.faults.fail("unmap", nth=1)
    with pytest.raises(hal.DriverError, match="injected"):
        a.restore_physical()
    assert a.paused and be.live.mappings == asleep.mappings + 1  # the mapping that would not go is known
    a.restore_physical()
    assert not a.paused and a.physical_bytes == 3 * G
    ctypes.memmove(p2, b"again!!!", 8)
    assert ctypes.string_at(p1, 8) == b"again!!!"  # both spaces on the same chunks again
    a.close()
    assert be.live.zero, be.live


@pytest.mark.parametrize("hook", ["unmap", "release_vir_ptr"])
def test_close_goes_on_past_a_fault_and_a_second_close_finishes(be: hal.Backend, hook: str) -> None:
    a, _, _ = _two_spaces(be)
    be.faults.fail(hook, nth=1)
    with pytest.raises(hal.DriverError, match="injected"):
        a.close()
    assert not a.closed and a.paused  # nothing of it may run any more
    a.close()
    assert a.closed and be.live.zero, be.live


@BAD_VALUE_SETTINGS
@given(value=NOT_A_SIZE)
def test_bad_sizes_and_alignments_are_hal_errors(be: hal.Backend, value: object) -> None:
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


def test_a_backend_name_instead_of_a_backend_is_refused_naming_the_fix() -> None:
    with pytest.raises(hal.InvalidArgumentError, match=r"backend='fake' must be a hal.Backend \(hal.get_backend"):
        graphkit.SharedVMMAllocator("fake")  # type: ignore[arg-type]


# -- the allocator as a state machine ------------------------------------------------------------------------------
# A Hypothesis state machine for SharedVMMAllocator against a simple model, for any host-visible backend.


def allocator_machine(make_backend: Callable[[], hal.Backend], host_visible: bool = True) -> type:
    """Build a state machine class driving a fresh allocator over ``make_backend()``."""

    class AllocatorMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.be = make_backend()
            self.g = self.be.granularity
            self.alloc = graphkit.SharedVMMAllocator(self.be, reserve_bytes=32 * self.g)
            self.hw: dict[int, int] = {}  # model: space id -> high-water offset
            self.allocs: dict[int, list[tuple[int, int]]] = {}  # space id -> [(ptr, end)]
            self.chunks = 0  # model: number of chunks
            self.extended = False  # an explicit extend since the last trim

        def _ok(self, fn: Callable[[], object]) -> tuple[bool, object]:
            """Run an allocator call; a hal error (injected) must leave the model as it was."""
            try:
                return True, fn()
            except hal.HalError:
                return False, None

        @rule()
        def switch(self) -> None:
            ok, sid = self._ok(self.alloc.switch_to_new_virtual_space)
            if ok:
                self.hw[sid] = 0
                self.allocs[sid] = []

        @precondition(lambda self: self.alloc.current is not None)
        @rule(nbytes=st.integers(1, 5 << 16), alignment=st.sampled_from([1, 256, 4096, 1 << 16]))
        def allocate(self, nbytes: int, alignment: int) -> None:
            sid = self.alloc.current
            ok, ptr = self._ok(lambda: self.alloc.allocate(nbytes, alignment=alignment))
            if not ok:
                return
            space = self.alloc.spaces[sid]
            assert ptr % alignment == 0
            self.allocs[sid].append((ptr, ptr + nbytes))
            self.hw[sid] = ptr + nbytes - space.base
            self.chunks = max(self.chunks, -(-self.hw[sid] // self.g))
            assert space.mapped == -(-self.hw[sid] // self.g)  # mapped lazily, as far as it is used

        @rule(nbytes=st.integers(1, 3 << 16))
        def extend(self, nbytes: int) -> None:
            ok, _ = self._ok(lambda: self.alloc.precreate(nbytes))
            if not ok:
                return
            self.chunks += -(-nbytes // self.g)
            self.extended = True

        @precondition(lambda self: bool(self.hw))
        @rule(data=st.data())
        def release(self, data: st.DataObject) -> None:
            sid = data.draw(st.sampled_from(sorted(self.hw)))
            ok, _ = self._ok(lambda: self.alloc.release_virtual_space(sid))
            if not ok:
                return
            del self.hw[sid], self.allocs[sid]
            self.chunks = -(-max(self.hw.values(), default=0) // self.g)
            self.extended = False
            if not self.hw:  # an empty arena goes back to the driver, or is kept when that failed
                assert self.alloc.num_arenas <= 1 and self.alloc.reserved_bytes == 0

        @rule(hook=st.sampled_from(VMM_HOOKS), nth=st.integers(1, 3))
        def inject_fault(self, hook: str, nth: int) -> None:
            self.be.faults.clear()
            self.be.faults.fail(hook, nth=nth)

        @invariant()
        def allocations_of_one_space_never_overlap(self) -> None:
            for spans in self.allocs.values():
                spans = sorted(spans)
                for (_, end), (start, _) in itertools.pairwise(spans):
                    assert end <= start

        @invariant()
        def every_space_maps_the_same_chunks_as_far_as_it_reaches(self) -> None:
            chunks = self.alloc.chunks
            mappings = self.be._mappings
            for sid, space in self.alloc.spaces.items():
                reach = -(-self.hw[sid] // self.g)
                for i in range(reach):
                    assert mappings[space.base + i * self.g].handle == chunks[i]
                if reach * self.g < space.size:
                    assert space.base + reach * self.g not in mappings
            used = [s for sid, s in self.alloc.spaces.items() if self.hw[sid]]
            if host_visible and len(used) >= 2:
                a, b = used[:2]
                ctypes.memmove(a.base, b"aliased", 7)
                assert ctypes.string_at(b.base, 7) == b"aliased"

        @invariant()
        def spaces_never_overlap_and_only_the_current_one_can_grow(self) -> None:
            spans = sorted((s.base, s.base + s.size) for s in self.alloc.spaces.values())
            for (_, end), (start, _) in itertools.pairwise(spans):
                assert end <= start
            for sid, space in self.alloc.spaces.items():
                assert space.sealed == (sid != self.alloc.current)
                if space.sealed:
                    assert space.size == max(-(-self.hw[sid] // self.g), 1) * self.g

        @invariant()
        def physical_bytes_follow_the_largest_high_water_mark(self) -> None:
            assert self.alloc.physical_bytes == self.chunks * self.g
            largest = -(-max(self.hw.values(), default=0) // self.g) * self.g
            if self.extended:
                assert self.alloc.physical_bytes >= largest
            else:
                assert self.alloc.physical_bytes == largest

        @invariant()
        def accounting_matches_the_model(self) -> None:
            live = self.be.live
            assert len(self.hw) == self.alloc.num_virtual_spaces
            assert live.ranges == self.alloc.num_arenas <= max(len(self.hw), 1)
            assert live.chunks == self.chunks + self.alloc.pending_release
            assert live.mappings == sum(-(-hw // self.g) for hw in self.hw.values())

        def teardown(self) -> None:
            self.be.faults.clear()
            self.alloc.close()
            assert self.be.live.zero, self.be.live
            self.be.close()

    AllocatorMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
    return AllocatorMachine


TestFakeAllocatorMachine = allocator_machine(lambda: hal.get_backend("fake", granularity=G)).TestCase


if compiler_reason() is None:
    TestAscendSimAllocatorMachine = allocator_machine(
        lambda: simulated_backend("ascend", capacity=1 << 30, granularity=G)).TestCase
    TestMluSimAllocatorMachine = allocator_machine(
        lambda: simulated_backend("mlu", capacity=1 << 30, granularity=G)).TestCase
else:  # pragma: no cover - machines without a C compiler
    @pytest.mark.skip(reason=f"driver simulators cannot be built: {compiler_reason()}")
    def test_allocator_machine_over_simulators() -> None: ...
