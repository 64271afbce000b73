"""The keys of a :class:`graphkit.GraphPools` and the handles capture APIs take for them.

A key's pool is a :class:`KeyPool`: the key, the lease its pool strategy gave
(the backend pool, and for ``vmm`` its virtual space) and the
:class:`PoolHandle` engines pass as ``pool=``. :class:`CaptureKey` is the key
:func:`graphkit.graph_memory` makes for a capture outside any group.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from graphkit.pools import Lease

if TYPE_CHECKING:
    from graphkit.graph_pools import GraphPools


class CaptureKey(tuple):
    """The key :func:`graph_memory` gives a capture outside any group: ``('capture', n)``.

    It prints like the tuple but equals only another :class:`CaptureKey`:
    an engine's own key ``('capture', 1)`` never meets it.
    """

    def __new__(cls, serial: int) -> CaptureKey:
        return super().__new__(cls, ("capture", serial))

    def __eq__(self, other: object) -> bool:
        return type(other) is CaptureKey and tuple.__eq__(self, other)

    def __ne__(self, other: object) -> bool:
        return not self == other

    def __hash__(self) -> int:
        return hash((CaptureKey, tuple(self)))


class PoolHandle(tuple):
    """The pool of one key of a :class:`GraphPools`, in the form capture APIs take.

    A tuple equal to the framework's pool id (what ``torch.cuda.graph(pool=...)``
    and ``graph.pool()`` deal in) that also keeps its :class:`GraphPools`
    alive. Once the key is released or the pools closed, reading it --
    which every capture API does -- raises :class:`hal.InvalidStateError`.
    """

    _owner: GraphPools
    _key: Hashable

    def __new__(cls, ident: tuple[int, int], owner: GraphPools, key: Hashable) -> PoolHandle:
        handle = super().__new__(cls, ident)
        handle._owner, handle._key = owner, key
        return handle

    @property
    def key(self) -> Hashable:
        return self._key

    @property
    def released(self) -> bool:
        entry = self._owner._entries.get(self._key)
        return entry is None or entry.handle is not self

    @property
    def __hal_pool__(self) -> Any:
        """The backend pool (what :meth:`hal.Backend.capture` uses); raises once released."""
        return self._owner._live(self._key, self, "capture").pool

    def __getitem__(self, index: Any) -> Any:
        self._owner._live(self._key, self, "capture")
        return tuple.__getitem__(self, index)

    def __iter__(self) -> Iterator[int]:
        self._owner._live(self._key, self, "capture")
        return tuple.__iter__(self)

    def __repr__(self) -> str:
        state = " released" if self.released else ""
        return f"<graphkit pool {self._key!r} id={tuple.__repr__(self)}{state}>"

    def __reduce__(self) -> Any:  # a handle is tied to a live process
        raise TypeError("a graphkit pool handle cannot be pickled")


@dataclass(eq=False)
class KeyPool:
    """One key's pool: its handle and the lease it draws from."""

    key: Hashable
    handle: PoolHandle
    lease: Lease
    auto: bool = False  # made by graph_memory for one capture: released with its graph
    graphs: int = 0  # routed captures alive in it

    @property
    def pool(self) -> Any:
        """The backend pool."""
        return self.lease.pool

    @pool.setter
    def pool(self, pool: Any) -> None:
        self.lease.pool = pool

    @property
    def space_id(self) -> int | None:
        """The key's virtual space (vmm), else None."""
        return self.lease.space_id


def pool_ident(pool: Any, live: Iterator[KeyPool], serial: Iterator[int]) -> tuple[int, int]:
    """The framework's id of ``pool`` (what its capture API takes); else that of a live key over the same pool,
    else a made-up one from ``serial``."""
    ident = getattr(pool, "id", None)
    if isinstance(ident, tuple) and len(ident) == 2:
        return tuple(ident)
    same = next((entry.handle for entry in live if entry.pool is pool), None)  # keys of one shared pool
    if same is not None:
        return tuple.__getitem__(same, 0), tuple.__getitem__(same, 1)
    return 0, next(serial)
