"""What device work queued since the last wait may still touch, for a host device that runs behind the host.

A device runs its work after the host issued it: a kernel or a graph replay may still read or write a range
when the host unmaps it, and a driver need not wait for it (a GPU faults and the process is lost). Host memory
runs every op when it is issued, so a test on a CPU never has work in flight. :class:`InFlight` gives a
:class:`hal.host.HostGraphs` backend (``fake`` with ``asynchronous=True``) the device's view instead: every
range that queued work may still use, until the next ``synchronize``; an unmap that intersects one of them is
a use after unmap (:class:`hal.UseAfterUnmapError`).

What counts as queued work: the spans a graph replay reads or writes (what its ``graph_addresses`` say), each
block a pool hands out outside a capture (eager kernels may be writing it), and each range given out through
``tensor_at``. A capture runs nothing on a device, so what it allocates counts only once the graph replays.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

from hal.errors import UseAfterUnmapError
from hal.types import fmt_bytes

if TYPE_CHECKING:  # pragma: no cover
    from hal.host.tape import HostGraph

#: how many of the pieces of work an error names (the rest are counted)
_NAMED = 3


class InFlight:
    """The ranges that device work queued since the last wait may still read or write.

    Thread-safe: blocks are handed out, graphs replayed and ranges unmapped on any thread.
    """

    def __init__(self, backend: str) -> None:
        self.backend = backend
        self._lock = threading.Lock()
        # graph serial -> (its spans, what it is): replayed since the last wait. A serial is never reused, so a
        # graph made after another one died never takes over (and drops) the dead one's queued replays
        self._graphs: dict[int, tuple[tuple[tuple[int, int], ...], str]] = {}
        self._updates = itertools.count(1)  # keys of the queued replays of graphs updated since
        self._ranges: dict[int, tuple[int, str]] = {}  # address -> (nbytes, what): handed out since the last wait
        self._local = threading.local()  # per thread: how many captures are running

    # -- what is queued ---------------------------------------------------------------------

    @contextlib.contextmanager
    def capturing(self) -> Iterator[None]:
        """Inside the block this thread captures: what it allocates is not work yet (a capture runs nothing)."""
        self._local.depth = getattr(self._local, "depth", 0) + 1
        try:
            yield
        finally:
            self._local.depth -= 1

    def capturing_here(self) -> bool:
        """Whether this thread captures now."""
        return bool(getattr(self._local, "depth", 0))

    def replayed(self, graph: HostGraph) -> None:
        """``graph`` was replayed: what it reads and writes stays in use until the next wait."""
        if graph.serial in self._graphs:  # already queued since the last wait: the hot path
            return
        spans = graph.addresses().spans
        tape = graph.running or graph  # an updated graph runs another's tape
        pool = tape.pool.name if tape.pool is not None else "no pool"
        what = f"the replay of a graph captured into the {pool}"
        with self._lock:
            self._graphs[graph.serial] = (spans, what)

    def updated(self, graph: HostGraph) -> None:
        """``graph`` runs other work from now on (``update_graph``): its next replay records what that uses."""
        with self._lock:
            entry = self._graphs.pop(graph.serial, None)
            if entry is not None:  # its queued replays still count, under a key of their own
                self._graphs[-next(self._updates)] = entry

    def handed_out(self, ptr: int, nbytes: int, what: str) -> None:
        """``nbytes`` at ``ptr`` went to the framework (a pool's block, a ``tensor_at`` view): eager work may be
        writing them until the next wait. Ignored inside a capture on this thread."""
        if nbytes <= 0 or self.capturing_here():
            return
        with self._lock:
            old = self._ranges.get(ptr)
            if old is None or old[0] < nbytes:
                self._ranges[ptr] = (nbytes, what)

    def waited(self) -> None:
        """The host waited for the device: nothing queued before is in flight any more."""
        with self._lock:
            self._graphs.clear()
            self._ranges.clear()

    # -- what may not happen ------------------------------------------------------------------

    def users(self, ptr: int, size: int) -> list[str]:
        """What queued work may still use ``[ptr, ptr + size)``, one line each (empty: nothing)."""
        lo, hi = ptr, ptr + size
        found: list[str] = []
        with self._lock:
            for spans, what in self._graphs.values():
                hit = [(a, n) for a, n in spans if a < hi and a + n > lo]
                if hit:
                    a, n = hit[0]
                    found.append(f"{what} (it uses [{a:#x}, {a + n:#x}))")
            for a, (n, what) in self._ranges.items():
                if a < hi and a + n > lo:
                    found.append(f"{what} at [{a:#x}, {a + n:#x})")
        return found

    def check_unmap(self, ptr: int, size: int, call: str = "unmap") -> None:
        """Raise :class:`hal.UseAfterUnmapError` when queued work may still use ``[ptr, ptr + size)``."""
        found = self.users(ptr, size)
        if not found:
            return
        more = f" and {len(found) - _NAMED} more" if len(found) > _NAMED else ""
        raise UseAfterUnmapError(
            f"[{ptr:#x}, {ptr + size:#x}) ({fmt_bytes(size)}) is unmapped while device work queued since the last "
            f"wait may still use it: {'; '.join(found[:_NAMED])}{more}. Nothing was unmapped. Synchronize the device "
            "or the streams that used it first, or unmap with wait=True",
            backend=self.backend, call=call)
