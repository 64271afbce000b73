"""Virtual memory for a host-like device, from the OS (Linux): the vmm half of the contract in a few calls.

A plugin whose device memory is host memory, or memory the host can
address, implements the nine required hooks over these functions, as the
``fake`` backend and ``examples/hal-hostmem`` do:

================================  ==============================================================
hook                              call
================================  ==============================================================
``create_vir_ptr(size)``          :func:`reserve`: anonymous ``PROT_NONE`` address space (no memory
                                  behind it, ``MAP_NORESERVE``), aligned to ``alignment``
``release_vir_ptr(ptr, size)``    :func:`release`
``create_phy_mem_handle(size)``   :func:`create_chunk`: a ``memfd`` of ``size`` bytes (its file descriptor)
``release_phy_mem_handle(h)``     :func:`release_chunk`
``map(ptr, size, h)``             :func:`map_chunk`: ``mmap(MAP_SHARED | MAP_FIXED)`` of the memfd, read-write,
                                  so every mapping of one chunk shows the same bytes
``deferred_access()``             :func:`map_chunk` with ``accessible=False`` inside the block, then one
                                  :func:`set_access` (``mprotect``) per contiguous run of mappings at its end
``unmap(ptr, size)``              :func:`unmap_chunk`: a ``PROT_NONE`` placeholder goes back over the range,
                                  which stays reserved (no other mapping can land there)
================================  ==============================================================

and :func:`alloc` / :func:`free` give plain read-write memory: the device's
own allocator for :meth:`hal.host.HostGraphs.init_host_graphs`.

**Alignment.** Every size and address is a multiple of :data:`PAGE_SIZE`
(the OS page; :func:`alloc` takes any size and rounds it up); a reservation starts on a multiple of ``alignment`` (the
device's granularity, itself a multiple of the page). hal's facade checks
sizes and ranges against the granularity before a hook runs; these
functions check the page rules again and raise
:class:`hal.InvalidArgumentError`.

**Memory.** A chunk's pages are taken from the OS when first touched, and
the OS may overcommit: a device that promises a capacity counts its bytes
itself (see the ``mem_info`` hook).

**Errors** name ``backend`` and the hook: ``ENOMEM`` from the OS (no memory,
or no address space left) raises :class:`hal.DeviceOutOfMemoryError`; any
other failure :class:`hal.DriverError` with the errno as its code, the errno's
name (``EINVAL``) and the OS call (``mmap``) that failed.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterator

from hal.errors import DeviceOutOfMemoryError, DriverError, InvalidArgumentError
from hal.host import _os

#: The OS page: every size and address given to this module is a multiple of it.
PAGE_SIZE: int = _os.PAGE_SIZE


def unavailable_reason() -> str | None:
    """Why this module cannot work here (it needs Linux: ``memfd`` and ``MAP_FIXED``), or None: a plugin's probe."""
    return _os.unavailable_reason()


@contextlib.contextmanager
def _checked(backend: str, call: str, native: str) -> Iterator[None]:
    """The OS's failures inside the block leave as hal errors of ``backend``'s ``call``."""
    try:
        yield
    except OSError as exc:
        why = f"{native}: {exc.strerror or exc}"
        if exc.errno == errno.ENOMEM:
            raise DeviceOutOfMemoryError(why, backend=backend, call=call) from exc
        raise DriverError(why, backend=backend, call=call, code=exc.errno,
                          code_name=errno.errorcode.get(exc.errno or 0), native_call=native) from exc


#: Sizes and addresses handed to the OS are 64-bit: one this large or larger would wrap.
_WORD_LIMIT = 1 << 64


def _pages(backend: str, call: str, **values: int) -> None:
    """Refuse a value that is not a positive multiple of the page (an address may not be 0 either), or that, with
    every other value given (an address plus a size, a size plus an alignment), does not fit 64 bits."""
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0 or value % PAGE_SIZE:
            raise InvalidArgumentError(f"{name}={value!r} must be a positive multiple of the page size {PAGE_SIZE}",
                                       backend=backend, call=call)
    if sum(values.values()) >= _WORD_LIMIT:
        given = ", ".join(f"{name}={value:#x}" for name, value in values.items())
        raise InvalidArgumentError(f"{given}: together they pass 2**64 bytes, which no address space holds",
                                   backend=backend, call=call)


def reserve(size: int, alignment: int = PAGE_SIZE, *, backend: str = "host") -> int:
    """Reserve ``size`` bytes of inaccessible address space starting on a multiple of ``alignment``."""
    _pages(backend, "create_vir_ptr", size=size, alignment=alignment)
    with _checked(backend, "create_vir_ptr", "mmap"):
        return _os.reserve(size, alignment)


def release(ptr: int, size: int, *, backend: str = "host") -> None:
    """Give a reservation back (nothing may be mapped in it any more: the hal facade checks that)."""
    _pages(backend, "release_vir_ptr", ptr=ptr, size=size)
    with _checked(backend, "release_vir_ptr", "munmap"):
        _os.free(ptr, size)


def create_chunk(size: int, *, backend: str = "host") -> int:
    """A physical chunk of ``size`` bytes: a ``memfd``; return its file descriptor."""
    _pages(backend, "create_phy_mem_handle", size=size)
    with _checked(backend, "create_phy_mem_handle", "memfd_create"):
        return _os.create_chunk(size)


def release_chunk(fd: int, *, backend: str = "host") -> None:
    """Close a chunk's memfd; its pages go back once no mapping shows them."""
    with _checked(backend, "release_phy_mem_handle", "close"):
        _os.release_chunk(fd)


def map_chunk(ptr: int, size: int, fd: int, *, backend: str = "host", accessible: bool = True) -> None:
    """Map the whole chunk ``fd`` (of ``size`` bytes) at ``ptr``, inside a reservation: read-write, or
    (``accessible=False``) inaccessible until :func:`set_access`."""
    _pages(backend, "map", ptr=ptr, size=size)
    with _checked(backend, "map", "mmap"):
        _os.map_chunk(ptr, size, fd, accessible)


def set_access(ptr: int, size: int, *, backend: str = "host") -> None:
    """Make ``size`` bytes of mappings side by side at ``ptr`` read-write: one call for the whole run."""
    _pages(backend, "deferred_access", ptr=ptr, size=size)
    with _checked(backend, "deferred_access", "mprotect"):
        _os.set_access(ptr, size)


def unmap_chunk(ptr: int, size: int, *, backend: str = "host") -> None:
    """Undo one :func:`map_chunk`: the range is inaccessible again, and still reserved."""
    _pages(backend, "unmap", ptr=ptr, size=size)
    with _checked(backend, "unmap", "mmap"):
        _os.unmap_chunk(ptr, size)


def export_chunk(fd: int, *, backend: str = "host") -> int:
    """A new file descriptor of chunk ``fd`` that another process can map (the caller or the receiver closes it)."""
    with _checked(backend, "export_phy_mem_handle", "dup"):
        return os.dup(fd)


def import_chunk(fd: int, size: int, *, backend: str = "host") -> int:
    """A descriptor of its own of an exported chunk ``fd`` of ``size`` bytes, checked to be one.

    :raises InvalidArgumentError: ``fd`` is no regular file of ``size`` bytes.
    """
    with _checked(backend, "import_phy_mem_handle", "fstat"):
        info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_size != size:
        raise InvalidArgumentError(f"fd={fd} is not an exported chunk of size={size} (a file of {info.st_size} "
                                   f"bytes, mode {info.st_mode:#o})", backend=backend, call="import_phy_mem_handle")
    with _checked(backend, "import_phy_mem_handle", "dup"):
        return os.dup(fd)


def alloc(size: int, *, backend: str = "host") -> int:
    """``size`` bytes of plain read-write memory (a device's own allocator), page-aligned; return the address."""
    if not isinstance(size, int) or isinstance(size, bool) or size <= 0 or size + PAGE_SIZE >= _WORD_LIMIT:
        raise InvalidArgumentError(f"size={size!r} must be a positive int below 2**64", backend=backend,
                                   call="alloc")
    with _checked(backend, "alloc", "mmap"):
        return _os.alloc_anonymous(size)


def free(ptr: int, size: int, *, backend: str = "host") -> None:
    """Give back memory :func:`alloc` returned (``size`` as it was asked for)."""
    _pages(backend, "free", ptr=ptr)
    with _checked(backend, "free", "munmap"):
        _os.free(ptr, size)


__all__ = ["PAGE_SIZE", "alloc", "create_chunk", "export_chunk", "free", "import_chunk", "map_chunk", "release",
           "release_chunk", "reserve", "set_access", "unavailable_reason", "unmap_chunk"]
