"""The garbage collector off for a block: captures and allocator callbacks need it (DESIGN §6.3)."""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator


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
