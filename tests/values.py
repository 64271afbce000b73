"""Values that public entry points must refuse with a hal error, for hypothesis-driven tests of each module."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

import hal
from tests.conftest import G

#: values that are never a valid byte count: not ints, bools, negatives, beyond 64 bits
NOT_A_SIZE = st.one_of(
    st.integers(max_value=-1), st.integers(min_value=2 ** 64, max_value=2 ** 80), st.floats(allow_nan=True),
    st.booleans(), st.text(max_size=3), st.none(), st.lists(st.integers(), max_size=2), st.just(torch.ones(1)),
)

#: few examples, no deadline, and the function-scoped ``be`` fixture shared by the examples of one test
BAD_VALUE_SETTINGS = settings(max_examples=40, deadline=None,
                              suppress_health_check=[HealthCheck.function_scoped_fixture])


class BadHash:
    """A key whose hash raises."""

    def __hash__(self) -> int:
        raise ValueError("no hash")


class BadEq:
    """A key that hashes but whose comparison raises."""

    def __hash__(self) -> int:
        return 1

    def __eq__(self, other: object) -> bool:
        raise RuntimeError("no eq")


@contextlib.contextmanager
def refused_cleanly(make: Callable[[hal.Backend], Any] | None = None) -> Iterator[tuple[hal.Backend, Any]]:
    """Yield a fresh fake backend and ``make(backend)``: the block must raise :class:`hal.InvalidArgumentError`
    and make nothing on the way; afterwards the object and the backend close with nothing left live."""
    be = hal.get_backend("fake", granularity=G)
    made = make(be) if make is not None else None
    before = be.live
    with pytest.raises(hal.InvalidArgumentError):
        yield be, made
    assert be.live == before  # nothing made on the way to the error
    if made is not None:
        made.close()
    be.close()
    assert be.live.zero
