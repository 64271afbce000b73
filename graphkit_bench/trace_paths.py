"""The two ways the serving trace runs a decode step at a batch size: graphkit's runner, and an engine's own
loop inside :func:`graphkit.graph_memory` (the scope), each with or without an executables budget.

* :class:`RunnerPath` -- :class:`graphkit.GraphRunner` over the bench's sizes, ``kind="vmm"``, at most ``K``
  executables per topology (``None``: every size instantiated at its capture's end);
* :class:`EngineLoop` -- the loop nano-vllm writes: static input and output buffers sized for the largest
  batch, every size captured largest first with the framework's own graph API (CUDA: ``torch.cuda.CUDAGraph()``
  and ``torch.cuda.graph(g, pool)``; a host device: ``create_graph`` / ``capture``), and a step that copies
  the inputs into the buffers, pads the rest, replays the size's graph (``g.replay()``; ``Backend.replay``) and
  reads the outputs. It runs unchanged inside ``graph_memory(executables=K)``.

:class:`StepClock` times one step on the device: CUDA events around it (the step synchronised at its end, as
a decode loop reads its sampled tokens), ``perf_counter`` with the device synchronised elsewhere.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable
from typing import Any

import torch

import graphkit
import hal
from graphkit.graphs.capture import release_cached_memory
from graphkit.graphs.executables import ExecutableStats
from graphkit_bench.model import Decoder

#: the paths a strategy of the trace takes
PATHS = ("runner", "scope")


class StepClock:
    """Milliseconds of one call's device work, the device idle before and after it."""

    def __init__(self, be: hal.Backend) -> None:
        self.be = be
        self.cuda = be.torch_device().type == "cuda"
        if self.cuda:
            self.start = torch.cuda.Event(enable_timing=True)
            self.end = torch.cuda.Event(enable_timing=True)

    def time(self, step: Callable[[], Any]) -> float:
        if self.cuda:
            self.start.record()
            step()
            self.end.record()
            self.end.synchronize()
            return float(self.start.elapsed_time(self.end))
        self.be.synchronize()
        t0 = time.perf_counter()
        step()
        self.be.synchronize()
        return (time.perf_counter() - t0) * 1e3


class StepPath:
    """One strategy's graphs over the sizes, ready to run a step at any batch up to the largest size."""

    path: str

    def __init__(self, budget: int | None) -> None:
        self.budget = budget
        self.setup: dict[str, Any] = {}  # what the captures cost, measured right after them

    def step(self, batch: int) -> torch.Tensor:
        raise NotImplementedError

    def stats(self) -> ExecutableStats | None:
        raise NotImplementedError

    def events(self) -> int:
        """Updates and instantiations of the path's executables so far (0 without a budget)."""
        stats = self.stats()
        return 0 if stats is None else stats.updates + stats.instantiations

    def close(self) -> None:
        raise NotImplementedError


class RunnerPath(StepPath):
    """:class:`graphkit.GraphRunner` (``kind="vmm"``, outputs as views) with the budget ``budget``."""

    path = "runner"

    def __init__(self, be: hal.Backend, model: Decoder, sizes: list[int], inputs: dict[int, dict[str, torch.Tensor]],
                 budget: int | None) -> None:
        super().__init__(budget)
        self.inputs = inputs
        release_cached_memory(be)  # what the framework caches is no graph's: the per-size figures exact
        self.runner = graphkit.GraphRunner(model.step, sizes, backend=be, kind="vmm", outputs="view",
                                           fill=model.padding(), progress=False, executables=budget,
                                           measure_memory=True)
        self.runner.capture(inputs[max(sizes)], order="descending")
        report = self.runner.report()
        self.setup = {"capture_seconds": report.capture_seconds, "graphs": report.graphs,
                      "chunk_bytes": report.pool_figures.get("chunk_bytes"),
                      "driver_bytes": report.driver_bytes, "driver_why": report.driver_why}

    def step(self, batch: int) -> torch.Tensor:
        out: torch.Tensor = self.runner(**self.inputs[batch])
        return out

    def stats(self) -> ExecutableStats | None:
        executables = self.runner.pools.executables if self.runner.pools is not None else None
        return executables.stats if executables is not None else None

    def close(self) -> None:
        self.runner.close()


class EngineLoop(StepPath):
    """An engine's capture loop and step, untouched, inside ``graphkit.graph_memory(executables=budget)``."""

    path = "scope"

    def __init__(self, be: hal.Backend, model: Decoder, sizes: list[int], inputs: dict[int, dict[str, torch.Tensor]],
                 budget: int | None) -> None:
        super().__init__(budget)
        self.be, self.model, self.inputs = be, model, inputs
        self.sizes = sorted(sizes)
        largest, device = self.sizes[-1], be.torch_device()
        self.fill = model.padding()
        example = inputs[largest]
        self.buffers = {k: torch.full((largest, *v.shape[1:]), self.fill[k], dtype=v.dtype, device=device)
                        for k, v in example.items()}
        with torch.no_grad():
            self.logits = torch.empty_like(model.step(**example))
        self.cuda = device.type == "cuda"
        self.stream = None if self.cuda else be.create_stream()
        self.graphs: dict[int, Any] = {}
        self.pool: Any = None
        release_cached_memory(be)  # the pools measure the device from their start: what is cached is no graph's
        t0 = time.perf_counter()
        with graphkit.graph_memory(be, executables=budget, children=False) as pools:
            self.pools = pools
            for n in reversed(self.sizes):
                self._capture(n)
        seconds = time.perf_counter() - t0
        release_cached_memory(be)
        report = pools.report()
        self.setup = {"capture_seconds": seconds, "graphs": len(self.graphs),
                      "chunk_bytes": report.chunk_bytes,
                      "driver_bytes": report.driver_bytes, "driver_why": report.driver_why}

    def _capture(self, n: int) -> None:
        views = {k: v[:n] for k, v in self.buffers.items()}
        with torch.no_grad():
            self.logits[:n] = self.model.step(**views)  # warm-up, as the engine's own loop does
            if self.cuda:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, self.pool):
                    self.logits[:n] = self.model.step(**views)
                if self.pool is None:
                    self.pool = graph.pool()
            else:
                graph = self.be.create_graph()
                with self.be.capture(graph, None, self.stream):
                    self.logits[:n] = self.model.step(**views)
        self.graphs[n] = graph

    def step(self, batch: int) -> torch.Tensor:
        n = self.sizes[bisect.bisect_left(self.sizes, batch)]
        for k, value in self.inputs[batch].items():
            buf = self.buffers[k]
            buf[:batch].copy_(value)
            if n > batch:
                buf[batch:n].fill_(self.fill[k])
        graph = self.graphs[n]
        if self.cuda:
            graph.replay()
        else:
            self.be.replay(graph)
        return self.logits[:batch]

    def stats(self) -> ExecutableStats | None:
        return self.pools.executables.stats if self.pools.executables is not None else None

    def close(self) -> None:
        self.be.synchronize()
        for graph in self.graphs.values():
            if self.cuda:
                graph.reset()
            else:
                self.be.release_graph(graph)
        self.graphs.clear()
        self.pools.close()


def open_path(path: str, be: hal.Backend, model: Decoder, sizes: list[int],
              inputs: dict[int, dict[str, torch.Tensor]], budget: int | None) -> StepPath:
    """The strategy of ``path`` with the budget ``budget``, its sizes captured."""
    if path == "runner":
        return RunnerPath(be, model, sizes, inputs, budget)
    if path == "scope":
        return EngineLoop(be, model, sizes, inputs, budget)
    raise hal.InvalidArgumentError(f"path={path!r} must be one of {', '.join(PATHS)}", call="open_path")


__all__ = ["PATHS", "EngineLoop", "RunnerPath", "StepPath", "StepClock", "open_path"]
