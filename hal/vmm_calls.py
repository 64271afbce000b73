"""The vmm calls of :class:`hal.Backend`, each checked before the driver sees it.

:class:`VmmCalls` keeps the reserved ranges, live chunks and mappings the
backend handed out, refuses a call that does not fit them (sizes, alignment,
reserved ranges, live handles, double release) with an error naming the
argument, and changes its bookkeeping only when the driver's call succeeded.
"""

from __future__ import annotations

import bisect
import contextlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

from hal.errors import InvalidArgumentError, InvalidStateError, PluginValidationError
from hal.hook_calls import ADDRESS_LIMIT, HookCalls
from hal.types import MappedRange, fmt_bytes


class VmmCalls(HookCalls):
    """Reserve, allocate, map, unmap and release device memory through the plugin, with the checks of
    :mod:`hal.api`; owns the live ranges, chunks and mappings (:meth:`_init_vmm` makes them)."""

    def _init_vmm(self) -> None:
        self._ranges: dict[int, int] = {}
        self._range_starts: list[int] = []
        self._handles: dict[Any, int] = {}
        self._handle_maps: dict[Any, int] = {}
        self._mappings: dict[int, MappedRange] = {}
        self._map_starts: list[int] = []

    def _check_size(self, call: str, size: Any, arg: str = "size") -> None:
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            raise self._err(InvalidArgumentError, call, f"{arg}={size!r} must be a positive int")
        if size >= ADDRESS_LIMIT:  # would wrap in the driver's size_t
            raise self._err(InvalidArgumentError, call, f"{arg}={size} is not below 2**64")
        g = self.granularity
        if size % g:
            raise self._err(
                InvalidArgumentError, call,
                f"{arg}={size} is not a multiple of the granularity {g} ({fmt_bytes(g)})",
            )

    def create_vir_ptr(self, size: int) -> int:
        """Reserve ``size`` bytes of virtual address space; return the start address."""
        with self._lock:
            self._check_open("create_vir_ptr")
            self._check_size("create_vir_ptr", size)
            ptr = int(self._result("create_vir_ptr", self._hook.create_vir_ptr(size=size)))
            self._ranges[ptr] = size
            bisect.insort(self._range_starts, ptr)
            return ptr

    def release_vir_ptr(self, ptr: int, size: int) -> None:
        """Free a reserved range; nothing may be mapped in it."""
        call = "release_vir_ptr"
        with self._lock:
            self._check_open(call)
            self._check_ptr(call, ptr)
            if ptr not in self._ranges:
                raise self._err(InvalidStateError, call,
                                f"ptr={ptr:#x} is not a live reservation (released twice?)")
            if self._ranges[ptr] != size:
                raise self._err(InvalidArgumentError, call,
                                f"size={size} differs from the reserved size {self._ranges[ptr]}")
            inside = self._mappings_in(ptr, ptr + size)
            if inside:
                raise self._err(InvalidStateError, call,
                                f"{len(inside)} mapping(s) still live in the range at {ptr:#x}; unmap first")
            self._hook.release_vir_ptr(ptr=ptr, size=size)
            del self._ranges[ptr]
            self._range_starts.remove(ptr)

    def create_phy_mem_handle(self, size: int) -> Any:
        """Allocate one physical chunk of ``size`` bytes; return its handle."""
        with self._lock:
            self._check_open("create_phy_mem_handle")
            self._check_size("create_phy_mem_handle", size)
            handle = self._result("create_phy_mem_handle", self._hook.create_phy_mem_handle(size=size))
            self._handles[handle] = size
            self._handle_maps[handle] = 0
            return handle

    def release_phy_mem_handle(self, handle: Any, *, wait: bool = False) -> None:
        """Free a chunk; it must be mapped nowhere.

        :param wait: first wait for the device work queued so far (:meth:`wait_before_unmap`).
        """
        call = "release_phy_mem_handle"
        with self._lock:
            self._check_open(call)
            self._check_wait(call, wait)
            if handle not in self._handles:
                raise self._err(InvalidStateError, call,
                                f"handle={handle!r} is not live (released twice?)")
            if self._handle_maps[handle]:
                raise self._err(InvalidStateError, call,
                                f"handle={handle!r} is still mapped {self._handle_maps[handle]} time(s)")
            if wait:
                self.wait_before_unmap()
            self._hook.release_phy_mem_handle(handle=handle)
            del self._handles[handle]
            del self._handle_maps[handle]

    def map(self, ptr: int, size: int, handle: Any) -> None:
        """Map the whole chunk ``handle`` (of ``size`` bytes) at ``ptr``, read-write."""
        call = "map"
        with self._lock:
            self._check_open(call)
            if handle not in self._handles:
                raise self._err(InvalidStateError, call, f"handle={handle!r} is not live")
            if size != self._handles[handle]:
                raise self._err(InvalidArgumentError, call,
                                f"size={size} must equal the chunk's size {self._handles[handle]} "
                                "(maps are whole handles)")
            if not isinstance(ptr, int) or ptr % self.granularity:
                raise self._err(InvalidArgumentError, call,
                                f"ptr={ptr:#x} is not aligned to the granularity {self.granularity}"
                                if isinstance(ptr, int) else f"ptr={ptr!r} must be an int address")
            self._check_in_range(call, ptr, size)
            clash = self._mappings_in(ptr, ptr + size)
            if clash:
                raise self._err(InvalidStateError, call,
                                f"[{ptr:#x}, {ptr + size:#x}) overlaps the mapping at {clash[0].ptr:#x}")
            self._hook.map(ptr=ptr, size=size, handle=handle)
            self._mappings[ptr] = MappedRange(ptr, size, handle)
            bisect.insort(self._map_starts, ptr)
            self._handle_maps[handle] += 1

    @contextlib.contextmanager
    def deferred_access(self) -> Iterator[None]:
        """Inside the block, what :meth:`map` maps on this thread may stay inaccessible until the block ends; then
        it is made read-write with one driver call per contiguous run, where the backend batches access (cuda: one
        ``cuMemSetAccess`` for many chunks side by side instead of one per chunk; ``fake``: one ``mprotect``).
        Touch nothing mapped inside before the block ends. Elsewhere nothing changes.

        >>> with be.deferred_access():
        ...     for i, handle in enumerate(handles):
        ...         be.map(va + i * g, g, handle)
        >>> be.tensor_at(va, len(handles) * g).fill_(0)   # accessible from here on
        """
        self._check_open("deferred_access")
        if "deferred_access" not in self._implemented:
            yield
            return
        with self._plugin_faults("deferred_access"):  # the plugin's own failures (not the block's) are checked
            block = self._result("deferred_access", self._hook.deferred_access())
            block.__enter__()
        try:
            yield
        except BaseException as exc:  # not an undo: the plugin's block is told of the failure, as `with` tells it
            with self._plugin_faults("deferred_access"):
                block.__exit__(type(exc), exc, exc.__traceback__)
            raise
        with self._plugin_faults("deferred_access"):
            block.__exit__(None, None, None)

    def unmap(self, ptr: int, size: int, *, wait: bool = False) -> None:
        """Undo exactly one earlier ``map(ptr, size, ...)``.

        The device may still run work queued over the range, and a driver need not wait for it
        (:func:`hal.api.unmap`): wait for the streams that used it first, or pass ``wait=True``.

        :param wait: first wait for the device work queued so far (:meth:`wait_before_unmap`).
        :raises UseAfterUnmapError: work queued over the range may still use it (the asynchronous
            ``fake`` sees this); nothing was unmapped.
        """
        call = "unmap"
        with self._lock:
            self._check_open(call)
            self._check_ptr(call, ptr)
            self._check_wait(call, wait)
            m = self._mappings.get(ptr)
            if m is None:
                raise self._err(InvalidStateError, call, f"nothing is mapped at ptr={ptr:#x}")
            if m.size != size:
                raise self._err(InvalidArgumentError, call,
                                f"size={size} differs from the mapping's size {m.size} (partial unmap)")
            if wait:
                self.wait_before_unmap()
            self._hook.unmap(ptr=ptr, size=size)
            del self._mappings[ptr]
            self._map_starts.remove(ptr)
            self._handle_maps[m.handle] -= 1

    def wait_before_unmap(self, *, capture_check: bool = True) -> None:
        """Wait for the device work queued so far, unless the backend's unmap waits for it itself
        (capability ``"unmap_waits"``), it queues no work (no ``"graphs"``: no streams, no replays), or this
        thread captures a graph now (a device-wide wait would end the capture; what it records runs later;
        ``capture_check=False`` skips that question, as ``close()`` does: nothing captures a closing backend)."""
        caps = self.capabilities
        if "unmap_waits" in caps or "graphs" not in caps:
            return
        if capture_check and self.capturing():  # answered by hal.Backend's stream calls
            return
        self._hook.synchronize(stream=None)

    def _check_wait(self, call: str, wait: Any) -> None:
        if not isinstance(wait, bool):
            raise self._err(InvalidArgumentError, call, f"wait={wait!r} must be True or False")

    def export_phy_mem_handle(self, handle: Any) -> int:
        """A new file descriptor through which another process imports the chunk ``handle`` (yours to close).

        See :func:`hal.api.export_phy_mem_handle`.

        :raises UnsupportedError: the backend cannot export chunks (the hook is absent, or says why not).
        """
        call = "export_phy_mem_handle"
        with self._lock:
            self._check_open(call)
            self._require(call)
            if handle not in self._handles:
                raise self._err(InvalidStateError, call, f"handle={handle!r} is not live")
            fd = self._result(call, self._hook.export_phy_mem_handle(handle=handle))
            if not isinstance(fd, int) or isinstance(fd, bool) or fd < 0:
                raise self._err(PluginValidationError, call, f"the backend returned {fd!r}, not a file descriptor")
            return fd

    def import_phy_mem_handle(self, fd: int, size: int) -> Any:
        """A handle to the chunk of ``size`` bytes another process exported as ``fd``; map and release it as
        one from :meth:`create_phy_mem_handle` (``fd`` stays yours to close).

        See :func:`hal.api.import_phy_mem_handle`.

        :raises UnsupportedError: the backend cannot import chunks.
        """
        call = "import_phy_mem_handle"
        with self._lock:
            self._check_open(call)
            self._require(call)
            if not isinstance(fd, int) or isinstance(fd, bool) or fd < 0:
                raise self._err(InvalidArgumentError, call, f"fd={fd!r} must be a file descriptor (an int >= 0)")
            self._check_size(call, size)
            handle = self._result(call, self._hook.import_phy_mem_handle(fd=fd, size=size))
            self._handles[handle] = size
            self._handle_maps[handle] = 0
            return handle

    # -- teardown (close) --------------------------------------------------

    def _vmm_leftovers(self) -> tuple[int, int, int]:
        """How many mappings, ranges and chunks are still live."""
        return len(self._mappings), len(self._ranges), len(self._handles)

    def _release_vmm(self, collect: Callable[[], AbstractContextManager[None]]) -> None:
        """Close's vmm steps, in teardown order: unmap, free the ranges, release the chunks still live;
        each step runs inside ``collect()``, which keeps a failure and goes on."""
        for m in list(self._mappings.values()):
            with collect():
                self.unmap(m.ptr, m.size)
        for ptr, size in list(self._ranges.items()):
            with collect():
                self.release_vir_ptr(ptr, size)
        for handle in list(self._handles):
            with collect():
                self.release_phy_mem_handle(handle)

    def _check_in_range(self, call: str, ptr: int, size: int) -> None:
        i = bisect.bisect_right(self._range_starts, ptr) - 1
        if i >= 0:
            start = self._range_starts[i]
            if ptr + size <= start + self._ranges[start]:
                return
        raise self._err(InvalidArgumentError, call,
                        f"[{ptr:#x}, {ptr + size:#x}) is not inside a reserved range")

    def _mappings_in(self, lo: int, hi: int) -> list[MappedRange]:
        i = max(bisect.bisect_right(self._map_starts, lo) - 1, 0)
        found = []
        for start in self._map_starts[i:]:
            if start >= hi:
                break
            m = self._mappings[start]
            if m.ptr + m.size > lo:
                found.append(m)
        return found

