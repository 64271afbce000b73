"""A Hypothesis state machine for SharedVMMAllocator against a simple model, for any host-visible backend."""

from __future__ import annotations

import ctypes
from typing import Callable

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import hal
import graphkit
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

        @rule(nbytes=st.integers(1, 3 << 16))
        def extend(self, nbytes: int) -> None:
            ok, _ = self._ok(lambda: self.alloc.extend_mapping(nbytes))
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

        @rule(hook=st.sampled_from(VMM_HOOKS), nth=st.integers(1, 3))
        def inject_fault(self, hook: str, nth: int) -> None:
            self.be.faults.clear()
            self.be.faults.fail(hook, nth=nth)

        @invariant()
        def allocations_of_one_space_never_overlap(self) -> None:
            for spans in self.allocs.values():
                spans = sorted(spans)
                for (_, end), (start, _) in zip(spans, spans[1:]):
                    assert end <= start

        @invariant()
        def every_space_maps_the_same_chunks(self) -> None:
            chunks = self.alloc.chunks
            mappings = self.be._mappings
            for space in self.alloc.spaces.values():
                for i, handle in enumerate(chunks):
                    assert mappings[space.base + i * self.g].handle == handle
                assert space.base + len(chunks) * self.g not in mappings
            if host_visible and chunks and len(self.hw) >= 2:
                a, b = list(self.alloc.spaces.values())[:2]
                last = (len(chunks) - 1) * self.g
                ctypes.memmove(a.base + last, b"aliased", 7)
                assert ctypes.string_at(b.base + last, 7) == b"aliased"

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
            assert live.ranges == len(self.hw) == self.alloc.num_virtual_spaces
            assert live.chunks == self.chunks + self.alloc.pending_release
            assert live.mappings == len(self.hw) * self.chunks

        def teardown(self) -> None:
            self.be.faults.clear()
            self.alloc.close()
            assert self.be.live.zero, self.be.live
            self.be.close()

    AllocatorMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
    return AllocatorMachine
