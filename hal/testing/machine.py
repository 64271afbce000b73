"""A Hypothesis state machine: random vmm call sequences against a simple model.

The model knows the reserved ranges, the chunks (with the bytes written into
them) and the mappings, so it predicts every call's outcome, including which
error the facade raises, and what every mapping must read back.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

import hal
from hal.testing.memory import MemoryAccess

PROBE = 16

SETTINGS = settings(max_examples=40, stateful_step_count=30, deadline=None, database=None,
                    suppress_health_check=list(HealthCheck))


@dataclass
class Chunk:
    """The model of one physical chunk."""

    size: int
    writes: dict[int, bytes] = field(default_factory=dict)  # offset -> bytes last written there

    def offsets(self) -> list[int]:
        return sorted({0, (self.size // 2) // PROBE * PROBE, self.size - PROBE})


class VMMMachine(RuleBasedStateMachine):
    """One backend per example; ``access`` (or ``None``) reads and writes mapped bytes."""

    def __init__(self, open_backend: Callable[[], hal.Backend], access: MemoryAccess | None) -> None:
        super().__init__()
        self.be = open_backend()
        self.g = self.be.granularity
        self.access = access
        self.ranges: dict[int, int] = {}
        self.chunks: dict[Any, Chunk] = {}
        self.mappings: dict[int, tuple[Any, int]] = {}  # ptr -> (handle, size)

    def _pick(self, data: st.DataObject, items: Any) -> Any:
        """One of ``items``, chosen by position in creation order (addresses differ between runs)."""
        return data.draw(st.sampled_from(list(items)))

    def _mapped_in(self, lo: int, hi: int) -> list[int]:
        return [p for p, (_, size) in self.mappings.items() if p < hi and p + size > lo]

    def _free_slots(self, size: int) -> list[int]:
        """Every granule-aligned address where ``size`` bytes fit in a range without overlapping a mapping."""
        return [ptr for start, length in self.ranges.items()
                for ptr in range(start, start + length - size + 1, self.g)
                if not self._mapped_in(ptr, ptr + size)]

    @precondition(lambda self: len(self.ranges) < 4)
    @rule(granules=st.integers(1, 4))
    def reserve(self, granules: int) -> None:
        size = granules * self.g
        ptr = self.be.create_vir_ptr(size)
        assert all(ptr + size <= p or p + s <= ptr for p, s in self.ranges.items()), "ranges overlap"
        self.ranges[ptr] = size

    @precondition(lambda self: len(self.chunks) < 4)
    @rule(granules=st.integers(1, 2))
    def create(self, granules: int) -> None:
        handle = self.be.create_phy_mem_handle(granules * self.g)
        assert handle not in self.chunks, "a live handle was handed out again"
        self.chunks[handle] = Chunk(granules * self.g)

    @precondition(lambda self: self.ranges and self.chunks)
    @rule(data=st.data())
    def map(self, data: st.DataObject) -> None:
        """Map a chunk (often one that is mapped already) where it fits."""
        handle = self._pick(data, self.chunks)
        size = self.chunks[handle].size
        slots = self._free_slots(size)
        if slots:
            ptr = data.draw(st.sampled_from(slots))
            self.be.map(ptr, size, handle)
            self.mappings[ptr] = (handle, size)

    @precondition(lambda self: self.ranges and self.chunks)
    @rule(data=st.data())
    def map_anywhere(self, data: st.DataObject) -> None:
        """Map at any granule of a range: the model predicts success or the facade's error."""
        start = self._pick(data, self.ranges)
        handle = self._pick(data, self.chunks)
        ptr = start + data.draw(st.integers(0, self.ranges[start] // self.g - 1)) * self.g
        size = self.chunks[handle].size
        if ptr + size > start + self.ranges[start]:
            expected: type[Exception] | None = hal.InvalidArgumentError
        elif self._mapped_in(ptr, ptr + size):
            expected = hal.InvalidStateError
        else:
            expected = None
        if expected is not None:
            try:
                self.be.map(ptr, size, handle)
            except expected:
                return
            raise AssertionError(f"map at {ptr:#x} should raise {expected.__name__}")
        self.be.map(ptr, size, handle)
        self.mappings[ptr] = (handle, size)

    @precondition(lambda self: self.mappings)
    @rule(data=st.data())
    def unmap(self, data: st.DataObject) -> None:
        ptr = self._pick(data, self.mappings)
        self.be.unmap(ptr, self.mappings.pop(ptr)[1])

    @precondition(lambda self: self.chunks)
    @rule(data=st.data())
    def release_chunk(self, data: st.DataObject) -> None:
        handle = self._pick(data, self.chunks)
        if any(h == handle for h, _ in self.mappings.values()):
            try:
                self.be.release_phy_mem_handle(handle)
            except hal.InvalidStateError:
                return
            raise AssertionError("releasing a mapped chunk should raise InvalidStateError")
        self.be.release_phy_mem_handle(handle)
        del self.chunks[handle]

    @precondition(lambda self: self.ranges)
    @rule(data=st.data())
    def release_range(self, data: st.DataObject) -> None:
        start = self._pick(data, self.ranges)
        if self._mapped_in(start, start + self.ranges[start]):
            try:
                self.be.release_vir_ptr(start, self.ranges[start])
            except hal.InvalidStateError:
                return
            raise AssertionError("releasing a range with mappings should raise InvalidStateError")
        self.be.release_vir_ptr(start, self.ranges.pop(start))

    @precondition(lambda self: self.access is not None and self.mappings)
    @rule(data=st.data(), payload=st.binary(min_size=PROBE, max_size=PROBE))
    def write(self, data: st.DataObject, payload: bytes) -> None:
        ptr = self._pick(data, self.mappings)
        chunk = self.chunks[self.mappings[ptr][0]]
        offset = data.draw(st.sampled_from(chunk.offsets()))
        assert self.access is not None
        self.access.write(ptr + offset, payload)
        chunk.writes[offset] = payload

    @invariant()
    def every_mapping_reads_its_chunk(self) -> None:
        if self.access is None:
            return
        for ptr, (handle, _) in self.mappings.items():
            for offset, payload in self.chunks[handle].writes.items():
                got = self.access.read(ptr + offset, PROBE)
                assert got == payload, f"mapping at {ptr:#x}+{offset} reads {got!r}, wrote {payload!r}"

    @invariant()
    def accounting_matches_the_model(self) -> None:
        live = self.be.live
        assert (live.ranges, live.chunks, live.mappings) == (len(self.ranges), len(self.chunks), len(self.mappings))
        assert live.reserved_bytes == sum(self.ranges.values())
        assert live.chunk_bytes == sum(c.size for c in self.chunks.values())
        assert live.mapped_bytes == sum(size for _, size in self.mappings.values())

    def teardown(self) -> None:
        self.be.close()
        assert self.be.live.zero, f"still live after close(): {self.be.live}"


def run_vmm_machine(open_backend: Callable[[], hal.Backend], access: MemoryAccess | None,
                    run_settings: settings = SETTINGS) -> None:
    """Run :class:`VMMMachine` against fresh backends from ``open_backend``."""

    class BoundVMMMachine(VMMMachine):
        # hypothesis types its argument as a machine class: bind the arguments in a subclass, not a lambda
        def __init__(self) -> None:
            super().__init__(open_backend, access)

    run_state_machine_as_test(BoundVMMMachine, settings=run_settings)
