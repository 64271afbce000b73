"""Graphs for host-like devices: capture and replay without a graph runtime.

A device whose memory the host can address (host memory, or device memory
mapped into the process) has no graph runtime for torch to capture into.
This package gives its backend plugin one, the way the ``fake`` backend
has it: capture runs the function once and records the torch ops it
dispatches; replay re-runs exactly the recorded ops on the same addresses,
never the Python function.

A plugin inherits :class:`HostGraphs` and wires it to the device's own
allocator; it then has the ``"graphs"``, ``"custom_pool"``,
``"capture_routing"``, ``"use_pool"``, ``"graph_addresses"``, ``"lazy_graphs"``
and ``"graph_update"`` capabilities (:data:`hal.host.graphs.CAPABILITIES`)::

    import hal
    from hal.host import HostGraphs, vm

    class MyBackend(HostGraphs):
        def __init__(self, device: int = 0, *, granularity: int = 64 << 10) -> None:
            self.granularity_bytes = granularity  # the device's granularity: pools take memory in it
            self.init_host_graphs("mine", alloc=self.device_malloc, free=self.device_free,
                                  segment_size=granularity)

        def device_malloc(self, nbytes: int) -> int:  # the device's own allocator
            return vm.alloc(nbytes, backend="mine")

        def device_free(self, ptr: int, nbytes: int) -> None:
            vm.free(ptr, nbytes, backend="mine")

(plus the vmm hooks; ``examples/hal-hostmem`` is a complete plugin). To
declare fewer capabilities, override :meth:`HostGraphs.capabilities` and
mark the override ``@hal.hookimpl`` again: an unmarked override is refused
when the plugin is loaded.

What the pieces are (see ``docs/plugins.md``, "Graphs", for the semantics):

* :class:`HostStream` -- a stream stand-in (host work runs when issued);
* :class:`BlockPool` -- a pool: blocks of :data:`hal.types.ALLOCATION_ALIGNMENT`
  bytes carved from segments of ``segment_size`` bytes;
* :class:`HostGraph` -- a graph: the recorded tape, its compiled replay
  program, and :meth:`HostGraph.addresses` (the memory its replay touches);
* :class:`hal.host.inflight.InFlight` -- with ``init_host_graphs(...,
  asynchronous=True)``: what queued work may still use until the next
  ``synchronize``, for an ``unmap`` to refuse (as a device that runs behind
  the host would fault);
* :mod:`hal.host.vm` -- the vmm half for host memory, from the OS: ``PROT_NONE``
  reservations, ``memfd`` chunks mapped with ``MAP_FIXED``, plain memory for
  ``alloc``, with hal errors.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hal.host import vm
from hal.host.graphs import CAPABILITIES, DEFAULT_STREAM, HostGraphs, HostStream
from hal.host.pool import BlockPool

if TYPE_CHECKING:  # pragma: no cover
    from hal.host.tape import HostGraph, tensor_at


def __getattr__(name: str) -> Any:
    """``HostGraph`` and ``tensor_at`` import torch: only when asked for (a probe stays cheap)."""
    if name in ("HostGraph", "tensor_at"):
        from hal.host import tape

        return getattr(tape, name)
    raise AttributeError(f"module 'hal.host' has no attribute {name!r}")


__all__ = ["CAPABILITIES", "DEFAULT_STREAM", "BlockPool", "HostGraph", "HostGraphs", "HostStream", "tensor_at", "vm"]
