"""The typed facade over one backend plugin on one device.

It applies the conventions of :mod:`hal.api`: arguments are checked before
the backend sees them, a missing hook or an absent capability raises
:class:`hal.UnsupportedError` naming the backend, the call and the
capability, and a ``None`` from a hook that must return a value is a broken
plugin (:class:`hal.PluginValidationError`).

:class:`Backend` is made of three parts, each owning its state: the calls
into the plugin with those conventions, its capabilities, fault injection
and tracing (:mod:`hal.hook_calls`); the checked vmm calls and their
bookkeeping (:mod:`hal.vmm_calls`); the stream, pool, graph and capture
calls and what a replay checks (:mod:`hal.graph_calls`). It adds the
lifecycle: ``close()`` in teardown order, each part releasing what it owns
(graphs and pools, then mappings, ranges and chunks, then the plugin).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator
from typing import Any

from hal.graph_calls import GraphCalls, backend_pool
from hal.hook_calls import ADDRESS_LIMIT
from hal.vmm_calls import VmmCalls

log = logging.getLogger("hal")


class Backend(VmmCalls, GraphCalls):
    """One backend on one device: typed, checked calls into the hal contract.

    Obtain one with :func:`hal.get_backend`. Every vmm call is checked here
    (sizes, alignment, reserved ranges, live handles, double release) before
    the driver sees it, and the facade's bookkeeping changes only when the
    call succeeds. ``close()`` releases whatever is still live; it is
    idempotent, and the object is a context manager.
    """

    def __init__(self, name: str, plugin: Any, *, device: int = 0, origin: str = "built-in") -> None:
        super().__init__(name, plugin, device=device, origin=origin)
        self._init_vmm()
        self._init_graphs()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"<hal.Backend {self.name} device={self.device} {state}>"

    def __enter__(self) -> Backend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- lifecycle --------------------------------------------------------

    def close(self) -> None:
        """Wait for the device, then unmap, free ranges and release chunks still live, then shut the backend down.

        Idempotent. Leftovers are logged (they are a leak in the caller).
        """
        with self._lock:
            if self.closed or self._forget_in_fork_child():
                return
            leftovers = self._vmm_leftovers()
            if any(leftovers):
                log.warning("%s: close() releases %d mapping(s), %d range(s), %d chunk(s) still live",
                            self.name, *leftovers)
            errors: list[BaseException] = []
            collect = functools.partial(_collect, errors)
            if leftovers[0] or self.accounting.graphs.alive() or self.accounting.pools.alive():
                with collect():  # what is released below must not be pulled from under queued work
                    self.wait_before_unmap(capture_check=False)
            graphs, pools = self._release_graphs(collect)  # graphs first: they hold their pools' memory
            if graphs or pools:
                log.warning("%s: close() released %d graph(s) and %d pool(s) still live", self.name, graphs, pools)
            self._release_vmm(collect)  # each part releases what it owns
            self._shut_down(collect)
            if errors:
                raise errors[0]


@contextlib.contextmanager
def _collect(errors: list[BaseException]) -> Iterator[None]:
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - keep releasing the rest
        log.error("close: %s", str(exc))
        errors.append(exc)


__all__ = ["ADDRESS_LIMIT", "Backend", "backend_pool"]
