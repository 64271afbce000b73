"""Vmm graph memory for engines that own their capture loop: :class:`GraphPools` and :func:`graph_memory`.

Two ways in, for a loop that calls ``torch.cuda.graph(g, pool=...)`` itself:

* **one changed line**: ``pool=pools.pool(batch_size)`` -- a handle that the
  framework's capture API, ``torch.npu.graph`` and :meth:`hal.Backend.capture`
  all take; one fresh virtual space per key over chunks shared by all keys;
* **no changed line**: ``with graphkit.graph_memory() as pools:`` around the
  loop -- every capture started inside draws from a fresh space, whatever
  pool the engine passes; ``pools.group(key)`` keeps the captures of one
  batch (the pieces of a piecewise graph) in one space.

graphkit keeps every pool alive (the framework silently falls back to a
private pool when a pool id outlives its pool object); a handle used after
its pool was released raises :class:`hal.InvalidStateError`.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import weakref
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from typing import Any, Literal

import hal
from graphkit.graphs.capture import CaptureHygieneError, leftover_blocks, report_leftovers, warm_up_checked
from graphkit.graphs.executables import DEFAULT, Budget, Executables, checked_budget
from graphkit.graphs.isolation import IsolationError, Verifier, VerifyStats
from graphkit.graphs.keys import CaptureKey, Captures, Check, KeyPool, OwnedKeys, PoolHandle, PoolKeys
from graphkit.graphs.report import KeyReport, PoolsReport, pools_report
from graphkit.graphs.routing import CaptureRouting
from graphkit.graphs.scope import ScopeRouter, served_children
from graphkit.graphs.strategies import POOL_KINDS, Lease, PoolStrategy, make_pool_strategy
from graphkit.memory.allocator import SharedVMMAllocator
from graphkit.memory.closing import Closable, after_backend, close_step, raise_first_failure
from graphkit.saver import GRAPHS, MemorySaver
from hal.transaction import Transaction
from hal.types import Route

log = logging.getLogger(__name__)

Kind = Literal["vmm", "shared", "private"]
#: what an engine does with what its graphs leave allocated (see GraphPools(outputs=...))
Outputs = Literal["kept", "replay"]
_ALLOCATOR_OPTIONS = frozenset({"reserve_bytes", "max_physical_bytes", "arena_bytes"})


def _check_arguments(backend: object, kind: object, saver: object, allocator_options: dict[str, Any],
                     caller: str, outputs: object = "kept", executables: object = None, **flags: object) -> None:
    """The arguments of a GraphPools, checked before anything is made (``flags``: options that take a bool)."""
    name = getattr(backend, "name", None)
    checked_budget(executables, caller, name)
    if outputs not in ("kept", "replay"):
        raise hal.InvalidArgumentError(f"outputs={outputs!r} must be 'kept' or 'replay'", backend=name, call=caller)
    _check_flags(caller, name, **flags)
    if backend is not None and not isinstance(backend, hal.Backend):
        raise hal.InvalidArgumentError(f"backend={backend!r} must be a hal.Backend", call=caller)
    if kind is not None and kind not in POOL_KINDS:
        raise hal.InvalidArgumentError(f"kind={kind!r} must be one of {', '.join(POOL_KINDS)}", backend=name,
                                       call=caller)
    unknown = sorted(set(allocator_options) - _ALLOCATOR_OPTIONS)
    if unknown:
        takes = "allocator_options takes" if caller == "GraphRunner" else "GraphPools takes kind, hygiene, saver and"
        raise hal.InvalidArgumentError(f"unknown option(s) {', '.join(unknown)}; {takes} "
                                       f"{', '.join(sorted(_ALLOCATOR_OPTIONS))}", backend=name, call=caller)
    if saver is not None and not isinstance(saver, MemorySaver):
        raise hal.InvalidArgumentError(f"saver={saver!r} must be a graphkit.MemorySaver", backend=name, call=caller)


def _check_flags(caller: str, backend: str | None = None, **flags: object) -> None:
    """Options that take ``True`` or ``False`` (``verify``, ``hygiene``, ``children``): anything else is a hal error
    naming the option (a truthy string such as ``"no"`` would turn it on)."""
    for flag, value in flags.items():
        if not isinstance(value, bool):
            raise hal.InvalidArgumentError(f"{flag}={value!r} must be True or False", backend=backend, call=caller)


def _adopt(saver: MemorySaver, strategy: PoolStrategy, caller: str, be: hal.Backend) -> None:
    """Hand a vmm strategy's allocator to ``saver`` (tag ``graphs``); closes the strategy when that fails."""
    with Transaction() as tx:
        tx.append(strategy.close)
        allocator = strategy.allocator
        if allocator is None:
            raise hal.UnsupportedError(f"kind={strategy.kind!r} draws from the framework's allocator and cannot "
                                       "sleep with a MemorySaver: use kind='vmm' on a backend with 'custom_pool'",
                                       backend=be.name, call=caller)
        saver.adopt(allocator, GRAPHS)
        tx.commit()


_unbudgeted: set[str] = set()  # backends whose missing capabilities were said (once each)


def _kept(pools: GraphPools, entry: KeyPool) -> int:
    """Bytes still allocated in ``entry``'s own pool (0 where keys share one: it cannot be told apart)."""
    return 0 if pools.kind != "vmm" else sum(n for _, n in pools.backend.pool_active_blocks(entry.pool))


def budget(be: hal.Backend, per_topology: Budget) -> Executables | None:
    """The executables budget ``per_topology`` on ``be``; None without one (asked for none, or the backend cannot
    leave graphs uninstantiated -- or, for a K, update them: said once per backend)."""
    if per_topology is None:
        return None
    needs = ("lazy_graphs",) if per_topology == "lazy" else ("lazy_graphs", "graph_update")
    missing = [c for c in needs if not be.supports(c)]
    if missing:
        if be.name not in _unbudgeted:
            _unbudgeted.add(be.name)
            log.info("%s lacks %s: every graph keeps the executable its framework makes at the end of its capture "
                     "(no executables budget)", be.name, " and ".join(repr(c) for c in missing))
        return None
    return Executables(be, None if per_topology == "lazy" else per_topology)


def _abandoned(backend_name: str, entries: Mapping[Hashable, KeyPool]) -> None:
    if entries:
        log.warning("a GraphPools on %s with %d live key(s) was garbage-collected without close(): its memory "
                    "stays mapped for the graphs that may still use it (call close() when they are gone)",
                    backend_name, len(entries))


class GraphPools(Closable):
    """Graph memory pools keyed by the engine's own keys (batch sizes, batch descriptors).

    ``pool(key)`` returns one handle per key: a fresh virtual space over
    chunks every key shares, so N keys cost the physical memory of the
    largest. graphkit holds every pool until ``release(key)``, ``close()`` or
    the end of the ``with`` block.

    :param backend: a :class:`hal.Backend`; default ``hal.get_backend()``
        (then owned and closed with the pools).
    :param kind: ``"vmm"`` (default), ``"shared"`` (one pool drawn from
        the device's own allocator for every key: the engines' usual set-up)
        or ``"private"`` (a pool of the device's own allocator per key: what
        a capture gets without any pool, the costliest). ``"vmm"`` falls
        back to ``"shared"``, with a warning, on a backend without pools over
        custom allocators.
    :param hygiene: after each capture routed by :func:`graph_memory`, log
        the allocations it made that outlive it (a cache or workspace born
        inside a capture: it gets memory of its own, a granule per key).
    :param saver: a :class:`graphkit.MemorySaver`: the pools' chunks sleep
        and wake with its tag ``"graphs"`` (graphs replay after a resume
        without recapture; nothing of theirs may run while paused).
    :param outputs: ``"kept"`` (default): memory still allocated in a key's space when its capture ends
        (kept outputs, caches) gets physical memory of its own at the same addresses, so no other key's
        replay overwrites it; ``"replay"``: the engine reads its graphs' outputs only right after their
        own replay, and they stay on the shared chunks (``docs/isolation.md``).
    :param verify: the optional verifier: refuse a graph (:class:`graphkit.IsolationError`) that uses
        memory another key keeps on the shared chunks, read from the graph (``"graph_addresses"``;
        skipped with one log line without it; handle captures seen through ``"capture_routing"``).
    :param executables: the executables budget (:mod:`graphkit.graphs.executables`): ``"lazy"`` (default: an
        executable per graph at its first replay, none for one never replayed), K (at most K per topology,
        updated), ``None`` (one per graph, made at its capture's end).
    :param allocator_options: options of :class:`SharedVMMAllocator`
        (``reserve_bytes``, ``max_physical_bytes``, ``arena_bytes``).
    """

    def __init__(self, backend: hal.Backend | None = None, kind: Kind = "vmm", *, hygiene: bool = False,
                 saver: MemorySaver | None = None, verify: bool = False, outputs: Outputs = "kept",
                 executables: Budget = DEFAULT, **allocator_options: Any) -> None:
        self._open(backend, kind, None, hygiene=hygiene, saver=saver, verify=verify, outputs=outputs,
                   executables=executables, allocator_options=allocator_options, runner=False)

    @classmethod
    def for_runner(cls, backend: hal.Backend, kind: Kind = "vmm", *, strategy: PoolStrategy | None = None,
                   saver: MemorySaver | None = None, verify: bool = False,
                   executables: Budget = DEFAULT, **allocator_options: Any) -> GraphPools:
        """Pools whose keys a :class:`graphkit.GraphRunner` captures into itself, through :meth:`lease`.

        As ``GraphPools(backend, kind, ...)``, except that captures into handles are not watched (the runner
        checks its captures with :meth:`isolation_check`), errors name ``GraphRunner``, the runner closes
        them (no warning when they are garbage-collected), a vmm strategy settles with a garbage collection
        and parks the spaces live tensors still use at close.

        :param strategy: a ready :class:`graphkit.graphs.strategies.PoolStrategy` (overrides ``kind`` and
            the allocator options).
        """
        return runner_pools(backend, kind, strategy=strategy, saver=saver, verify=verify, executables=executables,
                            **allocator_options)[0]

    def _open(self, backend: hal.Backend | None, kind: Kind, strategy: PoolStrategy | None, *, hygiene: bool,
              saver: MemorySaver | None, verify: bool, outputs: Outputs, executables: Budget,
              allocator_options: dict[str, Any], runner: bool) -> None:
        """Set the pools up (see :meth:`for_runner` for what ``runner`` changes)."""
        self._caller = caller = "GraphRunner" if runner else "GraphPools"
        _check_arguments(backend, kind if strategy is None else None, saver, allocator_options, caller, outputs,
                         executables, hygiene=hygiene, verify=verify)
        self._owns_backend = backend is None
        self.backend = be = backend if backend is not None else hal.get_backend(requires=("graphs",))
        be.synchronize()
        self._used_at_start, self._workspaces_at_start = be.mem_info().used, be.stream_state_bytes()
        self.strategy = strategy or make_pool_strategy(kind, be, caller, park_live=runner, collect=runner,
                                                       **allocator_options)
        self.kind: str = self.strategy.kind
        self.allocator: SharedVMMAllocator | None = self.strategy.allocator
        self.hygiene, self.outputs, self.verify = hygiene, outputs, verify  # as asked (read, never written)
        self.saver = saver
        if saver is not None:
            _adopt(saver, self.strategy, caller, be)
        self._keys = keys = PoolKeys(be, self.strategy, self, caller, outputs)
        self._close_done = False
        self._verifier = Verifier(keys, verify)
        captures = Captures(keys, self._verifier)
        self._owned = OwnedKeys(keys, captures, caller)  # the verbs of an owner that captures itself
        self.per_topology, self.executables = executables, budget(be, executables)  # as asked; the budget
        self._routing = CaptureRouting(keys, captures, hygiene=hygiene, watch=not runner,
                                       executables=self.executables)
        self._finalizer = weakref.finalize(self, _abandoned, be.name, keys.entries if not runner else {})

    # -- keys -----------------------------------------------------------------------

    def pool(self, key: Hashable) -> PoolHandle:
        """The handle of ``key``'s pool: the same handle for the same key until it is released.

        Captures into handles (of this method and of :meth:`group`) are watched (verified, their replays
        served by the executables budget) from the first handle made until :meth:`close`, where the
        backend routes captures. A key's space keeps room to grow until the key is released: handles may be
        asked for in any order, and captures into several keys may run in several threads at once.
        """
        return self._routing.handle(key)

    def lease(self, key: Hashable) -> Lease:
        """``key``'s lease -- its backend pool and, for ``vmm``, its virtual space -- made on first use.

        For an owner that captures into the backend pool itself (a
        :class:`graphkit.GraphRunner`); such captures are not watched: check
        them with :meth:`isolation_check` and :meth:`seal` the key when they
        are done.
        """
        return self._owned.lease(key)

    def isolation_check(self, key: Hashable, fix: str | None = None) -> Check | None:
        """The isolation check of a capture into ``key``'s :meth:`lease` that starts now; None where nothing
        is checked (``verify=False``, no vmm spaces, a backend that cannot read graphs).

        Where ``check.read``, pass ``check`` as the capture's ``verify`` (it reads the graph before the
        capture is accepted and raises :class:`IsolationError`); then call ``check.done()``.

        :param fix: what the caller should do when a graph reads another key's memory, for the message.
        """
        return self._owned.check(key, fix)

    def seal(self, key: Hashable, why: str = "when pools.seal(key) was called") -> None:
        """No more captures go to ``key``'s space: it keeps the address space its captures used, no more.

        :meth:`group` does it when its block ends; an owner that captures into :meth:`lease` does it once
        the key's captures are done. ``why`` is logged with the trimmed space.
        """
        self._owned.seal(key, why)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._keys.entries

    @property
    def keys(self) -> list[Hashable]:
        return list(self._keys.entries)

    def capture_ended(self, key: Hashable, shared: Sequence[tuple[int, int]] = ()) -> None:
        """After captures into :meth:`lease` (routed and handle captures need no call): what they left allocated
        gets memory of its own (see ``outputs``), except ``shared`` blocks, read only right after the key's own
        replay."""
        self._owned.ended(key, shared)

    def release(self, key: Hashable) -> None:
        """Give the memory of ``key`` back; its handle raises from now on.

        Release a key after its graphs are reset: the space's addresses stay
        reserved until the framework frees the last block in it.
        """
        self._keys.release(key)

    def collect(self) -> None:
        """Release now what graphs that were garbage-collected left behind (done at every call anyway)."""
        self._keys.collect()

    # -- routing ----------------------------------------------------------------------

    def group(self, key: Hashable) -> contextlib.AbstractContextManager[PoolHandle]:
        """Inside :func:`graph_memory`: the captures started in this block (this thread) share ``key``'s space.

        For piecewise graphs: piece k's output feeds piece k + 1, so the
        pieces of one batch must never share physical bytes with each other.
        Yields ``key``'s handle (as :meth:`pool`; captures into it are
        verified inside or outside the scope). When the outermost block of
        ``key`` ends, its space is sealed: trimmed to what its captures used.
        """
        return self._routing.group(key)

    def route(self, graph: Any, requested_pool: Any) -> Route | None:
        """The router :func:`graph_memory` installs: a fresh space per capture, or the current group's
        (torch.compile's graph trees are left to torch; ``make_graphed_callables`` shares one space per call)."""
        return self._routing.route(graph, requested_pool)

    @property
    def verify_stats(self) -> VerifyStats:
        """What the isolation check of the captures into these pools did so far."""
        return self._verifier.stats

    # -- hygiene helpers ----------------------------------------------------------------

    def warm_up(self, fn: Callable[..., Any], *args: Any, runs: int = 1, stream: Any = None,
                **kwargs: Any) -> Any:
        """Run ``fn(*args, **kwargs)`` ``runs`` times on the stream captures use, wait, return the last result.

        ``stream`` defaults to the stream the framework's capture API uses
        when given none (``torch.cuda.graph``'s side stream), so lazily
        created state (cuBLAS workspaces, caches) is born outside the capture.
        """
        return warm_up_checked(self.backend, fn, args, kwargs, runs=runs, stream=stream, call="GraphPools.warm_up")

    def leftovers(self, key: Hashable, outputs: Any, strict: bool = False) -> list[tuple[int, int]]:
        """Blocks of ``key``'s pool still allocated that hold none of ``outputs``; logged (raised,
        :class:`CaptureHygieneError`, when ``strict``)."""
        entry = self._keys.lookup(key, "leftovers")
        if entry is None:
            raise hal.InvalidStateError(f"key={key!r} has no pool", backend=self.backend.name,
                                        call="GraphPools.leftovers")
        found = leftover_blocks(self.backend, entry.lease, outputs)
        report_leftovers(self.backend, found, f"key {key!r}", strict=strict)
        return found

    # -- figures --------------------------------------------------------------------------

    def report(self, measure: bool = True) -> PoolsReport:
        """Per-key and total bytes: chunks, spaces, and device memory as the driver measures it.

        :param measure: ``False``: no device call (no synchronisation, no driver query; ``device_bytes`` is
            None), so that it can be asked from any thread while another captures.
        """
        return self._keys.step(lambda: self._report(measure))

    def _report(self, measure: bool) -> PoolsReport:
        """:meth:`report`, as one step of the key table."""
        self._check_open("report")
        self._keys.settle()
        keys = [(e.key, e.space_id, e.graphs, _kept(self, e)) for e in self._keys.entries.values()]
        device_bytes = None
        if measure:
            self.backend.synchronize()
            device_bytes = self.backend.mem_info().used - self._used_at_start
        return pools_report(self.backend.name, self.kind, keys, self.allocator, device_bytes,
                            self.verify_stats, self.backend,
                            self.executables.stats if self.executables is not None else None,
                            self.backend.stream_state_bytes() - self._workspaces_at_start, self.outputs)

    # -- teardown -------------------------------------------------------------------------

    def _check_open(self, call: str) -> None:
        self._keys.check_open(call)

    @property
    def closed(self) -> bool:
        return self._keys.closed

    def close(self) -> None:
        """Release every pool, unmap every space, release the chunks. Idempotent.

        Reset (or drop) the graphs captured with these pools first: their
        memory is gone after this. Goes on past failures and raises the
        first; ``close()`` again finishes the job. After the backend's close
        it only forgets its keys (the backend released them), with a warning.
        """
        self._keys.step(self._close)

    def _close(self) -> None:
        """:meth:`close`, as one step of the key table."""
        if self._close_done:
            return
        self._keys.closing()  # from here on every call raises InvalidStateError
        self._finalizer.detach()
        self._routing.stop()
        if self.executables is not None:
            self.executables.close()  # a replay of a graph of these pools raises from now on
        errors: list[BaseException] = []
        if after_backend(self.backend, log, self._caller):  # its close released every pool, space and chunk
            self._keys.forget()
        else:
            close_step(errors, self.backend.synchronize)
        gc.collect()  # framework tensors of these pools caught in reference cycles go while the pools exist
        self._keys.close(errors)
        if self.saver is not None and self.allocator is not None:
            self.saver.forget(self.allocator)  # a pause must not reach an allocator being closed
        if not self._keys.entries:  # a key whose pool would not go keeps its space for the retry
            close_step(errors, self.strategy.close)
        raise_first_failure(log, errors, f"{self._caller}.close")
        self._close_done = True
        if self._owns_backend:
            self.backend.close()

    def own_backend(self, *, for_the_process: bool = False) -> None:
        """Close the backend with the pools: it was made for them alone (by :func:`graph_memory`, the switch).

        :param for_the_process: the pools live as long as the process (the switch's): no warning when it
            exits with them open.
        """
        self._owns_backend = True
        if for_the_process:
            self._finalizer.atexit = False

    def __repr__(self) -> str:
        return f"<graphkit.GraphPools {self.backend.name} {self.kind} " + (
            "closed>" if self.closed else f"{len(self._keys.entries)} key(s)>")


def runner_pools(backend: hal.Backend, kind: Kind = "vmm", *, strategy: PoolStrategy | None = None,
                 saver: MemorySaver | None = None, verify: bool = False, executables: Budget = DEFAULT,
                 **allocator_options: Any) -> tuple[GraphPools, OwnedKeys]:
    """The pools of a :class:`graphkit.GraphRunner` (see :meth:`GraphPools.for_runner`) and the verbs of the keys
    it captures into itself."""
    pools = GraphPools.__new__(GraphPools)
    pools._open(backend, kind, strategy, hygiene=False, saver=saver, verify=verify, outputs="kept",
                executables=executables, allocator_options=allocator_options, runner=True)
    return pools, pools._owned


@contextlib.contextmanager
def graph_memory(backend: hal.Backend | None = None, *, pools: GraphPools | None = None, kind: Kind = "vmm",
                 hygiene: bool = False, verify: bool = False, outputs: Outputs = "kept", children: bool = True,
                 executables: Budget = DEFAULT, **allocator_options: Any) -> Iterator[GraphPools]:
    """Every capture started inside the block draws from a fresh vmm space of the yielded :class:`GraphPools`.

    Whatever pool the engine passes -- none, its own shared pool, or
    ``graph.pool()`` of an earlier graph -- is replaced; ``pools.group(key)``
    puts the captures inside it into one space (the pieces of one batch).
    A space lives as long as its graph: it is released when the graph is
    reset or garbage-collected. The pools outlive the block (the graphs
    replay after it); close them when the graphs are gone. Leaving the
    block restores the framework's capture API exactly, also on errors.

    :param pools: use these pools instead of new ones (then ``backend``,
        ``kind``, ``hygiene``, ``verify``, ``outputs`` and the allocator options are theirs).
    :param outputs: see :class:`GraphPools`: by default what a capture
        leaves allocated (its outputs, a piece's output the next piece reads)
        gets bytes of its own while it stays allocated, so a piecewise forward
        whose pieces' outputs the engine keeps alive replays right without
        ``pools.group(key)`` (one that drops them after the capture needs it).
    :param verify: the optional verifier of :class:`GraphPools`.
    :param executables: the executables budget of :class:`GraphPools` (``"lazy"``, K, or None).
    :param children: processes started inside the block (an engine's tensor-parallel ranks, its engine-core
        process) serve their own captures the same way, through ``GRAPHKIT_GRAPH_MEMORY`` set for the
        block's duration (:func:`graphkit.graphs.scope.served_children`; a value set already wins).
    :raises hal.UnsupportedError: the backend cannot route the framework's captures.
    """
    if pools is not None and not isinstance(pools, GraphPools):
        raise hal.InvalidArgumentError(f"pools={pools!r} must be a graphkit.GraphPools", call="graph_memory")
    _check_flags("graph_memory", hygiene=hygiene, verify=verify, children=children)
    if backend is not None and not isinstance(backend, hal.Backend):
        raise hal.InvalidArgumentError(f"backend={backend!r} must be a hal.Backend (hal.get_backend(...))",
                                       call="graph_memory")
    if pools is None:
        chosen = backend if backend is not None else hal.get_backend(requires=("graphs", "capture_routing"))
        pools = GraphPools(chosen, kind, hygiene=hygiene, verify=verify, outputs=outputs, executables=executables,
                           **allocator_options)
        if backend is None:
            pools.own_backend()
    with (pools.backend.route_captures(pools.route), hal.route_every_capture(ScopeRouter(pools)),
          served_children(pools) if children else contextlib.nullcontext()):
        yield pools


__all__ = ["CaptureHygieneError", "CaptureKey", "GraphPools", "IsolationError", "KeyReport", "PoolHandle",
           "PoolsReport", "graph_memory"]
