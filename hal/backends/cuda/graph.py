"""A ``torch.cuda.CUDAGraph`` as the cuda backend hands it out: with the stream and pool it was captured on.

A cuda graph replays on the stream it was captured on (ordered with the
caller's), and keeps what it uses when it was captured with ``inspect`` or
routed by a route that asked for it (:mod:`hal.backends.cuda.introspect`
reads it). Its capture is the shared one of :mod:`hal.backends._native.capture`;
its replay and release are :class:`~hal.backends.cuda.torch_glue.CudaGlue`'s.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hal.backends._native.torch_glue import TorchPool
from hal.backends.cuda.errors import NAME
from hal.errors import InvalidStateError
from hal.routing import ADDRESSES
from hal.types import GraphAddresses


@dataclass(eq=False)
class CudaGraph:
    """A ``torch.cuda.CUDAGraph`` with the stream and pool it was captured on."""

    torch_graph: Any
    device: int
    stream: Any = None
    pool: TorchPool | None = None
    #: instantiated at its first replay rather than at the end of its capture (``create_graph(lazy=True)``)
    lazy: bool = False
    #: has an executable form (a lazy graph gets one at its first replay or update)
    instantiated: bool = False
    captured: bool = False
    released: bool = False
    #: what the graph uses, read at its capture (``inspect``), or why that could not be read
    addresses: GraphAddresses | str | None = None
    #: whether its work draws random numbers, told by its first replay (None: not known yet)
    draws_random: bool | None = None
    #: the owner of its replays, where a route asked for them (:attr:`hal.types.Route.on_replay`)
    on_replay: Any = None

    def __repr__(self) -> str:
        state = "released" if self.released else "captured" if self.captured else "empty"
        return f"<cuda graph device={self.device} {state}{' lazy' if self.lazy else ''}>"


class FrameworkGraph(CudaGraph):
    """The backend's graph object for a ``torch.cuda.CUDAGraph`` an engine made and captured itself, whose
    replays a route serves: kept uninstantiated at its capture's end, replayed on the caller's current stream
    (as ``torch.cuda.CUDAGraph.replay`` does), holding the torch graph weakly (the engine owns it: it resets
    or drops it)."""

    def __init__(self, torch_graph: Any, device: int) -> None:
        self._ref: Callable[[], Any] = weakref.ref(torch_graph)
        super().__init__(torch_graph, device, lazy=True, captured=True)

    @property
    def torch_graph(self) -> Any:
        """The torch graph, or None once it was garbage-collected."""
        return self._ref()

    @torch_graph.setter
    def torch_graph(self, value: Any) -> None:
        self._ref = weakref.ref(value) if value is not None else _none

    def __repr__(self) -> str:
        return "<cuda framework graph " + super().__repr__()[len("<cuda graph "):]


def _none() -> None:
    return None


def adopt(torch_graph: Any, device: int) -> FrameworkGraph:
    """The backend's graph object for ``torch_graph`` (see :class:`FrameworkGraph`)."""
    return FrameworkGraph(torch_graph, device)


def addresses(graph: CudaGraph | Any) -> GraphAddresses:
    """What a graph captured with ``inspect`` (or routed with an inspecting route) uses.

    :param graph: a :class:`CudaGraph` or a ``torch.cuda.CUDAGraph``.
    :raises InvalidStateError: nothing was recorded for it, or the read failed.
    """
    if isinstance(graph, CudaGraph):
        if graph.released or not graph.captured:
            raise InvalidStateError(f"{graph!r} is not captured", backend=NAME, call="graph_addresses")
        found = graph.addresses
    else:
        found = getattr(graph, "__dict__", {}).get(ADDRESSES)
    if isinstance(found, GraphAddresses):
        return found
    why = (f"reading it failed: {found}" if isinstance(found, str)
           else "it was captured without inspect=True (or by a route without inspect)")
    raise InvalidStateError(f"no addresses were recorded for {graph!r}: {why}", backend=NAME,
                            call="graph_addresses")
