"""The OS calls under :mod:`hal.host.vm`: host virtual memory with real aliasing, through libc's mmap (Linux).

They raise ``OSError``; :mod:`hal.host.vm` checks their arguments and turns
their failures into hal errors.

* a reservation is an anonymous ``PROT_NONE`` mapping, aligned by trimming;
* a physical chunk is a ``memfd`` of the chunk's size;
* mapping a chunk is ``mmap(MAP_SHARED | MAP_FIXED)`` of its memfd into the
  reservation, so every mapping of one chunk shows the same bytes;
* unmapping puts ``PROT_NONE`` anonymous memory back over the range.

Written against libc directly because Python's :mod:`mmap` cannot map at a
chosen address.
"""

from __future__ import annotations

import ctypes
import errno
import os
import sys

PROT_NONE, PROT_READ, PROT_WRITE = 0, 1, 2
MAP_SHARED, MAP_PRIVATE, MAP_FIXED, MAP_ANONYMOUS, MAP_NORESERVE = 0x01, 0x02, 0x10, 0x20, 0x4000
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

_libc: ctypes.CDLL | None = None
_MAP_FAILED = ctypes.c_void_p(-1).value


def unavailable_reason() -> str | None:
    """Why host VMM cannot work here, or None."""
    if not sys.platform.startswith("linux"):
        return f"needs Linux (memfd and MAP_FIXED); this is {sys.platform}"
    if not hasattr(os, "memfd_create"):
        return "os.memfd_create is missing"
    return None


def libc() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        lib = ctypes.CDLL(None, use_errno=True)
        lib.mmap.restype = ctypes.c_void_p
        lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                             ctypes.c_int, ctypes.c_long]
        lib.munmap.restype = ctypes.c_int
        lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        lib.mprotect.restype = ctypes.c_int
        lib.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _libc = lib
    return _libc


def _mmap(addr: int, size: int, prot: int, flags: int, fd: int = -1) -> int:
    res = libc().mmap(addr or None, size, prot, flags, fd, 0)
    if res is None or res == _MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, f"mmap({addr:#x}, {size}): {os.strerror(err)}")
    return int(res)


def _munmap(addr: int, size: int) -> None:
    if libc().munmap(addr, size) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"munmap({addr:#x}, {size}): {os.strerror(err)}")


def reserve(size: int, alignment: int) -> int:
    """Reserve ``size`` inaccessible bytes aligned to ``alignment``; return the address."""
    raw = _mmap(0, size + alignment, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE)
    start = -(-raw // alignment) * alignment
    if start > raw:
        _munmap(raw, start - raw)
    tail = raw + size + alignment - (start + size)
    if tail:
        _munmap(start + size, tail)
    return start


def free(addr: int, size: int) -> None:
    """Give a reservation (or an anonymous allocation) back to the OS."""
    _munmap(addr, size)


def create_chunk(size: int) -> int:
    """A memfd of ``size`` bytes; return its file descriptor."""
    fd = os.memfd_create("hal-fake-chunk", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size)
    except OSError:
        os.close(fd)
        raise
    return fd


def release_chunk(fd: int) -> None:
    os.close(fd)


def map_chunk(addr: int, size: int, fd: int, accessible: bool = True) -> None:
    """Map the memfd ``fd`` at ``addr`` (inside a reservation), read-write or (``accessible`` false) inaccessible
    until :func:`set_access`."""
    got = _mmap(addr, size, PROT_READ | PROT_WRITE if accessible else PROT_NONE, MAP_SHARED | MAP_FIXED, fd)
    if got != addr:  # pragma: no cover - MAP_FIXED either lands or fails
        raise OSError(errno.EFAULT, f"mmap landed at {got:#x}, not {addr:#x}")


def set_access(addr: int, size: int) -> None:
    """Make mapped memory read-write (one call for any number of mappings side by side)."""
    if libc().mprotect(addr, size, PROT_READ | PROT_WRITE) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mprotect({addr:#x}, {size}): {os.strerror(err)}")


def unmap_chunk(addr: int, size: int) -> None:
    """Replace a mapping with inaccessible reserved memory again."""
    _mmap(addr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE)


def alloc_anonymous(size: int) -> int:
    """Plain read-write host memory (the fake device's own allocator)."""
    return _mmap(0, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS)
