"""A :class:`graphkit.GraphRunner`'s step as pieces, and the :class:`Bucket` of graphs one batch size captured.

A full graph is one piece. A piecewise step is several, with an eager step
between piece ``k`` and ``k + 1`` (attention, typically): piece ``k + 1``
reads static buffers that the eager step fills at every replay. All pieces
of one bucket draw from one lease, so they never alias each other.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_map

import hal
from graphkit.graphs import capture as cap
from graphkit.graphs.buffers import StaticInputs
from graphkit.graphs.executables import Executables
from graphkit.graphs.outputs import Layout, Outputs
from graphkit.graphs.report import SizeReport
from graphkit.graphs.strategies import Lease

log = logging.getLogger(__name__)


@dataclass
class Bucket:
    """Everything captured for one batch size."""

    size: int
    lease: Lease
    graphs: list[Any] = field(default_factory=list)
    outputs: list[Any] = field(default_factory=list)  # per piece
    piece_inputs: list[list[torch.Tensor]] = field(default_factory=list)  # static inputs of pieces 1..
    report: SizeReport | None = None
    layout: Layout | None = None  # the runner's reading of the last piece's outputs, made at its first call

    def read_layout(self) -> Layout:
        """The reading of the last piece's outputs, made once (dropped with the outputs)."""
        if self.layout is None:
            self.layout = Layout(self.outputs[-1], self.size)
        return self.layout


def _spread(piece: Callable[..., Any]) -> Callable[..., Any]:
    """Call a later piece with the previous stage's output (a tensor or a tuple of them)."""

    def call(piece_input: Any) -> Any:
        return piece(*piece_input) if isinstance(piece_input, tuple) else piece(piece_input)

    return call


@dataclass
class Pieces:
    """The step: ``pieces[0](**inputs)``, then ``between[k](out, **inputs)`` feeding ``pieces[k + 1]``."""

    backend: hal.Backend
    pieces: list[Callable[..., Any]]
    between: list[Callable[..., Any]]
    max_size: int
    weak_outputs: bool = False  # keep non-owning aliases of the outputs (vLLM's way)
    #: the executables budget that runs the graphs (None: each graph its own executable, replayed by the backend)
    executables: Executables | None = None

    def replay_graph(self, graph: Any) -> None:
        """Run one captured graph: through the executables budget where there is one."""
        if self.executables is not None:
            self.executables.replay(graph)
        else:
            self.backend.replay(graph)

    def eager(self, **inputs: torch.Tensor) -> Any:
        """Run the step without graphs."""
        out = self.pieces[0](**inputs)
        for step, piece in zip(self.between, self.pieces[1:], strict=True):
            mid = step(out, **inputs)
            out = piece(*mid) if isinstance(mid, tuple) else piece(mid)
        return out

    def capture(self, bucket: Bucket, views: dict[str, torch.Tensor], stream: Any, *,
                capture_error_mode: str | None, strict_hygiene: bool,
                verify: Callable[[Any], None] | None) -> None:
        """Capture every piece into ``bucket`` (its graphs, outputs and the static inputs of later pieces)."""
        size = bucket.size
        feed: Any = views
        for k, piece in enumerate(self.pieces):
            args = feed if k == 0 else {"piece_input": feed}
            fn = piece if k == 0 else _spread(piece)
            captured = cap.capture(self.backend, fn, args, bucket.lease, stream,
                                   capture_error_mode=capture_error_mode,
                                   what=f"batch {size}" + (f" piece {k}" if len(self.pieces) > 1 else ""),
                                   strict_hygiene=strict_hygiene, verify=verify,
                                   lazy=self.executables is not None)
            bucket.graphs.append(captured.graph)
            outputs = captured.outputs
            del captured
            if k + 1 < len(self.pieces):
                mid = self.between[k](outputs, **views)
                feed = self._piece_inputs(bucket, mid)
                del mid
            bucket.outputs.append(tree_map(cap.weak_alias, outputs) if self.weak_outputs else outputs)
            del outputs

    def _piece_inputs(self, bucket: Bucket, mid: Any) -> Any:
        """Static buffers (outside the graph pool) that feed the next piece."""
        leaves = mid if isinstance(mid, tuple) else (mid,)
        buffers = []
        for leaf in leaves:
            buf = torch.empty((self.max_size, *leaf.shape[1:]), dtype=leaf.dtype, device=leaf.device)
            buf[:bucket.size].copy_(leaf)
            buffers.append(buf[:bucket.size])
        bucket.piece_inputs.append(buffers)
        return tuple(buffers) if isinstance(mid, tuple) else buffers[0]

    def replay(self, bucket: Bucket, views: Callable[[int], Mapping[str, torch.Tensor]]) -> Any:
        """Replay the bucket's graphs, running the eager steps between them; its last piece's outputs.

        :param views: the static inputs at a size (asked only for a piecewise step).
        """
        graphs = bucket.graphs
        if len(graphs) == 1:  # a full graph: the call's path, kept short
            self.replay_graph(graphs[0])
            return bucket.outputs[-1]
        inputs = None
        for k, graph in enumerate(graphs):
            self.replay_graph(graph)
            if k + 1 < len(graphs):
                if not inputs:
                    inputs = views(bucket.size)
                mid = self.between[k](bucket.outputs[k], **inputs)
                for buf, leaf in zip(bucket.piece_inputs[k], mid if isinstance(mid, tuple) else (mid,), strict=False):
                    buf.copy_(leaf)
        return bucket.outputs[-1]

    def release(self, bucket: Bucket) -> list[BaseException]:
        """Release the bucket's graphs and forget its outputs; the errors of graphs that stay (kept in it)."""
        errors: list[BaseException] = []
        kept = []
        for graph in bucket.graphs:
            try:
                if self.executables is not None:
                    self.executables.forget(graph)  # an executable it holds goes with it
                self.backend.release_graph(graph)
            except hal.HalError as exc:
                log.error("batch %d: a graph could not be released: %s", bucket.size, str(exc))
                errors.append(exc)
                kept.append(graph)
        bucket.graphs[:] = kept
        bucket.outputs.clear()
        bucket.layout = None  # it holds the outputs too
        bucket.piece_inputs.clear()
        return errors


class CallPlan:
    """What a runner call at one batch does, made at its first call: the size and bucket that serve the batch, the
    static buffers' views its inputs are copied into, the reading of the bucket's outputs, and for a one-graph
    bucket whose one tensor output is handed out as a view, that graph and that output (a call then only copies,
    replays and slices)."""

    __slots__ = ("batch", "bucket", "graph", "layout", "rows", "single", "size", "sliced")

    def __init__(self, batch: int, size: int, bucket: Bucket, rows: list[tuple[str, tuple[Any, Any, Any]]],
                 single: torch.Tensor | None) -> None:
        self.batch, self.size, self.bucket, self.rows = batch, size, bucket, rows
        self.layout = bucket.read_layout()
        self.graph = bucket.graphs[0]
        self.single = single
        self.sliced = single is not None and single.dim() > 0 and single.shape[0] == size

    def run(self, step: Pieces, inputs: Mapping[str, torch.Tensor], views: Callable[[int], Mapping[str, torch.Tensor]],
            outputs: Outputs) -> Any:
        """Copy the inputs in, replay, hand out the batch's rows (no autograd: no input requires gradients)."""
        for name, (prefix, padding, fill) in self.rows:
            prefix.copy_(inputs[name], True)  # non_blocking
            if padding is not None:
                padding.fill_(fill)
        if self.single is not None:
            step.replay_graph(self.graph)
            return self.single[:self.batch] if self.sliced else self.single
        step.replay(self.bucket, views)
        return outputs.deliver(self.layout, self.batch)


class CallPlans:
    """A runner's call plans by batch, made once and dropped when its captured sizes change (bounded)."""

    #: the most batches whose plans are kept
    LIMIT = 4096

    def __init__(self, outputs: Outputs) -> None:
        self.outputs = outputs
        self._plans: dict[int, CallPlan] = {}

    def get(self, batch: int) -> CallPlan | None:
        return self._plans.get(batch)

    def clear(self) -> None:
        self._plans.clear()

    def make(self, batch: int, size: int, bucket: Bucket, static: StaticInputs) -> CallPlan:
        """The plan of ``batch``, served by ``bucket`` of ``size``, kept for the next calls."""
        if len(self._plans) >= self.LIMIT:  # a stream of ever new batches
            self._plans.clear()
        one_view = self.outputs.mode == "view" and len(bucket.graphs) == 1
        single = bucket.read_layout().single if one_view else None
        plan = self._plans[batch] = CallPlan(batch, size, bucket, list(static.rows_for(batch, size).items()), single)
        return plan


__all__ = ["Bucket", "CallPlan", "CallPlans", "Pieces"]
