"""Where graphkit's share of capture time goes: seconds per part (routing, spaces, maps), counted only when asked.

A bench turns the counting on around the captures it measures
(``with CAPTURE_TIMES.counting() as times: ...``). Off -- always, outside a
bench -- each counting point costs one attribute read. Parts nest: the
seconds of a part leave out those of the parts counted inside it (the maps
made while a space is set up count as maps, not as the space), so the parts
add up to graphkit's share without counting anything twice.

It lives in the memory floor, though captures are the graphs floor's, because
the module that maps (:mod:`graphkit.memory.backing`) counts its maps here and
may import nothing from the floors above it; it knows nothing of graphs: a
part is a name its caller chooses (``"maps"`` here, ``"spaces"`` and
``"routing"`` in :mod:`graphkit.graphs`), and a timer a bench reads.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field


@dataclass
class PartTimes:
    """Seconds (each part's own, nested parts left out) and calls of every part counted."""

    seconds: dict[str, float] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return sum(self.seconds.values())


class CaptureTimes:
    """The switch and the counters (one set per process; each thread nests its own parts)."""

    def __init__(self) -> None:
        self.on = False
        self.times = PartTimes()
        self._stack = threading.local()
        self._lock = threading.Lock()

    def start(self, part: str) -> list | None:
        """Start counting ``part`` (None when off: then :meth:`stop` does nothing with it)."""
        if not self.on:
            return None
        stack = getattr(self._stack, "parts", None)
        if stack is None:
            stack = self._stack.parts = []
        entry = [part, time.perf_counter(), 0.0]  # the part, its start, the seconds of the parts inside it
        stack.append(entry)
        return entry

    def stop(self, entry: list | None) -> None:
        """The part started by ``entry`` ends (a part started while counting was off is not counted)."""
        if entry is None:
            return
        stack = self._stack.parts
        while stack and stack[-1] is not entry:  # a part left by an exception on the way: closed with it
            stack.pop()
        if stack:
            stack.pop()
        spent = time.perf_counter() - entry[1]
        if stack:
            stack[-1][2] += spent
        part = entry[0]
        with self._lock:
            self.times.seconds[part] = self.times.seconds.get(part, 0.0) + spent - entry[2]
            self.times.calls[part] = self.times.calls.get(part, 0) + 1

    @contextlib.contextmanager
    def counting(self) -> Iterator[PartTimes]:
        """Count from zero inside the block; the counts it yields are final when it ends."""
        times = self.times = PartTimes()
        self.on = True
        try:
            yield times
        finally:
            self.on = False


#: the process's counters of graphkit's parts of captures
CAPTURE_TIMES = CaptureTimes()
