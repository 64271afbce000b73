"""Snapshots of a facade's bookkeeping, to prove a failed call changed nothing."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from hal.facade import Backend
from hal.wrappers import LiveCounts


@dataclass(frozen=True)
class FacadeState:
    """The accounting wrapper's counts plus a copy of every container the facade keeps."""

    live: LiveCounts
    bookkeeping: dict[str, Any]


def snapshot(be: Backend) -> FacadeState:
    """Copy ``be.live`` and each dict/list/set attribute of the facade (ranges, handles, mappings...)."""
    kept = {name: copy.copy(value) for name, value in vars(be).items()
            if isinstance(value, (dict, list, set))}
    return FacadeState(be.live, kept)
