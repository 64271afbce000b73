"""Where a graph's memory comes from: private, shared, or a fresh vmm space per capture.

A :class:`PoolStrategy` hands out a :class:`Lease` per capture (a backend
pool object, and for ``vmm`` the virtual space behind it) and takes it back
when the graph is destroyed. All pieces of one piecewise bucket share one
lease, so they never alias each other (piece k's output is piece k+1's input).
"""

from __future__ import annotations

import functools
import gc
import logging
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

import hal
from graphkit.memory.allocator import SharedVMMAllocator
from graphkit.memory.closing import close_step
from graphkit.memory.phases import CAPTURE_TIMES
from hal.transaction import Transaction

log = logging.getLogger(__name__)

POOL_KINDS = ("vmm", "shared", "private")


@dataclass
class Lease:
    """The memory one capture (or one bucket of pieces) draws from."""

    pool: Any  # backend pool object; None = a pool private to the graph
    space_id: int | None = None


@runtime_checkable
class PoolStrategy(Protocol):
    """Where the keys of a :class:`graphkit.GraphPools` draw from: ``lease()`` before a capture,
    ``give_back()`` after its graph is gone.

    A protocol: any object with these members serves (a runner's ``pool_strategy``); a subclass gets the
    defaults below (nothing to give back, settle or close, no figures, no allocator).
    """

    kind: str = "?"  # "vmm", "shared", "private", or a name of its own
    backend: hal.Backend

    def __init__(self, backend: hal.Backend) -> None:
        self.backend = backend

    @property
    def allocator(self) -> SharedVMMAllocator | None:
        """The shared allocator of a vmm strategy (for the reports and a saver); None for the others."""
        return None

    def lease(self) -> Lease:
        """The memory of a capture that starts (one lease per key)."""
        raise NotImplementedError

    def give_back(self, lease: Lease) -> None:
        """Called after the graph(s) of the lease were released."""
        return None

    def settle(self) -> None:
        """Finish giving back: called once after a batch of ``give_back`` calls."""
        return None

    def close(self) -> None:
        """Release whatever the strategy still holds; idempotent."""
        return None

    def figures(self) -> dict[str, int]:
        """Memory figures specific to the strategy (bytes)."""
        return {}


class PrivatePools(PoolStrategy):
    """A pool per graph: torch's default, and the costliest.

    Each capture gets a fresh pool of the device's own allocator, which is
    what a graph-private pool is; holding it by name lets capture hygiene
    read its blocks like any other pool's.
    """

    kind = "private"

    def lease(self) -> Lease:
        return Lease(pool=self.backend.create_pool())

    def give_back(self, lease: Lease) -> None:
        if lease.pool is not None:
            self.backend.release_pool(lease.pool)  # a failure keeps it in the lease, to give back again
            lease.pool = None


class SharedPool(PoolStrategy):
    """One pool for every graph of the runner, drawn from the device's own allocator."""

    kind = "shared"

    def __init__(self, backend: hal.Backend) -> None:
        super().__init__(backend)
        self._pool: Any = None

    def lease(self) -> Lease:
        if self._pool is None:
            self._pool = self.backend.create_pool()
        return Lease(pool=self._pool)

    def close(self) -> None:
        if self._pool is not None and not self.backend.closed:  # a closed backend released it
            self.backend.release_pool(self._pool)  # a failure keeps it, to release at the next close()
        self._pool = None


class VmmPools(PoolStrategy):
    """A fresh pool over a fresh virtual space per capture; all spaces share one set of chunks."""

    kind = "vmm"

    @property
    def allocator(self) -> SharedVMMAllocator:
        """The allocator every space of these pools is carved from."""
        return self._allocator

    def __init__(self, backend: hal.Backend, allocator: SharedVMMAllocator | None = None, *,
                 park_live: bool = True, collect: bool = True, **allocator_options: Any) -> None:
        """:param park_live: closing an allocator of its own parks the spaces tensors still use
        (see :meth:`SharedVMMAllocator.close`) instead of unmapping them.
        :param collect: :meth:`settle` runs the garbage collector when a space given back still has
        live blocks (framework pools caught in reference cycles give their segments back); off where
        settling is frequent (a safe point at every capture), where a later settle releases the space."""
        super().__init__(backend)
        if not backend.supports("custom_pool"):
            raise hal.UnsupportedError(
                "the vmm pool needs pools over allocator callbacks (capability 'custom_pool')",
                backend=backend.name, call="VmmPools")
        self._own = allocator is None
        self._park_live = park_live
        self._collect = collect
        self._allocator = allocator or SharedVMMAllocator(backend, **allocator_options)
        self._returned: list[int] = []

    def lease(self) -> Lease:
        """A new open space (other spaces keep their room: their owners seal them) and a pool over it."""
        allocator = self.allocator
        counted = CAPTURE_TIMES.start("spaces")
        try:
            with Transaction() as tx:  # a pool that cannot be made gives its space back
                space = allocator.open_virtual_space()
                tx.append(functools.partial(allocator.release_virtual_space, space))
                pool = self.backend.create_pool(*allocator.pool_callbacks(space), paused=lambda: allocator.paused)
                tx.commit()
        finally:
            CAPTURE_TIMES.stop(counted)
        return Lease(pool=pool, space_id=space)

    def give_back(self, lease: Lease) -> None:
        if lease.pool is not None:
            self.backend.release_pool(lease.pool)  # a failure keeps it in the lease, to give back again
            lease.pool = None
        if lease.space_id is not None:
            self._returned.append(lease.space_id)
            lease.space_id = None

    def settle(self) -> None:
        """Release the spaces given back; a space a tensor still uses waits for its last free.

        Goes on past failures (kept, released at the next settle) and raises the first.
        """
        returned, self._returned = self._returned, []
        errors: list[BaseException] = []
        waiting = False
        for space_id in returned:
            if self.allocator.closed or space_id not in self.allocator.spaces:
                continue
            try:
                waiting |= not self.allocator.release_when_idle(space_id)
            except hal.HalError as exc:
                self._returned.append(space_id)
                errors.append(exc)
        if waiting and self._collect:
            gc.collect()  # framework pools caught in reference cycles give their segments back now
            self.allocator.reap()
        if errors:
            raise errors[0]

    def close(self) -> None:
        """Settle, then close an allocator of its own; goes on past a failed settle and raises the first."""
        errors: list[BaseException] = []
        if not self.backend.closed:  # else the backend's close took every space down
            close_step(errors, self.settle)  # the allocator's close below takes the spaces down anyway
        if self._own:  # outputs the caller still holds (views) keep readable memory under them when parked
            self.allocator.close(park_live=self._park_live)
            self._returned.clear()
        if errors:
            raise errors[0]

    def figures(self) -> dict[str, int]:
        return {
            "chunk_bytes": self.allocator.physical_bytes,
            "reserved_bytes": self.allocator.reserved_bytes,
            "virtual_spaces": self.allocator.num_virtual_spaces,
        }


def vmm_or_shared(backend: hal.Backend, who: str) -> Literal["vmm", "shared"]:
    """``"vmm"`` where ``backend`` has pools over custom allocators; else ``"shared"``, with one warning.

    :param who: the object that falls back (``"GraphRunner"``, ``"GraphPools"``), named in the warning.
    """
    if backend.supports("custom_pool"):
        return "vmm"
    log.warning("%s has no pools over custom allocators (capability 'custom_pool' is absent): %s falls back to one "
                "shared pool; capture the largest size first to keep memory low", backend.name, who)
    return "shared"


def make_pool_strategy(kind: str, backend: hal.Backend, who: str = "GraphRunner", **options: Any) -> PoolStrategy:
    """Build the strategy named ``kind``; ``vmm`` falls back to ``shared`` where it cannot work.

    :param who: the object the strategy serves, named in the fallback warning and in errors.
    :param options: :class:`VmmPools` options (``park_live`` and the allocator's), for ``vmm`` only.
    """
    if kind == "vmm":
        if vmm_or_shared(backend, who) == "shared":
            return SharedPool(backend)
        return VmmPools(backend, **options)
    if kind == "shared":
        return SharedPool(backend)
    if kind == "private":
        return PrivatePools(backend)
    raise hal.InvalidArgumentError(f"kind={kind!r} must be one of {', '.join(POOL_KINDS)}",
                                   backend=backend.name, call=who)
