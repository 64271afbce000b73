"""The fake device's former OS layer: the raw calls of :mod:`hal.host.vm` (they raise ``OSError``).

Use :mod:`hal.host.vm`, the public helper with hal errors.
"""

from hal.host._os import (  # noqa: F401 - former names
    MAP_ANONYMOUS,
    MAP_FIXED,
    MAP_NORESERVE,
    MAP_PRIVATE,
    MAP_SHARED,
    PAGE_SIZE,
    PROT_NONE,
    PROT_READ,
    PROT_WRITE,
    alloc_anonymous,
    create_chunk,
    free,
    libc,
    map_chunk,
    release_chunk,
    reserve,
    unavailable_reason,
    unmap_chunk,
)
