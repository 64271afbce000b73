"""One release/restore machine: physical chunks, the places they are mapped at, and a host backup.

The allocator's sleep, elastic buffers and the saver's regions all keep
device memory whose physical chunks go away while their virtual addresses
stay, and come back at the same addresses. Each keeps its own list of
:class:`Place` (a chunk mapped at an address) and hands it to a
:class:`Backing`, which does the driver steps and keeps what failed:

* :meth:`Backing.pause` copies the bytes to the host where asked, unmaps every
  place (all or nothing) and releases every chunk;
* :meth:`Backing.resume` creates the chunks again, maps every place that is a
  hole and copies the backup back (all or nothing);
* a rollback that could not map a place back leaves a *hole*: the owner reads
  :attr:`Backing.paused` until a resume maps it;
* a chunk whose release fails is *pending*: kept in :attr:`Backing.pending`
  and released by a later :meth:`Backing.retry`, never lost.

The device runs behind the host: kernels queued before an unmap may still
read or write the place (the driver does not promise that an unmap waits for
them, and a device that lost a mapping under a kernel kills the process).
So every :meth:`Backing.unmap` is ordered after all the work queued on the
device so far (:func:`wait_for_device`); an operation that unmaps many places
waits once, inside :meth:`Backing.ordered`. A chunk is released only once it
is mapped nowhere, a range only once nothing is mapped in it: both come after
such an unmap, so they wait through it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import hal
from graphkit.memory.phases import CAPTURE_TIMES
from hal.transaction import Transaction

if TYPE_CHECKING:
    from graphkit.memory.host_backup import HostBackup

log = logging.getLogger(__name__)


_waited = threading.local()  # per thread: ids of the backends a waited_for_device() block of it has waited for


@contextlib.contextmanager
def waited_for_device(backend: hal.Backend) -> Iterator[None]:
    """A block whose caller waited for ``backend``'s device just before it and queues no work over the memory it
    unmaps inside it (it holds the lock every user of that memory takes, as a saver's pause does): the unmaps in
    the block need no wait of their own. Work graphkit itself queues there (a backup's copies) waits for itself.
    """
    held: set[int] = getattr(_waited, "backends", None) or set()
    _waited.backends = held
    mine = id(backend) not in held
    held.add(id(backend))
    try:
        yield
    finally:
        if mine:
            held.discard(id(backend))


def wait_for_device(backend: hal.Backend) -> None:
    """Wait until every piece of work queued on ``backend``'s device so far has finished (before an unmap).

    The whole device, not one stream: graphkit does not know which streams the framework queued work on
    over a place (eager kernels on any stream, a graph replayed on its capture stream, a collective on
    its own). Nothing is waited for where the backend declares that its unmap waits already (capability
    ``"unmap_waits"``), where it is closed (its close waited), where it has no runtime to queue work on
    (no ``"graphs"``: a driver without its framework extension), or while this thread captures a graph (a
    capture runs nothing, and a device-wide wait would end the capture), or inside a :func:`waited_for_device`
    block of this thread (its caller waited already).
    """
    if (backend.closed or id(backend) in getattr(_waited, "backends", ()) or backend.supports("unmap_waits")
            or not backend.supports("graphs") or backend.capturing()):
        return
    backend.synchronize()


@dataclass(eq=False)
class Chunk:
    """One physical allocation of ``size`` bytes: its handle (None while released) and how many places map it."""

    size: int
    handle: Any = None
    maps: int = 0


@dataclass(eq=False)
class Place:
    """``chunk`` mapped at ``ptr`` (``mapped`` false: a hole, released by a pause or left by a failed rollback)."""

    ptr: int
    chunk: Chunk
    mapped: bool = False

    @property
    def size(self) -> int:
        return self.chunk.size


class Backing:
    """The driver steps over chunks and places, each recorded the moment it succeeded, and what failed.

    :param host: where a pause copies the bytes it is asked to back up (None: it never backs up).
    :param counted: count every map call in :attr:`map_calls`, :attr:`map_seconds` and the ``"maps"``
        part of :data:`graphkit.memory.phases.CAPTURE_TIMES`.
    """

    def __init__(self, backend: hal.Backend, host: HostBackup | None = None, counted: bool = False) -> None:
        self.backend = backend
        self.host = host
        self.counted = counted
        self._pending: list[Any] = []  # chunk handles mapped nowhere whose release failed: released later
        self._sleeping = False  # released by a pause
        self._holes = False  # a rollback left a place unmapped
        self._map_calls = 0
        self._map_seconds = 0.0
        self._ordered = 0  # depth of ordered() blocks: their unmaps wait once, at the start

    # -- figures (only the backing writes them) ------------------------------------------------

    @property
    def paused(self) -> bool:
        """Whether some memory is released or unmapped: nothing may use the places until :meth:`resume`."""
        return self._sleeping or self._holes

    @property
    def sleeping(self) -> bool:
        """Released by a pause (or stopped for good by :meth:`mark_sleeping`)."""
        return self._sleeping

    @property
    def holes(self) -> bool:
        """A rollback left a place unmapped (a resume or :meth:`fill` maps it)."""
        return self._holes

    @property
    def pending(self) -> list[Any]:
        """Chunk handles mapped nowhere whose release failed, released by a later :meth:`retry` (a copy)."""
        return list(self._pending)

    @property
    def map_calls(self) -> int:
        """Map calls made so far (counted backings only)."""
        return self._map_calls

    @property
    def map_seconds(self) -> float:
        """Wall time those map calls took."""
        return self._map_seconds

    def mark_sleeping(self) -> None:
        """Nothing of it may run any more (its owner closed): :attr:`paused` from now on."""
        self._sleeping = True

    # -- steps ------------------------------------------------------------------------------

    def create(self, chunk: Chunk, tx: Transaction | None = None) -> None:
        """Create ``chunk``'s handle; released again on rollback of ``tx`` (see :meth:`drop`)."""
        chunk.handle = self.backend.create_phy_mem_handle(chunk.size)
        if tx is not None:
            tx.append(functools.partial(self.drop, chunk))

    def drop(self, chunk: Chunk) -> None:
        """Undo of a creation: release the chunk unless a mapping that would not go still uses it."""
        if chunk.maps:
            log.error("a chunk is still mapped (an unmap failed): kept until it can be unmapped")
            return
        self.release(chunk)

    def release(self, chunk: Chunk) -> bool:
        """Release ``chunk`` (mapped nowhere); one that will not go is pending. Whether it went; never raises."""
        handle, chunk.handle = chunk.handle, None
        return handle is not None and self.release_handle(handle)

    def hand_over(self, chunk: Chunk) -> Any:
        """``chunk`` (mapped nowhere) gives its handle to a new holder (a free list): returned, the chunk holds none."""
        handle, chunk.handle = chunk.handle, None
        return handle

    def release_handle(self, handle: Any) -> bool:
        """Release a handle mapped nowhere; one whose release fails twice is pending (released later)."""
        for attempt in (1, 2):
            try:
                self.backend.release_phy_mem_handle(handle)
                return True
            except hal.HalError as exc:
                if attempt == 2:
                    log.warning("a chunk could not be released yet (kept, released later): %s", str(exc))
        self._pending.append(handle)
        return False

    def keep_pending(self, handles: Iterable[Any]) -> None:
        """Handles mapped nowhere whose release failed elsewhere: pending here, released by :meth:`retry`."""
        self._pending.extend(handles)

    def take_pending(self) -> list[Any]:
        """Hand the pending chunks to whoever releases them later (they are no longer kept here)."""
        pending, self._pending = self._pending, []
        return pending

    def retry(self) -> None:
        """Release the pending chunks; those that fail again stay pending."""
        pending, self._pending = self._pending, []
        for handle in pending:
            self.release_handle(handle)

    def map(self, place: Place, tx: Transaction | None = None) -> None:
        """Map ``place``; unmapped again on rollback of ``tx``."""
        counted = CAPTURE_TIMES.start("maps") if self.counted else None
        t0 = time.perf_counter()
        self.backend.map(place.ptr, place.size, place.chunk.handle)
        if self.counted:
            self._map_seconds += time.perf_counter() - t0
            self._map_calls += 1
            CAPTURE_TIMES.stop(counted)
        place.mapped = True
        place.chunk.maps += 1
        if tx is not None:
            tx.append(functools.partial(self.unmap, place))

    @contextlib.contextmanager
    def ordered(self) -> Iterator[None]:
        """A block whose unmaps come after all the device work queued before it: one wait at its start.

        Only the owner's own calls may run inside it (it holds its lock): work queued inside the block
        over the places it unmaps would not be waited for.
        """
        if not self._ordered:
            wait_for_device(self.backend)
        self._ordered += 1
        try:
            yield
        finally:
            self._ordered -= 1

    def unmap(self, place: Place, tx: Transaction | None = None) -> None:
        """Unmap ``place`` (a hole from now on) once the device's queued work is done; mapped back on rollback
        of ``tx``. Outside an :meth:`ordered` block each call waits for the device."""
        if not self._ordered:
            wait_for_device(self.backend)
        self.backend.unmap(place.ptr, place.size)
        place.mapped = False
        place.chunk.maps -= 1
        if tx is not None:
            tx.append(functools.partial(self._remap, place))

    def _remap(self, place: Place) -> None:
        """Undo of an unmap; one that fails leaves a hole (the owner reads paused until a resume maps it)."""
        try:
            self.map(place)
        except BaseException:  # not an undo: records the hole the failed remap leaves, then re-raises
            self._holes = True
            raise

    # -- the machine --------------------------------------------------------------------------

    def pause(self, places: Sequence[Place], chunks: Iterable[Chunk], *, backup: list[tuple[int, int]] | None = None,
              keep_backup: bool = False, refuse: tuple[str, str] = ("", "")) -> int:
        """Back up ``backup`` spans (unless held), unmap every place, last first (all or nothing), release ``chunks``.

        Returns the bytes released. ``keep_backup``: the rollback of a failed resume, whose backup is
        still what the memory must wake with (nothing is copied). ``refuse``: the message and call of the
        error raised when a backup is asked of places that are holes already.
        """
        host = self.host
        if host is not None and keep_backup:
            host.sleep_again()
        elif host is not None and backup and not host.held:
            if self._holes:
                raise hal.InvalidStateError(refuse[0], backend=self.backend.name, call=refuse[1])
            host.save(self.backend, backup)
        with Transaction() as tx:
            tx.append(functools.partial(self._wake_back, self._sleeping))  # undone last, after the remaps
            self._sleeping = True  # from the first unmap on, nothing may use the places
            with self.ordered():
                for place in reversed(places):
                    if place.mapped:
                        self.unmap(place, tx)
            tx.commit()
        return sum(chunk.size for chunk in chunks if self.release(chunk))

    def _wake_back(self, was: bool) -> None:
        """Undo of a pause's start: sleeping as it ``was``; a backup it saved is dropped if nothing is paused."""
        self._sleeping = was
        if self.host is not None and not self.paused:
            self.host.discard()  # awake again, as it was

    def resume(self, places: Iterable[Place], chunks: Iterable[Chunk], *,
               backup: list[tuple[int, int]] | None = None) -> None:
        """Create the released chunks, map every hole and copy ``backup`` spans back when held (all or nothing)."""
        self.retry()
        with Transaction() as tx:
            for chunk in chunks:
                if chunk.handle is None:
                    self.create(chunk, tx)
            with self.backend.deferred_access():  # access set once per contiguous run, not once per chunk
                for place in places:
                    if not place.mapped:
                        self.map(place, tx)
            if backup and self.host is not None and self.host.held:
                self.host.restore(self.backend, backup)
            tx.commit()
        self._sleeping = self._holes = False
        if self.host is not None:
            self.host.wake()

    def fill(self, places: Iterable[Place]) -> None:
        """Map the holes of ``places`` back (all or nothing), outside a sleep."""
        with Transaction() as tx:
            with self.backend.deferred_access():
                for place in places:
                    if not place.mapped:
                        self.map(place, tx)
            tx.commit()
        self._holes = False

    def unmap_all(self, places: Iterable[Place], errors: list[BaseException]) -> None:
        """At close: unmap every mapped place (after one wait for the device), going on past failures (collected
        in ``errors``)."""
        with self.ordered():
            for place in places:
                if place.mapped:
                    try:
                        self.unmap(place)
                    except Exception as exc:  # noqa: BLE001 - collected; close() raises the first after the rest
                        errors.append(exc)
