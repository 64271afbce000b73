"""A Hypothesis state machine for SharedVMMAllocator against a simple model, for any host-visible backend."""

from __future__ import annotations

import ctypes
import itertools
from collections.abc import Callable

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import graphkit
import hal
from hal.api import VMM_HOOKS


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
