"""The ``map`` hook's two steps, for every backend: map a chunk, then make it accessible.

CUDA (``cuMemMap`` + ``cuMemSetAccess``) and CNDrv (``cnMemMap`` +
``cnMemSetAccess``) map first and grant access in a second call (ACL needs
none for the owning device). When that
second call fails the mapping is undone, so that a failed ``map`` leaves
nothing half-mapped; the access call's error is the one raised.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from hal.transaction import Transaction


def map_with_access(map_chunk: Callable[[], Any], set_access: Callable[[], Any] | None,
                    unmap: Callable[[], Any], *, backend: str, ptr: int, access_call: str) -> None:
    """``map_chunk()``, then ``set_access()``; when that fails, ``unmap()`` and raise its error.

    :param set_access: None when the mapping needs no access call (or it comes later).
    :param ptr: the mapped address, for the log.
    :param access_call: the native access function, for the log.
    """
    map_chunk()
    if set_access is None:
        return
    with Transaction() as tx:
        tx.append(lambda: undo_map(unmap, backend=backend, ptr=ptr, why=f"a failed {access_call}"))
        set_access()
        tx.commit()


def undo_map(unmap: Callable[[], Any], *, backend: str, ptr: int, why: str) -> None:
    """Unmap after ``why``; a failure here is logged, since the first failure is the one to report."""
    try:
        unmap()
    except Exception as exc:  # noqa: BLE001 - logged; the first failure is the one raised
        logging.getLogger(f"hal.{backend}").error("%s: undoing the map at %#x after %s: %s", backend, ptr, why, exc)
