"""What a :func:`graphkit.graph_memory` block does beyond its own pools: the captures that no router of a
backend object takes (:class:`ScopeRouter`), and the processes started inside it (:func:`served_children`)."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from collections.abc import Iterator
from typing import Any, Protocol

import hal
from _graphkit_startup import ENV
from graphkit.graphs.executables import Budget
from graphkit.graphs.switch_value import written
from hal.types import Route

log = logging.getLogger(__name__)


class Served(Protocol):
    """What a block's routing reads of its :class:`graphkit.GraphPools`: its backend, its router and the options
    its children are served with."""

    @property
    def backend(self) -> hal.Backend: ...
    @property
    def kind(self) -> str: ...
    @property
    def outputs(self) -> str: ...
    @property
    def verify(self) -> bool: ...
    @property
    def hygiene(self) -> bool: ...
    @property
    def per_topology(self) -> Budget: ...

    def route(self, graph: Any, requested_pool: Any) -> Route | None: ...


class ScopeRouter:
    """The process router of a :func:`graph_memory` block: the captures no backend object's router takes.

    * a capture of the block's backend on its device through another :class:`hal.Backend` object (an engine
      that calls ``hal.get_backend(...)`` itself) is routed to the block's pools, as the switch routes it;
    * one of that backend on another device, that no block of that device takes, is refused (its memory would
      silently come from the framework's own allocator);
    * one of another backend is left alone, with one warning per block naming the backend and the fix;
    * in a fork child of the block's process it routes nothing: the block and its pools are the parent's (on
      ``fake`` their chunks are shared with the parent, so a child's capture into them would write the parent's
      graph memory). The child is served, if at all, by its own switch: it inherits ``GRAPHKIT_GRAPH_MEMORY``
      (:func:`served_children`), which its plugin or start-up hook reads with a backend of its own.
    """

    def __init__(self, pools: Served) -> None:
        self.pools = pools
        self.unrouted: set[tuple[str, int]] = set()  # where the captures left alone ran (warned once each)
        self.pid = os.getpid()  # the process whose block it routes for

    def __call__(self, backend: str, device: int, graph: Any, requested_pool: Any) -> Route | None:
        if os.getpid() != self.pid:  # a fork child: the block is the parent's, its pools the parent's memory
            return None
        be = self.pools.backend
        if backend == be.name and device == be.device:
            return self.pools.route(graph, requested_pool)
        if backend == be.name:
            raise hal.CaptureError(
                f"graph_memory() serves the captures on {be.name}:{be.device}, and this one starts on device "
                f"{device}: its memory would not come from graphkit. Enter graph_memory() with device {device} "
                "current (it takes the current device), or pass backend=hal.get_backend(device=...) for the "
                "device that captures; GRAPHKIT_GRAPH_MEMORY=1 serves every device of every process",
                backend=backend, call="graph_memory")
        if (backend, device) not in self.unrouted:
            self.unrouted.add((backend, device))
            log.warning("graph_memory() on %r saw a capture on %s:%d and does not route it: its memory comes from "
                        "that backend's own allocator, not from graphkit. Enter graph_memory(hal.get_backend(%r, "
                        "device=%d)) around it, or set GRAPHKIT_GRAPH_MEMORY=1 to serve every backend and device",
                        be, backend, device, backend, device)
        return None


#: set beside ``GRAPHKIT_GRAPH_MEMORY`` by a block: the process whose block set it (served by the block already)
FROM_ENV = "GRAPHKIT_GRAPH_MEMORY_FROM"
#: the start-up hook the package installs at the root of site-packages (``setup.py``)
HOOK_FILE = "graphkit-startup.pth"
_hook_warned = False  # the missing hook is said once per process


def hook_folders() -> list[str]:
    """The folders whose ``.pth`` files this interpreter reads when a process of it starts."""
    import site

    folders = list(site.getsitepackages())
    if site.ENABLE_USER_SITE:
        folders.append(site.getusersitepackages())
    return folders


def startup_hook_installed() -> bool:
    """Whether a process of this interpreter reads ``GRAPHKIT_GRAPH_MEMORY`` when it starts (the hook is in
    one of :func:`hook_folders`)."""
    return any(os.path.exists(os.path.join(folder, HOOK_FILE)) for folder in hook_folders())


def _warn_without_hook() -> None:
    global _hook_warned
    if _hook_warned or startup_hook_installed():
        return
    _hook_warned = True
    log.warning("graph_memory(): processes started inside the block (an engine's spawned ranks) will not be "
                "served: this Python (%s) has no %s in %s, so it never reads %s when a process starts. Install "
                "the package into it (%s -m pip install ...), or call graphkit.switch.plugin() in those processes",
                sys.executable, HOOK_FILE, " or ".join(hook_folders()) or "its site-packages", ENV, sys.executable)


class _ChildrenVariable:
    """``GRAPHKIT_GRAPH_MEMORY`` as the open :func:`graph_memory` blocks of this process own it: set by the first
    block that opens (where the user has not set it), kept while any block is open, removed when the last ends.

    Blocks may open and end in any order on any thread (two engines, one per device): the variable belongs to
    the count of open blocks, never to the block that happened to set it.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open = 0  # blocks open that share the variable this process set
        self._value: str | None = None  # the value set, while a block is open
        os.register_at_fork(after_in_child=self._forked)

    def _forked(self) -> None:
        """In a child made by ``fork``: a fresh lock (another thread may have held it at the fork)."""
        self._lock = threading.Lock()

    def enter(self, value: str) -> bool:
        """A block opens wanting ``value``; whether it shares the process's own variable (False: the user set one,
        which wins and is left alone)."""
        with self._lock:
            if self._open == 0:
                if ENV in os.environ:
                    return False
                os.environ[ENV], os.environ[FROM_ENV] = value, str(os.getpid())
                self._value = value
            elif value != self._value:
                log.info("graph_memory(): processes started now get %s=%s, set by the block opened first (this "
                         "block asked for %s; one value serves the whole process)", ENV, self._value, value)
            self._open += 1
            return True

    def leave(self) -> None:
        """A block that shares the variable ends; the last one puts the environment back as it found it."""
        with self._lock:
            self._open -= 1
            if self._open:
                return
            if os.environ.get(ENV) == self._value:
                del os.environ[ENV]
            if os.environ.get(FROM_ENV) == str(os.getpid()):
                del os.environ[FROM_ENV]
            self._value = None


_children = _ChildrenVariable()


@contextlib.contextmanager
def served_children(pools: Served) -> Iterator[None]:
    """While the block is open, the processes it starts -- an engine's spawned ranks and workers, which never
    run the block's code -- start under ``GRAPHKIT_GRAPH_MEMORY`` with the block's kind, outputs, verify and
    hygiene (:mod:`graphkit.switch`), so each serves its own device's captures as the block serves this one's.

    The variable is set in ``os.environ`` while any block is open, with :data:`FROM_ENV` naming this process
    (its own switch stays off: the blocks serve it), and put back once the last open block ends, whatever the
    order and thread they end in (a count of open blocks owns it; the first block's options serve them all).
    Where the variable is set already -- ``0`` included -- it is left alone: the user's value wins. Allocator
    options (``granularity=``, ``shareable=``...) do not reach the children; they use the defaults. Where this
    interpreter has no start-up hook installed (:func:`startup_hook_installed`), the children cannot read the
    variable: a warning says so, once per process.
    """
    value = written(pools.kind, pools.outputs, pools.verify, pools.hygiene, pools.per_topology)
    if not _children.enter(value):
        yield
        return
    try:
        _warn_without_hook()
        yield
    finally:
        _children.leave()


def set_by_own_block() -> bool:
    """Whether ``GRAPHKIT_GRAPH_MEMORY`` was set by a :func:`graph_memory` block of this very process."""
    return os.environ.get(FROM_ENV) == str(os.getpid())


__all__ = ["FROM_ENV", "HOOK_FILE", "ScopeRouter", "hook_folders", "served_children", "set_by_own_block",
           "startup_hook_installed"]
