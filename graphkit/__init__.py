"""graphkit: capture device graphs for many shapes at the memory cost of the largest, on any hal backend."""

from graphkit.allocator import SharedVMMAllocator

__all__ = ["SharedVMMAllocator"]
