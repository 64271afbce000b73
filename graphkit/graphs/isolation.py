"""The optional isolation verifier: at capture end, refuse a graph that really uses another key's memory.

Graphs of different keys of one :class:`graphkit.GraphPools` (or sizes of one
vmm :class:`graphkit.GraphRunner`) live in different virtual spaces mapped
onto the *same* physical chunks. A graph that uses an address inside another
key's space -- a tensor another capture allocated and left alive, typically
the previous piece's output in a piecewise forward -- reads bytes that its
own capture's intermediates overwrite at replay: wrong results, silently.

The backend reads the addresses from the captured graph itself
(:meth:`hal.Backend.graph_addresses`); :func:`foreign_uses` matches them
against the live spaces and :func:`check` turns a match into an
:class:`IsolationError` that names both keys and the fix, from the
:class:`Context` that the pools' :class:`Verifier` gathers at the capture's
end (:class:`KeyCheck`: the check of one key's captures).

A span the backend knows the graph uses (a tensor of the host recorder, a
memcpy or memset node) is a use. A bare word (an argument word of a kernel,
``nbytes=1``) is only a *suspect*: a by-value argument may hold a number that
happens to equal an address. :class:`Confirmation` decides by behaviour: the
foreign granules the suspect words point into are backed, at the same
addresses, by scratch chunks (:meth:`SharedVMMAllocator.stand_in`); the graph
is replayed twice over a copy of their bytes (the reference; two replays that
differ leave the suspects unconfirmed, and the graph is accepted with a
warning), then once over a canary (every byte inverted). The word is a real
use iff that replay's result -- the bytes of the checked key's space, and the
scratch granules for a write -- differs from the reference. The foreign key's
own chunks are never written; they are mapped back after the replays. Where
the replays cannot be made -- a driver fault, memory paused, a capture under
way into the foreign key's space (never remapped under a capture) -- the graph
is refused, never accepted: an undecided word may be a real use.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Hashable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

import hal
from graphkit.memory.ranges import VirtualSpace
from hal.types import GraphAddresses, fmt_bytes

if TYPE_CHECKING:
    from graphkit.graphs.keys import KeyPool, PoolKeys
    from graphkit.memory.allocator import SharedVMMAllocator

log = logging.getLogger(__name__)

#: what an isolation error advises, for a capture graph_memory routed and for one into pools.pool(key)
FIX_ROUTED = ("Put the captures that pass tensors to each other (the pieces of one batch) in one space: "
              "`with pools.group(key):` around them")
FIX_KEYED = ("Use one key for the captures that pass tensors to each other (the pieces of one batch): "
             "the same pools.pool(key), or `with pools.group(key):` around them")


class IsolationError(hal.CaptureError):
    """A captured graph uses memory in another key's space; the graph was refused (released)."""


@dataclass(frozen=True)
class ForeignUse:
    """The part of one graph's addresses that falls into the space of another key."""

    space_id: int
    addresses: int  # how many of the graph's spans or pointers fall there
    nbytes: int  # bytes of those spans inside the space (1 per pointer whose size is unknown)
    first: int  # the lowest such address
    pointers: int = 0  # how many of them are bare pointers (sizes unknown)
    blocks: tuple[tuple[int, int], ...] = ()  # the live blocks of that space they fall in, where known
    confirmed: bool = False  # bare pointers whose use a replay over a canary confirmed

    @property
    def suspect(self) -> bool:
        """Whether every address is a bare pointer (a word of a kernel's arguments): a use only once confirmed."""
        return self.pointers == self.addresses

    def __str__(self) -> str:
        if self.pointers == self.addresses:
            return f"{self.pointers} pointer(s)" + (" (confirmed by a replay over a canary)" if self.confirmed else "")
        return f"{fmt_bytes(self.nbytes)} ({self.nbytes} bytes) of {self.addresses} tensor(s)"


@dataclass
class VerifyStats:
    """What verification did so far, for reports."""

    graphs: int = 0  # graphs proven isolated (read and checked, or needing no reading)
    nodes: int = 0  # nodes (ops, kernels) the backend read
    missed: int = 0  # nodes the backend could not read
    seconds: float = 0.0  # time spent reading graphs and checking (confirmation included)
    unread: int = 0  # of ``graphs``, those proven without reading them: no other key held shared memory then
    suspects: int = 0  # bare words found in another key's live memory on the shared chunks: suspects
    confirmed: int = 0  # of those, the words a replay over a canary confirmed (their graphs were refused)
    dismissed: int = 0  # the words the replay showed unused (garbage that looks like an address)
    unconfirmed: int = 0  # words left undecided: accepted with a warning where two plain replays differ, refused
    # where no replay over stand-ins could be made (a fault, paused memory, a capture under way there)
    confirm_seconds: float = 0.0  # of ``seconds``, the time spent confirming (replays and stand-ins)

    def skip(self) -> None:
        """Count a graph that needed no reading: when it was captured, no other key held live memory on the
        shared chunks."""
        self.graphs += 1
        self.unread += 1

    def add(self, found: GraphAddresses, asking: float, checking: float) -> None:
        """Count one verified graph: ``asking`` the seconds the backend took to answer, ``checking`` ours.

        A backend that read the graph while it was being captured (cuda) answers at once; the time it
        spent reading then is ``found.seconds``, and counts too.
        """
        self.graphs += 1
        self.nodes += found.nodes
        self.missed += found.missed
        self.seconds += max(asking, found.seconds) + checking


def _hits(spans: tuple[tuple[int, int], ...], ranges: list[tuple[int, int, int]]) -> list[ForeignUse]:
    """For each range id, how much of ``spans`` falls in its ``(lo, hi, id)`` ranges (and which ranges)."""
    ordered = sorted(ranges)
    starts = [lo for lo, _, _ in ordered]
    hits: dict[int, list[int]] = {}  # range id -> [count, bytes, first address, pointers]
    reached: dict[int, set[tuple[int, int]]] = {}  # range id -> the (lo, size) ranges reached
    for ptr, nbytes in spans:
        end = ptr + max(nbytes, 1)
        i = max(bisect.bisect_right(starts, ptr) - 1, 0)
        while i < len(ordered) and ordered[i][0] < end:
            lo, hi, space_id = ordered[i]
            if hi > ptr:
                hit = hits.setdefault(space_id, [0, 0, max(ptr, lo), 0])
                hit[0] += 1
                hit[1] += min(end, hi) - max(ptr, lo)
                hit[2] = min(hit[2], max(ptr, lo))
                hit[3] += nbytes <= 1
                reached.setdefault(space_id, set()).add((lo, hi - lo))
            i += 1
    return [ForeignUse(space_id, hit[0], hit[1], hit[2], hit[3], tuple(sorted(reached[space_id])))
            for space_id, hit in sorted(hits.items())]


def foreign_uses(found: GraphAddresses, spaces: Mapping[int, VirtualSpace], own: int | None,
                 live_blocks: Callable[[int], list[tuple[int, int]] | None] | None = None) -> list[ForeignUse]:
    """The spaces other than ``own`` that the graph's spans reach into, with how much of each.

    :param live_blocks: the blocks still allocated in a space (None where
        unknown): a use counts only inside one of them. A backend that finds
        bare pointers among kernel arguments also finds integers that happen
        to fall in a space (a division constant); inside a live block of
        another key they are what the check is about.
    """
    # a bare word that is odd is no address of a tensor wider than a byte: packed integers of kernel arguments
    # (the multiplier and shift of a division by a constant) are odd and fall among device addresses
    spans = tuple(span for span in found.spans if span[1] > 1 or not span[0] & 1)
    uses = _hits(spans, [(s.base, s.base + s.size, s.id) for s in spaces.values() if s.id != own and s.size])
    if not uses or live_blocks is None:
        return [ForeignUse(u.space_id, u.addresses, u.nbytes, u.first, u.pointers) for u in uses]
    ranges: list[tuple[int, int, int]] = []
    known: set[int] = set()
    for use in uses:
        blocks = live_blocks(use.space_id)
        space = spaces[use.space_id]
        if blocks is not None:
            known.add(use.space_id)
        ranges += ([(space.base, space.base + space.size, use.space_id)] if blocks is None
                   else [(ptr, ptr + size, use.space_id) for ptr, size in blocks])
    return [u if u.space_id in known else ForeignUse(u.space_id, u.addresses, u.nbytes, u.first, u.pointers)
            for u in _hits(spans, ranges)]


@dataclass(frozen=True)
class Context:
    """What checking one graph of one key needs to know about the other keys.

    :param spaces: every live space of the pools, by id.
    :param own: the space of the graph's key (None: none of these spaces is its own).
    :param key: the graph's key, for the message.
    :param key_of: the key whose space has a given id (None for a space that no longer belongs to a key).
    :param fix: what the caller should do when the memory is another capture's output, for the message.
    :param live_blocks: the blocks still allocated in a space (None where unknown): a use counts only
        inside one of them (see :func:`foreign_uses`).
    :param state_sizes: ``{bytes: what}`` of per-stream library state the backend makes ahead of captures
        (:meth:`hal.Backend.stream_state_sizes`), to name a block of that size.
    :param allocator: the allocator of ``spaces``, to confirm suspect words over stand-ins (None: suspects are
        not confirmed by :func:`verify`; they count as uses).
    :param capturing: whether a capture into the space with a given id is under way (on another thread): such a
        space is never remapped, so its words cannot be confirmed now.
    """

    backend: hal.Backend
    spaces: Mapping[int, VirtualSpace]
    own: int | None
    key: Hashable
    key_of: Callable[[int], Hashable | None]
    fix: str
    live_blocks: Callable[[int], list[tuple[int, int]] | None] | None = None
    state_sizes: Mapping[int, str] = field(default_factory=dict)
    allocator: SharedVMMAllocator | None = None
    capturing: Callable[[int], bool] = lambda space_id: False


def verify(ctx: Context, graph: Any, stats: VerifyStats) -> None:
    """Ask the backend which addresses ``graph`` uses, :func:`check` them (suspects confirmed by replaying
    ``graph``, see :class:`Confirmation`), and count it in ``stats``."""
    start = time.perf_counter()
    found = ctx.backend.graph_addresses(graph)
    asked = time.perf_counter()
    try:
        check(ctx, found, Confirmation(ctx, graph, stats) if ctx.allocator is not None else None)
    finally:
        stats.add(found, asked - start, time.perf_counter() - asked)


#: ``confirm(suspects, found) -> the suspects that are real uses``
Confirm = Callable[[list[ForeignUse], GraphAddresses], list[ForeignUse]]


def check(ctx: Context, found: GraphAddresses, confirm: Confirm | None = None) -> None:
    """Raise :class:`IsolationError` when the graph of ``ctx.key`` uses memory another key left alive in its space.

    The message says what the memory is -- its blocks and their sizes, the capture that allocated them, and
    where graphkit can tell, what made them (a library's per-stream workspace) -- and the fix for that case.

    :param confirm: decides which suspects (bare words only, see :attr:`ForeignUse.suspect`) are real uses,
        where no other use refuses the graph already. None: every match counts.
    """
    foreign = foreign_uses(found, ctx.spaces, ctx.own, ctx.live_blocks)
    if foreign and confirm is not None:
        sure = [use for use in foreign if not use.suspect]
        foreign = sure or confirm([use for use in foreign if use.suspect], found)
    if not foreign:
        return
    parts, fixes = [], []
    for use in foreign:
        other = ctx.key_of(use.space_id)
        owner = f"key {other!r}" if other is not None else f"a released space (id {use.space_id})"
        part, fix = _explain(use, owner, ctx.state_sizes)
        parts.append(part)
        if fix not in fixes:
            fixes.append(fix)
    generic = (f"If it is another capture's output that this graph takes as an input: {ctx.fix}. If it is a cache "
               "or buffer made lazily during that capture (by the model or a library), make it before the first "
               "capture: one eager run of the step on the capture stream does")
    raise IsolationError(
        f"the graph of key {ctx.key!r} uses memory that another capture allocated and left alive: "
        f"{'; '.join(parts)}. Keys share physical memory, so those bytes are overwritten by this graph's "
        f"own intermediates before it reads them, and replay gives wrong results. "
        f"{' '.join(f or generic + '.' for f in fixes)} The graph was refused (its capture undone); the pools "
        "stay usable", backend=ctx.backend.name, call="capture")


def _explain(use: ForeignUse, owner: str, state_sizes: Mapping[int, str]) -> tuple[str, str]:
    """What one foreign use is, for the message, and the fix where its kind is known ('' where it is not)."""
    where = f"{use} in the space of {owner}, from {use.first:#x}"
    if not use.blocks:
        return where, ""
    sizes = sorted({size for _, size in use.blocks})
    named = [state_sizes[size] for size in sizes if size in state_sizes]
    text = (f"{where}: {len(use.blocks)} block(s) of {', '.join(f'{fmt_bytes(n)} ({n} bytes)' for n in sizes)} "
            f"that the capture of {owner} allocated and left alive")
    if not named:
        return text, ""
    fix = (f"That is state a library makes at its first use of a stream: a GEMM ran for the first time on "
           f"that stream and thread inside the capture of {owner}. graphkit makes it ahead of every capture "
           "it starts or routes (hal.Backend.prepare_capture_stream); that capture began where graphkit did "
           "not see it: capture through graph_memory() or a pools' handle, or call "
           "backend.prepare_capture_stream(stream) on the capture's stream and thread before capturing.")
    return f"{text} -- the size of {named[0]} for one stream", fix


# -- confirming suspects ------------------------------------------------------------------------


def _suspect_words(found: GraphAddresses, use: ForeignUse, space: VirtualSpace) -> list[int]:
    """The bare words of ``found`` that make up ``use``: in ``space``, in its live blocks where known."""
    return sorted(ptr for ptr, nbytes in found.spans
                  if nbytes <= 1 and not ptr & 1 and space.contains(ptr)
                  and (not use.blocks or any(lo <= ptr < lo + size for lo, size in use.blocks)))


def _replay(backend: hal.Backend, graph: Any) -> None:
    """Replay ``graph``: one hal made through the backend, a framework's own (a routed capture's) by itself."""
    if type(graph).__module__.split(".")[0] == "torch":
        graph.replay()
    else:
        backend.replay(graph)


class Confirmation:
    """Tells which suspect words of one graph its replay really uses, by replaying it over stand-ins.

    For the granules the suspect words point into, :meth:`SharedVMMAllocator.stand_in` maps scratch chunks at
    the same addresses of the foreign spaces. Every replay starts from the same state: the checked key's space
    as the capture left it, the scratch granules filled with a copy of the foreign bytes (the reference, twice:
    two replays that differ leave the words unconfirmed) or with those bytes inverted (the canary). A word is a
    use iff the canary replay leaves the key's space, or the scratch granules, otherwise than the reference.
    Where the replays cannot be made (a fault, paused memory, a capture under way into a foreign space) the
    graph is refused: the fault is raised, or :class:`IsolationError`.

    :param ctx: the check's context (its ``allocator`` and ``own`` space).
    :param graph: the captured graph, replayable (its capture ended).
    :param stats: where the words and the seconds are counted.
    """

    def __init__(self, ctx: Context, graph: Any, stats: VerifyStats) -> None:
        self.ctx, self.graph, self.stats = ctx, graph, stats

    def __call__(self, suspects: list[ForeignUse], found: GraphAddresses) -> list[ForeignUse]:
        """The suspects that are real uses (confirmed); the others are dismissed or left unconfirmed."""
        start = time.perf_counter()
        words = {use.space_id: _suspect_words(found, use, self.ctx.spaces[use.space_id]) for use in suspects}
        count = sum(len(w) for w in words.values())
        self.stats.suspects += count
        try:
            confirmed = self._decide(suspects, words)
        finally:
            self.stats.confirm_seconds += time.perf_counter() - start
        real = {use.space_id for use in confirmed}
        self.stats.confirmed += sum(len(w) for sid, w in words.items() if sid in real)
        return [dataclasses.replace(use, confirmed=True) for use in confirmed]

    def _decide(self, suspects: list[ForeignUse], words: dict[int, list[int]]) -> list[ForeignUse]:
        """Replay over stand-ins; where that cannot be done, or fails, the graph is refused, never accepted: a
        suspect left undecided may be a real use (the graph would replay wrong)."""
        ctx, alloc = self.ctx, self.ctx.allocator
        busy = [sid for sid in words if ctx.capturing(sid)]
        why = ("its memory cannot be backed by stand-ins now (paused or closed)"
               if alloc is None or alloc.closed or alloc.paused or ctx.own is None or ctx.own not in alloc.spaces
               else f"a capture into {self._owners(busy)} is under way (a space is never remapped under a capture)"
               if busy else "")
        if why:
            raise self._refusal(suspects, why)
        assert alloc is not None
        g = alloc.granularity
        granules = {sid: sorted({(w - ctx.spaces[sid].base) // g for w in ws}) for sid, ws in words.items()}
        try:
            return self._replays(suspects, words, granules)
        except hal.HalError as exc:
            self.stats.unconfirmed += sum(len(w) for w in words.values())
            raise exc.led_by(f"key {ctx.key!r}: its graph could not be replayed over stand-ins to tell whether words "
                             "of its arguments that equal addresses of another key's live memory are used: the "
                             "capture is refused (capture it again)") from exc

    def _owners(self, space_ids: list[int]) -> str:
        return ", ".join(f"key {self.ctx.key_of(sid)!r}" for sid in space_ids)

    def _refusal(self, suspects: list[ForeignUse], why: str) -> IsolationError:
        count = sum(use.pointers for use in suspects)
        self.stats.unconfirmed += count
        return IsolationError(f"the graph of key {self.ctx.key!r} carries {count} word(s) equal to addresses of "
                              f"memory {self._owners([u.space_id for u in suspects])} keeps on the shared chunks, and "
                              f"whether it uses them cannot be told now: {why}. The capture is refused (capture it "
                              "again once that is over)", backend=self.ctx.backend.name, call="capture")

    def _replays(self, suspects: list[ForeignUse], words: dict[int, list[int]],
                 granules: dict[int, list[int]]) -> list[ForeignUse]:
        ctx, be = self.ctx, self.ctx.backend
        alloc = ctx.allocator
        assert alloc is not None and ctx.own is not None
        g = alloc.granularity
        own = alloc.spaces[ctx.own]
        places = {(sid, i): ctx.spaces[sid].base + i * g for sid, indices in granules.items() for i in indices}
        saved = {key: be.tensor_at(ptr, g).clone() for key, ptr in places.items()}  # the foreign bytes, as they are
        canary = {key: torch.bitwise_not(data) for key, data in saved.items()}
        start = be.tensor_at(own.base, own.offset).clone() if own.offset else None
        run = functools.partial(self._run, places, g, own.base, start)
        with alloc.stand_in(granules), self._restored(own.base, start), self._left(places, g, saved):
            first, reference = run(saved), run(saved)
            if not _same(first, reference):
                return self._unconfirmed(sum(len(w) for w in words.values()),
                                         "two plain replays of its graph differ (it is not deterministic)")
            if not _uses(run(canary), reference):
                self.stats.dismissed += sum(len(w) for w in words.values())
                log.debug("key %r: %d suspect word(s) dismissed: a replay over a canary changed nothing", ctx.key,
                          sum(len(w) for w in words.values()))
                return []
            confirmed = suspects
            if len(suspects) > 1:  # which of them: one space's granules over the canary at a time
                confirmed = [use for use in suspects if _uses(run(
                    {key: canary[key] if key[0] == use.space_id else saved[key] for key in places}), reference)]
                confirmed = confirmed or suspects  # only together: all of them
        real = {use.space_id for use in confirmed}
        self.stats.dismissed += sum(len(w) for sid, w in words.items() if sid not in real)
        return confirmed

    @contextlib.contextmanager
    def _left(self, places: dict[tuple[int, int], int], g: int, saved: dict[tuple[int, int], torch.Tensor]
              ) -> Iterator[None]:
        """The scratch granules hold the foreign bytes again after the block: a granule whose own chunk would not
        map back keeps its scratch chunk, and with it the bytes it had."""
        try:
            yield
        finally:
            for key, ptr in places.items():
                self.ctx.backend.tensor_at(ptr, g).copy_(saved[key])

    @contextlib.contextmanager
    def _restored(self, base: int, start: torch.Tensor | None) -> Iterator[None]:
        """The key's space holds ``start`` again after the block: as its capture left it."""
        try:
            yield
        finally:
            if start is not None:
                self.ctx.backend.tensor_at(base, len(start)).copy_(start)

    def _run(self, places: dict[tuple[int, int], int], g: int, base: int, start: torch.Tensor | None,
             fill: dict[tuple[int, int], torch.Tensor]) -> tuple[torch.Tensor | None, bool]:
        """Fill the scratch granules with ``fill`` and the key's space with ``start``, replay; return the key's
        space as the replay left it, and whether the replay wrote into a scratch granule."""
        be = self.ctx.backend
        for key, ptr in places.items():
            be.tensor_at(ptr, g).copy_(fill[key])
        if start is not None:
            be.tensor_at(base, len(start)).copy_(start)
        _replay(be, self.graph)
        left = be.tensor_at(base, len(start)).clone() if start is not None else None
        return left, any(not torch.equal(be.tensor_at(ptr, g), fill[key]) for key, ptr in places.items())

    def _unconfirmed(self, count: int, why: str) -> list[ForeignUse]:
        log.warning("key %r: %d word(s) of its graph equal addresses in memory another key keeps on the shared "
                    "chunks, but %s: unconfirmed, the graph is accepted", self.ctx.key, count, why)
        self.stats.unconfirmed += count
        return []


def _same(left: tuple[torch.Tensor | None, bool], right: tuple[torch.Tensor | None, bool]) -> bool:
    """Whether two replays left the same: the key's space byte for byte, and a write into the scratch or none."""
    (a, wrote_a), (b, wrote_b) = left, right
    return wrote_a == wrote_b and (a is None or b is None or torch.equal(a, b))


def _uses(canary: tuple[torch.Tensor | None, bool], reference: tuple[torch.Tensor | None, bool]) -> bool:
    """Whether the replay over the canary shows a use: it wrote into the scratch, or read it (the key's space
    differs from the reference)."""
    return canary[1] or reference[1] or not _same((canary[0], False), (reference[0], False))


# -- the check of the keys of one GraphPools ---------------------------------------------------


class KeyCheck:
    """The isolation check of the captures of one key, decided before they begin (by :meth:`Verifier.check`).

    A graph can only misuse memory that another key holds alive on the shared chunks; when no other key
    holds any there (``read`` is False: nothing, or only survivors on chunks of their own), the graph needs
    no reading and is counted as proven without it. Nothing
    allocates in a key's space outside its captures, so a key found holding nothing holds nothing
    until its next capture.

    :param verifier: the pools' verifier (the other keys, the figures).
    :param entry: the key the captures go to.
    :param fix: what the caller should do when the graph reads another capture's output, for the message.
    :param read: whether the graph must be read.
    """

    def __init__(self, verifier: Verifier, entry: KeyPool, fix: str, read: bool) -> None:
        self.verifier, self.entry, self.fix, self.read = verifier, entry, fix, read

    def __call__(self, graph: Any) -> None:
        """Check ``graph`` (captured with its addresses recorded); raises :class:`IsolationError`."""
        verify(self.verifier.context(self.entry, self.fix), graph, self.verifier.stats)

    def accepted(self, graph: Any) -> None:
        """The capture of ``graph`` ended well: check it where it must be read, then note it (:meth:`done`)."""
        if self.read:
            self(graph)
        self.done()

    def done(self) -> None:
        """The captures into the key ended well (each checked where it had to be read): note what it holds."""
        if not self.read:
            self.verifier.stats.skip()
        self.verifier.note_live(self.entry)


class Verifier:
    """The isolation check of the keys of one :class:`graphkit.GraphPools` and what it did (:attr:`stats`).

    :param keys: the pools' key table, read under its lock.
    :param enabled: check at all; it is on only where keys have spaces of their own (``vmm``) and the
        backend can say which addresses a graph uses.
    """

    def __init__(self, keys: PoolKeys, enabled: bool) -> None:
        self.keys = keys
        self.stats = VerifyStats()
        self.enabled = bool(enabled) and keys.allocator is not None and readable(keys.backend, [])

    def check(self, entry: KeyPool, fix: str | None = None) -> KeyCheck | None:
        """The check of a capture into ``entry`` starting now (None where there is nothing to check or no way
        to); it reads the graph only where another key holds memory that may still be alive. Under the lock.

        :param fix: what the caller should do, for the message (default: the advice for pools' keys).
        """
        if not self.enabled or entry.space_id is None:
            return None
        read = any(self.on_shared(other) for other in reversed(list(self.keys.entries.values()))
                   if other is not entry and other.space_id is not None and other.live != ())
        return KeyCheck(self, entry, fix or (FIX_ROUTED if entry.auto else FIX_KEYED), read)

    def on_shared(self, entry: KeyPool) -> bool:
        """Whether ``entry`` may hold memory on the shared chunks now, where another key's replay can overwrite
        it (:meth:`note_live`, then the blocks on granules it does not map alone). Survivors, on chunks of
        their own, are not: a graph may read them however it got the address, so their holder alone never
        makes a capture worth reading."""
        if not self.note_live(entry):
            return False
        if entry.live is None or entry.space_id is None or self.keys.allocator is None:
            return True
        return bool(self.keys.allocator.on_shared_chunks(entry.space_id, entry.live))

    def context(self, entry: KeyPool, fix: str) -> Context:
        """What checking a graph of ``entry`` against the other keys needs (read under the lock)."""
        keys, alloc = self.keys, self.keys.allocator
        assert alloc is not None and entry.space_id is not None
        owners = keys.owners()

        def key_of(space_id: int) -> Hashable | None:
            owner = owners.get(space_id)
            return None if owner is None else owner.key

        def capturing(space_id: int) -> bool:
            owner = owners.get(space_id)
            return owner is not None and owner.capturing

        def live_blocks(space_id: int) -> list[tuple[int, int]] | None:
            """The blocks of ``space_id`` another replay may overwrite: survivors with bytes of their own are not."""
            owner = owners.get(space_id)
            if owner is None:
                return None
            return alloc.on_shared_chunks(space_id, keys.backend.pool_active_blocks(owner.pool))

        return Context(keys.backend, alloc.spaces, own=entry.space_id, key=entry.key, key_of=key_of, fix=fix,
                       live_blocks=live_blocks, state_sizes=keys.backend.stream_state_sizes(), allocator=alloc,
                       capturing=capturing)

    def note_live(self, entry: KeyPool) -> bool:
        """Have the table note what ``entry``'s pool holds now (:meth:`PoolKeys.note_live`); whether it may hold
        anything."""
        return self.keys.note_live(entry)


def readable(backend: hal.Backend, logged: list[bool]) -> bool:
    """Whether ``backend`` can say which addresses a graph uses; logs once (per ``logged``) when not."""
    if backend.supports("graph_addresses"):
        return True
    if not logged:
        log.info("%s cannot tell which addresses a captured graph uses (no 'graph_addresses' capability): "
                 "graphs are not checked for reads of other keys' memory", backend.name)
        logged.append(True)
    return False


__all__ = ["FIX_KEYED", "FIX_ROUTED", "Confirmation", "Context", "ForeignUse", "IsolationError", "KeyCheck", "Verifier",
           "VerifyStats", "check", "foreign_uses", "verify"]
