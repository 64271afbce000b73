"""Every report graphkit gives: a :class:`GraphRunner` per size and in total, a :class:`GraphPools` per key,
a :class:`MemorySaver` per tag."""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from hal.types import fmt_bytes

if TYPE_CHECKING:
    import hal
    from graphkit.graphs.executables import ExecutableStats
    from graphkit.graphs.isolation import VerifyStats
    from graphkit.memory.allocator import SharedVMMAllocator


def driver_memory(backend: hal.Backend, device_bytes: int | None, pool_bytes: int | None) -> tuple[int | None, str]:
    """The driver's own memory of instantiated graphs -- the device's used-memory growth over their captures less
    the bytes the pools hold -- and why not, when it cannot be told: ``(bytes, "")`` or ``(None, reason)``. Never a
    made-up number. What else the device gained meanwhile counts too: a runner measures its captures alone, a
    :class:`GraphPools` everything since it was made."""
    if backend.torch_device().type == "cpu":
        return None, f"not measured: {backend.name}'s device is the host, whose graphs keep no driver memory"
    if device_bytes is None:
        return None, "not measured (no device query: report(measure=False))"
    if pool_bytes is None:
        return None, ("not measured: these pools draw from the framework's allocator, whose bytes are not told apart "
                      "from the driver's (kind='vmm' tells them; python -m graphkit_bench.graphmem measures it)")
    return device_bytes - pool_bytes, ""


def _driver_line(what: str, driver_bytes: int | None, why: str) -> str:
    return f"  driver memory of {what}: {fmt_bytes(driver_bytes) if driver_bytes is not None else why}"


def _shared_pool_bytes(keys: Iterable[KeyReport]) -> int:
    """What one shared pool of the framework holds for ``keys`` captured in that order: each capture reuses what
    earlier ones freed (not what they kept allocated) and grows the pool by the rest of its peak."""
    reserved = kept = 0
    for k in keys:
        reserved += max(0, k.used_bytes - (reserved - kept))
        kept += k.kept_bytes
    return reserved


@dataclass(frozen=True)
class Savings:
    """What the same captures would cost the framework's own ways, from each key's peak (its space's bytes: the
    segments its capture took) and what it keeps allocated after its capture -- a model of the caching
    allocator's reuse, not a measurement -- against what graphkit's chunks cost."""

    largest_first: int  # one shared pool, the largest capture first (the engines' best order)
    in_order: int  # one shared pool, the captures in the order they came
    per_capture: int  # a pool per capture (torch's default without pool=)
    chunks: int  # graphkit's chunks (shared and survivors)

    @classmethod
    def of(cls, keys: list[KeyReport], chunks: int) -> Savings | None:
        if not keys:
            return None
        return cls(_shared_pool_bytes(sorted(keys, key=lambda k: -k.used_bytes)), _shared_pool_bytes(keys),
                   sum(k.used_bytes for k in keys), chunks)

    def line(self) -> str:
        def against(what: str, bytes_: int) -> str:
            return f"{what} {fmt_bytes(bytes_)} ({self.chunks / bytes_:.2f} x)" if bytes_ else f"{what} 0 B"

        return (f"  saved: chunks {fmt_bytes(self.chunks)} against " + ", ".join(
            [against("one shared pool largest first", self.largest_first),
             against("in the order they came", self.in_order), against("a pool per capture", self.per_capture)])
            + " (estimated from each key's peak and kept bytes)")


class Baseline:
    """What a device held before some captures began (taken once, at :meth:`take`): the device's used memory and
    the capture streams' workspaces made so far, so that later figures count the captures' own growth."""

    def __init__(self, backend: hal.Backend) -> None:
        self.backend = backend
        self.used: int | None = None
        self.workspaces = 0

    def take(self) -> None:
        """Record the baseline (once: later calls keep the first), the framework's cached memory given back."""
        if self.used is None:
            from graphkit.graphs.capture import release_cached_memory

            self.backend.synchronize()
            release_cached_memory(self.backend)
            self.used, self.workspaces = self.backend.mem_info().used, self.backend.stream_state_bytes()

    def device_bytes(self) -> int:
        """Device memory used now beyond the baseline (0 before it was taken); the framework's cache given back."""
        if self.used is None:
            return 0
        from graphkit.graphs.capture import release_cached_memory

        self.backend.synchronize()
        release_cached_memory(self.backend)
        return self.backend.mem_info().used - self.used

    def workspace_bytes(self) -> int:
        """Capture-stream workspaces made since the baseline (0 before it was taken)."""
        return 0 if self.used is None else self.backend.stream_state_bytes() - self.workspaces


@dataclass(frozen=True)
class Accounting:
    """Where the device memory of some graphs went: the whole cost an engine pays for them, item by item.

    ``device`` is the device's used-memory growth (None where not measured: a host device, ``measure=False``);
    ``chunks`` the physical memory the pools mapped, of which ``survivors`` lie under memory that outlived its
    capture; ``executables`` the driver's memory of the executable graphs, measured around each instantiation
    and update (None where the graphs keep their framework's own, or on a host device); ``workspaces`` the capture
    streams' library state made meanwhile (cuBLAS/cuBLASLt workspaces). ``rest``: what the device grew by beyond
    those (graphs instantiated outside a budget, collectives' state, kernels loaded by the captures).
    """

    device: int | None
    chunks: int
    survivors: int = 0
    executables: int | None = None
    workspaces: int = 0

    @property
    def rest(self) -> int | None:
        if self.device is None:
            return None
        return self.device - self.chunks - (self.executables or 0) - self.workspaces

    def line(self) -> str:
        parts = [f"chunks {fmt_bytes(self.chunks)}"
                 + (f" ({fmt_bytes(self.survivors)} of them survivors)" if self.survivors else "")]
        if self.executables is not None:
            parts.append(f"executables {fmt_bytes(self.executables)}")
        if self.workspaces:
            parts.append(f"workspaces {fmt_bytes(self.workspaces)}")
        if self.device is None:
            return "  accounting: " + " + ".join(parts) + " (the device's growth not measured)"
        rest = self.rest
        assert rest is not None
        return (f"  accounting: device +{fmt_bytes(self.device)} = " + " + ".join(parts)
                + f" + the rest {fmt_bytes(rest)}")


@dataclass(frozen=True)
class SizeReport:
    size: int
    capture_seconds: float
    memory_delta: int
    """Device used-memory growth while this size was captured (bytes)."""
    chunk_bytes: int | None = None
    """vmm only: physical chunk bytes after this capture."""


@dataclass(frozen=True)
class RunnerReport:
    backend: str
    kind: str
    """The pool kind: ``vmm``, ``shared``, ``private`` or ``none``."""
    mode: str
    sizes: list[SizeReport] = field(default_factory=list)
    graph_bytes: int = 0
    """Device memory used beyond what was used before the first capture (bytes)."""
    pool_figures: dict[str, int] = field(default_factory=dict)
    graphs: int = 0
    """Graphs instantiated (a piecewise size has several)."""
    driver_bytes: int | None = None
    """``graph_bytes`` less the pools' bytes: the driver's own memory of the graphs (None: see ``driver_why``)."""
    driver_why: str = ""
    executables: ExecutableStats | None = None
    """What the executables budget holds and did (None: every graph its own executable)."""
    workspace_bytes: int = 0
    """The capture stream's workspaces made since the first capture's measurement began."""
    savings: Savings | None = None
    """The framework's own ways for the same captures (vmm only)."""

    @property
    def accounting(self) -> Accounting:
        return Accounting(self.graph_bytes, self.pool_figures.get("chunk_bytes", 0),
                          self.pool_figures.get("survivor_bytes", 0),
                          self.executables.driver_bytes if self.executables is not None else None,
                          self.workspace_bytes)

    @property
    def capture_seconds(self) -> float:
        return sum(s.capture_seconds for s in self.sizes)

    def __str__(self) -> str:
        lines = [(f"GraphRunner on {self.backend}: kind={self.kind} mode={self.mode}, "
                  f"{len(self.sizes)} size(s) captured in {self.capture_seconds:.3f} s, "
                  f"graph memory {fmt_bytes(self.graph_bytes)}"),
                 _driver_line(f"{self.graphs} graph(s)", self.driver_bytes, self.driver_why)]
        if self.executables is not None:
            lines.append(f"  {self.executables}")
        lines.append(self.accounting.line())
        if self.savings is not None:
            lines.append(self.savings.line())
        for key, value in self.pool_figures.items():
            lines.append(f"  {key}: {fmt_bytes(value) if key.endswith('bytes') else value}")
        lines.append(f"  {'batch':>6} {'capture s':>10} {'memory +':>11} {'chunks':>11}")
        for s in self.sizes:
            chunks = fmt_bytes(s.chunk_bytes) if s.chunk_bytes is not None else "-"
            lines.append(f"  {s.size:>6} {s.capture_seconds:>10.4f} {fmt_bytes(s.memory_delta):>11} {chunks:>11}")
        return "\n".join(lines)


@dataclass
class KeyReport:
    """Memory of one key."""

    key: Hashable
    used_bytes: int  # bytes handed out in its space
    mapped_bytes: int  # chunk bytes mapped into its space
    reserved_bytes: int  # address space of its space
    graphs: int  # graphs captured into it that are alive (routed by graph_memory or into its handle)
    kept_bytes: int = 0  # of used_bytes, what is still allocated (outputs kept, caches): a shared pool cannot reuse it

    @property
    def label(self) -> str:
        """How the report names the key: the engine's own key as it wrote it (a batch size, a descriptor);
        ``capture N`` for the N-th capture :func:`graphkit.graph_memory` saw outside any ``pools.group(key)``."""
        return str(self.key) if getattr(type(self.key), "automatic", False) else repr(self.key)


@dataclass
class PoolsReport:
    """Per-key and total memory of a :class:`GraphPools`.

    Memory and address space are apart: ``chunk_bytes`` is the physical memory every key shares;
    ``reserved_bytes`` and ``arena_bytes`` are virtual address space, which costs no memory.
    """

    backend: str
    kind: str
    keys: list[KeyReport] = field(default_factory=list)
    chunk_bytes: int = 0  # physical memory of the shared chunks
    reserved_bytes: int = 0  # address space of the live spaces (no memory)
    arena_bytes: int = 0  # address space reserved from the driver (no memory)
    device_bytes: int | None = None  # device memory used now beyond the start, driver-measured
    map_calls: int = 0  # map calls made so far (each maps one chunk into one space)
    map_seconds: float = 0.0  # wall time those map calls took
    verified_graphs: int = 0  # captures proven not to use the other keys' memory
    inspected_nodes: int = 0  # graph nodes (ops, kernels) read for that
    missed_nodes: int = 0  # nodes the backend could not read
    verify_seconds: float = 0.0  # time reading and checking
    unread_graphs: int = 0  # of the verified graphs, those that needed no reading (no other key held memory)
    spaces: int = 0  # live virtual spaces (one per key of a vmm strategy)
    driver_bytes: int | None = None  # device_bytes less the chunks: the driver's memory of the keys' graphs
    driver_why: str = ""  # why driver_bytes is None
    survivor_bytes: int = 0  # of chunk_bytes: chunks of their own under memory that outlived its capture
    suspect_words: int = 0  # bare words in another key's live memory on the shared chunks: confirmed by a replay
    confirmed_words: int = 0  # of those, real uses (their graphs were refused)
    dismissed_words: int = 0  # never dereferenced: garbage that looked like an address
    unconfirmed_words: int = 0  # undecided (the graph's replays differ): accepted with a warning
    confirm_seconds: float = 0.0  # of verify_seconds, the time the replays over stand-ins took
    executables: ExecutableStats | None = None  # the executables budget (None: each graph its framework's own)
    workspace_bytes: int = 0  # capture streams' workspaces made since the pools opened
    outputs: str = "kept"  # what the pools do with memory a capture leaves allocated (GraphPools(outputs=...))
    granularity: int = 0  # bytes of one chunk (the device's granule)

    def kept_line(self) -> str | None:
        """What kept outputs cost and how to share them, where the pools gave them bytes of their own."""
        kept = [k for k in self.keys if k.kept_bytes]
        if not self.survivor_bytes or self.outputs != "kept" or not kept:
            return None
        held = fmt_bytes(sum(k.kept_bytes for k in kept))
        return (f"  kept: {fmt_bytes(self.survivor_bytes)} of chunks of their own under {held} still allocated "
                f"after {len(kept)} capture(s) (outputs the engine keeps), safe whenever they are read; an engine "
                "that reads each graph's outputs only right after its own replay shares them: outputs='replay' "
                "(GRAPHKIT_GRAPH_MEMORY=outputs=replay)")

    @property
    def savings(self) -> Savings | None:
        """The framework's own ways for the same captures, against the chunks (vmm only)."""
        return Savings.of(self.keys, self.chunk_bytes) if self.kind == "vmm" else None

    @property
    def accounting(self) -> Accounting:
        return Accounting(self.device_bytes, self.chunk_bytes, self.survivor_bytes,
                          self.executables.driver_bytes if self.executables is not None else None,
                          self.workspace_bytes)

    @property
    def shared_bytes(self) -> int:
        """Of :attr:`chunk_bytes`, the chunks every key maps (what N captures cost, the largest one's)."""
        return self.chunk_bytes - self.survivor_bytes

    @property
    def graphs(self) -> int:
        """Graphs alive in the keys (the sum of the keys' ``graphs``)."""
        return sum(k.graphs for k in self.keys)

    def __str__(self) -> str:
        granules = f" in {fmt_bytes(self.granularity)} granules" if self.granularity else ""
        memory = (f"memory {fmt_bytes(self.chunk_bytes)} of chunks{granules}" if self.kind == "vmm"
                  else "memory from the device's own allocator")
        if self.survivor_bytes:
            memory += (f" ({fmt_bytes(self.shared_bytes)} shared, {fmt_bytes(self.survivor_bytes)} under memory "
                       "that outlived its capture)")
        if self.device_bytes is not None:
            memory += f" (device +{fmt_bytes(self.device_bytes)})"
        lines = [f"graph pools on {self.backend} ({self.kind}): {len(self.keys)} key(s) holding {self.graphs} "
                 f"graph(s); {memory}"
                 + (f"; address space {fmt_bytes(self.reserved_bytes)} in {self.spaces} space(s), no memory"
                    if self.spaces else "")
                 + (f"; {self.map_calls} map calls in {self.map_seconds * 1e3:.1f} ms" if self.map_calls else "")
                 + (f"; {self.verified_graphs} capture(s) verified isolated ({self.inspected_nodes} nodes read"
                    + (f", {self.missed_nodes} unreadable" if self.missed_nodes else "")
                    + (f", {self.unread_graphs} needed no reading" if self.unread_graphs else "")
                    + f", {self.verify_seconds * 1e3:.1f} ms)" if self.verified_graphs else "")
                 + (f"; {self.suspect_words} suspect word(s): {self.confirmed_words} confirmed, "
                    f"{self.dismissed_words} dismissed, {self.unconfirmed_words} unconfirmed, in "
                    f"{self.confirm_seconds * 1e3:.1f} ms of replays" if self.suspect_words else ""),
                 _driver_line(f"the graphs of {len(self.keys)} key(s)", self.driver_bytes, self.driver_why)]
        if self.executables is not None:
            lines.append(f"  {self.executables}")
        lines.append(self.accounting.line())
        if self.savings is not None:
            lines.append(self.savings.line())
        kept = self.kept_line()
        if kept is not None:
            lines.append(kept)
        width = max([16, *(len(k.label) for k in self.keys)])
        for k in self.keys:
            lines.append(f"  {k.label:>{width}}  used {fmt_bytes(k.used_bytes):>10}  mapped "
                         f"{fmt_bytes(k.mapped_bytes):>10}  graphs {k.graphs}")
        return "\n".join(lines)


def pools_report(backend: str, kind: str, keys: Iterable[tuple[Hashable, int | None, int, int]],
                 alloc: SharedVMMAllocator | None, device_bytes: int | None, stats: VerifyStats,
                 device: hal.Backend | None = None, executables: ExecutableStats | None = None,
                 workspace_bytes: int = 0, outputs: str = "kept") -> PoolsReport:
    """The report of pools whose ``keys`` are ``(key, space id or None, routed graphs, kept bytes)``, over ``alloc``
    (vmm);
    ``device``: the backend ``device_bytes`` was measured on (for the driver's memory)."""
    spaces = alloc.spaces if alloc is not None else {}
    g = alloc.granularity if alloc is not None else 0
    reports = []
    for key, space_id, graphs, kept in keys:
        space = spaces.get(space_id) if space_id is not None else None
        reports.append(KeyReport(key, space.offset if space else 0, space.mapped * g if space else 0,
                                 space.size if space else 0, graphs, kept))
    driver, why = (driver_memory(device, device_bytes, alloc.physical_bytes if alloc else None)
                   if device is not None else (None, "not measured"))
    return PoolsReport(backend, kind, reports,
                       alloc.physical_bytes if alloc else 0, alloc.reserved_bytes if alloc else 0,
                       alloc.arena_reserved_bytes if alloc else 0, device_bytes,
                       alloc.map_calls if alloc else 0, alloc.map_seconds if alloc else 0.0,
                       stats.graphs, stats.nodes, stats.missed, stats.seconds, stats.unread, len(spaces), driver,
                       why, alloc.survivor_bytes if alloc else 0, suspect_words=stats.suspects,
                       confirmed_words=stats.confirmed, dismissed_words=stats.dismissed,
                       unconfirmed_words=stats.unconfirmed, confirm_seconds=stats.confirm_seconds,
                       executables=executables, workspace_bytes=workspace_bytes, outputs=outputs, granularity=g)
