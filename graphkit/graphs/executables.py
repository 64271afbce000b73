"""The executables budget: every captured size replayable, at the driver's memory of the executables it needs.

Besides the memory a graph's work reads and writes, a device driver keeps an
*executable* form of every instantiated graph (CUDA: ``cudaGraphExec_t``, a
few MiB per graph of a decoder, growing with its kernel nodes). Engines pay it
once per captured size, at its capture's end, whether the size is ever used or
not.

:class:`Executables` owns the executable forms of the graphs it serves
(captured lazily: ``create_graph(lazy=True)``, or routed with
:attr:`hal.types.Route.on_replay`). Two budgets:

* ``"lazy"`` (the default, :data:`DEFAULT`): a graph gets an executable of
  its own at its first replay, and keeps it; a graph never replayed costs
  none. Replays run as fast as the framework's own (measured);
* ``K`` (an int): graphs of one *topology* -- the same kernels in the same
  order with other arguments, as the sizes of one decode step mostly are --
  share at most ``K`` executables, the least recently used one updated to
  the graph asked for (CUDA: ``cuGraphExecUpdate``, hal's
  :meth:`hal.Backend.update_graph`). At its first replay a graph joins the
  first topology whose executable takes an update to it; one that none takes
  starts a topology of its own (refusals are counted). The memory of K
  executables per topology, at a price: on an H200 an updated executable
  replays about 1.3 x slower than one made for its graph, and an update
  costs about a millisecond (``BENCHMARKS.md``, "Executables").

A graph that draws random numbers keeps an executable of its own where the
backend says its replay's generator bookkeeping is per graph (CUDA: torch
advances the generators by what each graph drew). ``None`` instead of a
budget leaves every graph the executable its framework makes at the end of
its capture.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import hal
from hal.types import fmt_bytes

log = logging.getLogger(__name__)

#: a budget: ``"lazy"`` (an executable per graph, made at its first replay), an int K >= 1 (at most K per
#: topology, updated), or None (the framework's way: made at the capture's end)
Budget = int | Literal["lazy"] | None
#: the default budget: chosen from ``python -m graphkit_bench.trace`` and the replay times of updated executables
#: (BENCHMARKS.md, "Executables"): no K met the trace's step-time targets on an H200, lazy executables replay at the
#: framework's speed
DEFAULT: Budget = "lazy"


def checked_budget(value: object, call: str, backend: str | None = None, name: str = "executables") -> Budget:
    """``value`` as an executables budget (see :data:`Budget`); anything else is refused naming ``name``."""
    if value is None or value == "lazy":
        return value
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise hal.InvalidArgumentError(f"{name}={value!r} must be 'lazy' (an executable per graph, made at its first "
                                       "replay), an int >= 1 (executable graphs kept per topology, updated) or None "
                                       "(every graph its own, made at its capture's end)", backend=backend, call=call)
    return value


@dataclass(frozen=True)
class ExecutableStats:
    """What an :class:`Executables` holds and did."""

    per_topology: int | None  # None: lazy, an executable per graph replayed
    graphs: int = 0  # graphs served (replayed at least once, not released)
    executables: int = 0  # executable forms alive now
    topologies: int = 0  # topologies among the served graphs (those drawing random numbers not counted)
    instantiations: int = 0  # executables made (a first replay)
    updates: int = 0  # executables updated to run another graph's work
    refused: int = 0  # updates the backend refused (another topology), each followed by another try
    own: int = 0  # graphs keeping an executable of their own (they draw random numbers)
    driver_bytes: int | None = None  # device memory the driver took for them (None: not measured, a host device)
    update_seconds: float = 0.0  # host time of the updates

    def __str__(self) -> str:
        memory = fmt_bytes(self.driver_bytes) if self.driver_bytes is not None else "no driver memory (host device)"
        each = f" ({self.update_seconds / self.updates * 1e3:.2f} ms each)" if self.updates else ""
        own = f", {self.own} of their own (random numbers)" if self.own else ""
        if self.per_topology is None:
            return (f"executables: {self.executables} for {self.graphs} graph(s) replayed (lazy: one per graph at its "
                    f"first replay, none for a graph never replayed){own}; {memory}")
        return (f"executables: {self.executables} for {self.graphs} graph(s) replayed, {self.topologies} "
                f"topolog{'y' if self.topologies == 1 else 'ies'} (at most {self.per_topology} each){own}; "
                f"{self.instantiations} instantiated, {self.updates} update(s){each}, {self.refused} refused; "
                f"{memory}")


class _Member:
    """A served graph: its topology, and -- where it holds an executable -- whose work that one runs now."""

    __slots__ = ("host", "key", "ref", "running", "topology", "used")

    def __init__(self, key: int, ref: Callable[[], Any]) -> None:
        self.key, self.ref = key, ref  # the graph is held weakly: its owner decides its life
        self.topology: _Topology | None = None  # None: not replayed yet
        self.host = False  # holds an executable
        self.running: _Member | None = None  # a host's executable runs this member's work (None: unknown)
        self.used = 0  # when its executable last ran (a host's)


class _Topology:
    __slots__ = ("hosts", "members", "random")

    def __init__(self) -> None:
        self.hosts: list[_Member] = []
        self.members = 0
        self.random = False  # its graphs draw random numbers: each keeps an executable of its own


class Executables:
    """The executable forms of the graphs one owner serves (a :class:`graphkit.GraphPools`, a runner).

    :param backend: the backend the graphs were captured on (``"lazy_graphs"``; ``"graph_update"`` for a K).
    :param per_topology: executables kept per topology (>= 1); None: one per graph, made at its first replay.

    :meth:`replay` runs a graph; :meth:`forget` drops one that was released (its executable goes with it).
    A graph is held weakly: one garbage-collected is forgotten at the next call.
    """

    def __init__(self, backend: hal.Backend, per_topology: int | Literal["lazy"] | None = None) -> None:
        self.backend = backend
        budget = checked_budget(per_topology, "Executables", backend.name)
        self.per_topology: int | None = None if budget == "lazy" else budget
        self._members: dict[int, _Member] = {}  # by the graph's id (checked against the member's reference)
        self._topologies: list[_Topology] = []
        self._dead: collections.deque[_Member] = collections.deque()
        self._lock = threading.RLock()
        self._clock = 0
        self._counts = {"instantiations": 0, "updates": 0, "refused": 0}
        self._update_seconds = 0.0
        self._measured = backend.torch_device().type != "cpu"  # a host device's graphs keep no driver memory
        self._driver_bytes = 0
        self._random_said = False
        self._closed = False

    # -- serving ------------------------------------------------------------------------------

    def serving(self) -> tuple[Callable[[Any], None], Callable[[bool], None]]:
        """``(on_replay, on_release)`` for one routed capture (see :attr:`hal.types.Route.on_replay`):
        ``on_release`` forgets the graph ``on_replay`` served (call it from the route's own)."""
        served: list[_Member] = []

        def on_replay(graph: Any) -> None:
            self.replay(graph, served)

        def on_release(collected: bool) -> None:
            if served:
                self._gone(served[0], collected)

        return on_replay, on_release

    def replay(self, graph: Any, served: list[_Member] | None = None) -> None:
        """Run ``graph``'s work: through the executable that runs it now, a new one while its topology has
        room, else the least recently used one of its topology, updated to it.

        :raises hal.InvalidStateError: the backend is closed, or the graph was released.
        """
        with self._lock:
            if self.backend.closed:
                raise hal.InvalidStateError("the backend is closed: its graphs and their executables are gone",
                                            backend=self.backend.name, call="replay")
            self.backend.check_replayable(graph)  # before any executable is changed for it
            if self._closed:  # the pools closed: their graphs' memory is gone (the check above says so)
                raise hal.InvalidStateError("the graph's pools are closed, and its memory with them",
                                            backend=self.backend.name, call="replay")
            self._bury()
            member = self._member(graph)
            if served is not None and not served:
                served.append(member)
            host = self._executable_for(member)
            self._clock += 1
            host.used = self._clock
            if host is member and not self._instantiated(member):
                self._instantiate(member)
            else:
                self.backend.launch(self._resolve(host))

    def forget(self, graph: Any) -> None:
        """``graph`` is released (or about to be): its executable, if it holds one, goes with it."""
        with self._lock:
            member = self._members.get(id(graph))
            if member is not None and member.ref() is graph:
                self._drop(member)

    def executable_of(self, graph: Any) -> Any:
        """The graph object whose executable runs ``graph``'s work now (``graph`` itself where it holds its
        own), or None where none does: what a hand-written loop would launch to run it as the budget does."""
        with self._lock:
            member = self._members.get(id(graph))
            if member is None or member.ref() is not graph or member.topology is None:
                return None
            host = next((h for h in member.topology.hosts if h.running is member), None)
            return host.ref() if host is not None else None

    def close(self) -> None:
        """Forget every graph (their owners release them); later replays raise."""
        with self._lock:
            self._closed = True
            self._members.clear()
            self._topologies.clear()
            self._dead.clear()

    @property
    def stats(self) -> ExecutableStats:
        with self._lock:
            self._bury()
            members = [m for m in self._members.values() if m.topology is not None]
            return ExecutableStats(
                self.per_topology, len(members), sum(m.host for m in members),
                sum(not t.random for t in self._topologies) if self.per_topology is not None else 0,  # lazy: none
                own=sum(t.random for t in self._topologies),
                driver_bytes=self._driver_bytes if self._measured else None,
                update_seconds=self._update_seconds, **self._counts)

    # -- the choice ---------------------------------------------------------------------------

    def _member(self, graph: Any) -> _Member:
        member = self._members.get(id(graph))
        if member is not None and member.ref() is graph:
            return member
        dead = self._dead
        cell: list[_Member] = []

        def collected(_: object) -> None:  # in the garbage collector: only take note
            dead.extend(cell)

        try:
            ref: Callable[[], Any] = weakref.ref(graph, collected)
        except TypeError:  # a graph object without weak references: held until forgotten
            ref = _strong(graph)
        member = _Member(id(graph), ref)
        cell.append(member)
        self._members[member.key] = member
        return member

    def _executable_for(self, member: _Member) -> _Member:
        """The host whose executable runs ``member``'s work after this call (updated where needed)."""
        graph = self._resolve(member)
        topology = member.topology
        if self.per_topology is None:  # lazy: its own, made at its first launch, never updated
            if topology is None:
                topology = member.topology = _Topology()
                topology.members += 1
                self._topologies.append(topology)
                return self._hosting(member)
            return member
        if topology is None:
            found = self._classify(member, graph)
            if found is not None:
                host, previous = found
                topology = member.topology
                assert topology is not None
                if len(topology.hosts) >= self.per_topology:
                    return host
                if previous is not None:  # room for one more: the host runs its work again, this graph its own
                    self._update(host, previous)
                return self._hosting(member)
            topology = member.topology = _Topology()
            topology.members += 1
            self._topologies.append(topology)
            return self._hosting(member)
        for host in topology.hosts:
            if host.running is member:
                return host
        if member.host:  # its own executable runs another's work now: give it its own back
            self._update(member, member)
            return member
        if topology.random or len(topology.hosts) < self.per_topology:
            return self._hosting(member)
        host = min(topology.hosts, key=lambda h: h.used)  # the least recently used goes
        self._update(host, member)
        return host

    def _classify(self, member: _Member, graph: Any) -> tuple[_Member, _Member | None] | None:
        """Put a member replayed for the first time into the first topology whose executable takes an update
        to it; ``(that host, whose work it ran before)``, or None where no topology takes it."""
        for topology in self._topologies:
            if topology.random or not topology.hosts:
                continue
            host = min(topology.hosts, key=lambda h: h.used)
            previous = host.running
            try:
                self._update(host, member, graph)
            except hal.InvalidArgumentError as exc:  # another topology (or random numbers): the next one
                self._counts["refused"] += 1
                host.running = None  # what it runs after a refusal is not counted on
                log.debug("executables: %r is not of a topology with %d executable(s): %s", graph,
                          len(topology.hosts), exc)
                continue
            member.topology = topology
            topology.members += 1
            return host, previous
        return None

    def _hosting(self, member: _Member) -> _Member:
        """``member`` takes an executable of its own (made at its launch)."""
        assert member.topology is not None
        member.host, member.running = True, member
        member.topology.hosts.append(member)
        return member

    def _instantiate(self, member: _Member) -> None:
        """Launch a host's own work for the first time: that makes its executable."""
        graph = self._resolve(member)
        before = self._used()
        self.backend.launch(graph)
        self._counts["instantiations"] += 1
        self._add_bytes(before)
        topology = member.topology
        if topology is not None and getattr(graph, "draws_random", None) and not topology.random:
            topology.random = True  # its graphs keep executables of their own (see the module's doc)
            if not self._random_said:
                self._random_said = True
                log.info("executables: a graph that draws random numbers keeps an executable of its own on %s",
                         self.backend.name)

    def _update(self, host: _Member, member: _Member, graph: Any = None) -> None:
        """Make ``host``'s executable run ``member``'s work (instantiating ``host`` first where it must)."""
        source = graph if graph is not None else self._resolve(member)
        target = self._resolve(host)
        fresh = not self._instantiated(host)
        before = self._used()
        t0 = time.perf_counter()
        self.backend.update_graph(target, source)
        self._update_seconds += time.perf_counter() - t0
        self._counts["updates"] += 1
        if fresh:
            self._counts["instantiations"] += 1
        self._add_bytes(before)
        host.running = member

    def _instantiated(self, member: _Member) -> bool:
        """Whether a host's executable exists (it ran, or was updated, once)."""
        graph = self._resolve(member)
        flag = getattr(graph, "instantiated", None)
        if flag is None:
            flag = getattr(graph, "compiled", None)  # a host device's recording
        return bool(flag)

    def _resolve(self, member: _Member) -> Any:
        graph = member.ref()
        if graph is None:
            raise hal.InvalidStateError("the graph was garbage-collected", backend=self.backend.name, call="replay")
        return graph

    # -- memory --------------------------------------------------------------------------------

    def _used(self) -> int:
        return self.backend.mem_info().used if self._measured else 0

    def _add_bytes(self, before: int) -> None:
        if self._measured:
            self._driver_bytes += max(0, self._used() - before)

    # -- graphs that go -------------------------------------------------------------------------

    def _gone(self, member: _Member, collected: bool) -> None:
        if collected or not self._lock.acquire(blocking=False):
            self._dead.append(member)  # the next call forgets it
            return
        try:
            self._drop(member)
        finally:
            self._lock.release()

    def _bury(self) -> None:
        while self._dead:
            self._drop(self._dead.popleft())

    def _drop(self, member: _Member) -> None:
        if self._members.get(member.key) is member:
            del self._members[member.key]
        topology = member.topology
        if topology is None:
            return
        member.topology = None
        topology.members -= 1
        if member.host:  # its executable is destroyed with it
            member.host = False
            topology.hosts.remove(member)
        for host in topology.hosts:
            if host.running is member:
                host.running = None  # updated again before its next launch
        if topology.members <= 0 and topology in self._topologies:
            self._topologies.remove(topology)


def _strong(obj: Any) -> Callable[[], Any]:
    return lambda: obj


__all__ = ["DEFAULT", "Budget", "ExecutableStats", "Executables", "checked_budget"]
