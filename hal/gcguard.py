"""The garbage collector off for a block, for captures and allocator callbacks.

A collection there could free a device tensor, which needs the framework
allocator's lock that the capture or the callback already holds: a deadlock.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def gc_disabled() -> Iterator[None]:
    """Turn the garbage collector off for the block; restore its state afterwards."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
