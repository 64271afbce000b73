"""One measured case of the engine-shaped decode loop (``examples/engine-decode/engine.py``).

The bench's other cases run graphkit's own runner; these run a capture loop
written the way engines write theirs, with its own shared pool (outputs kept
as nano-vllm and SGLang do, or weakly referenced as vLLM does), with
``graphkit.graph_memory`` around it (no line changed), or with a
``GraphPools`` handle per batch size (one line changed).
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import random
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any, Literal

import torch

import graphkit
import hal
from graphkit.graphs.capture import release_cached_memory
from graphkit.memory.phases import CAPTURE_TIMES
from graphkit_bench import verifier
from graphkit_bench.case_figures import graphkit_share, verify_figures
from graphkit_bench.timing import median_ms

log = logging.getLogger("graphkit.bench.engine")

#: strategy -> how the engine is set up
ENGINE_STRATEGIES = {
    "own-kept": "the engine's own shared pool, outputs kept (nano-vllm, SGLang)",
    "own-weakref": "the engine's own shared pool, outputs weakly referenced (vLLM)",
    "graph_memory": "graphkit.graph_memory around the unchanged capture loop",
    "graph_memory-replay": "the same, outputs declared valid until the next replay (outputs='replay')",
    "graph_pools": "pool=pools.pool(batch_size): a GraphPools handle per size",
}
#: the graph_memory strategies and the lifetime of the outputs each declares
OUTPUTS: dict[str, Literal["kept", "replay"]] = {"graph_memory": "kept", "graph_memory-replay": "replay"}
ENGINE_ORDERS = ("descending", "ascending", "random", "on-demand")
MAX_MODEL_LEN = {"reference": 128, "tiny": 32}
_MODULE = "graphkit_engine_decode_example"


def engine_path() -> Path:
    return Path(graphkit.__file__).resolve().parents[1] / "examples" / "engine-decode" / "engine.py"


def load_engine_module() -> ModuleType:
    """The example engine, imported from the source checkout graphkit runs from."""
    if _MODULE in sys.modules:
        return sys.modules[_MODULE]
    path = engine_path()
    if not path.is_file():
        raise hal.UnsupportedError(f"the engine cases need the example engine at {path}, which is part of a source "
                                   "checkout (installed packages do not ship examples/): run from a clone",
                                   call="run_engine_case")
    spec = importlib.util.spec_from_file_location(_MODULE, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[_MODULE] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[_MODULE]
        raise
    return module


def _used(be: hal.Backend) -> int:
    be.synchronize()
    release_cached_memory(be)
    return be.mem_info().used


def _prime_capture(be: hal.Backend) -> None:
    """One throwaway capture, so one-time costs of the capture machinery (imports, initialisation)
    are not counted in the first measured capture."""
    x = torch.ones(8, device=be.torch_device())
    graph = be.create_graph()
    try:
        with torch.no_grad(), be.capture(graph):
            x * 2
    finally:
        be.release_graph(graph)


def _rows(batch: Any, n: int) -> Any:
    """The first ``n`` sequences of a decode batch."""
    return type(batch)(**{name: t[:n] for name, t in batch.items()})


def _capture_on_demand(engine: Any, sizes: list[int], batch: Any, seed: int) -> float:
    """Serve a seeded random stream of batches, capturing a size the first time a batch needs it."""
    rng = random.Random(seed)
    ordered = sorted(set(sizes))
    seconds, draws = 0.0, 0
    while len(engine.graphs) < len(ordered):
        k = rng.randrange(len(ordered)) if draws < 20 * len(ordered) else \
            next(i for i, s in enumerate(ordered) if s not in engine.graphs)
        n = rng.randint(ordered[k - 1] + 1 if k else 1, ordered[k])  # a batch whose bucket is ordered[k]
        if ordered[k] not in engine.graphs:
            seconds += engine.capture_graph(ordered[k])
        engine.step(_rows(batch, n))
        draws += 1
    return seconds


def _check(engine: Any, sizes: list[int], seed: int) -> tuple[float, bool]:
    """Largest |graph - eager| over the logits of a few greedy steps at several batch sizes; tokens equal.

    Eager runs on the inputs the graph reads (padded to its batch size): in
    bf16 a matrix product of another batch size rounds differently, enough
    to flip a near-tie argmax, and this is about what graph memory changes.
    The tests compare against unpadded eager decoding in float32.
    """
    largest = max(sizes)
    worst, same = 0.0, True
    rng = random.Random(seed)
    for n in sorted({1, min(3, largest), largest // 2 + 1, largest}):
        prompts = [[rng.randrange(engine.cfg.vocab) for _ in range(rng.randint(1, 3))] for _ in range(n)]
        got = engine.generate(prompts, 3)
        want = engine.generate(prompts, 3, use_graphs=False, padded=True)
        same &= got.tokens == want.tokens
        for a, b in zip(got.logits, want.logits, strict=True):
            worst = max(worst, float((a.float() - b.float()).abs().max()))
    return worst, same


def run_engine_case(strategy: str, order: str, sizes: list[int], backend: hal.Backend, config: str = "reference",
                    seed: int = 0, iters: int = 20) -> dict[str, Any]:
    """Capture ``sizes`` in ``order`` with ``strategy``; return memory, capture time, replay time and error.

    ``graph_memory_bytes`` is the device's used-memory growth from before
    the first capture to after the last, framework caches emptied.
    Everything the case made is released before it returns.
    """
    if strategy not in ENGINE_STRATEGIES or order not in ENGINE_ORDERS or not sizes:
        raise hal.InvalidArgumentError(f"strategy={strategy!r} must be one of {list(ENGINE_STRATEGIES)}, "
                                       f"order={order!r} one of {list(ENGINE_ORDERS)}, sizes not empty",
                                       backend=backend.name, call="run_engine_case")
    engine_module = load_engine_module()
    be, sizes = backend, sorted(set(sizes))
    pools = graphkit.GraphPools(be, verify=verifier.on()) if strategy == "graph_pools" else None
    engine = None
    try:
        engine = engine_module.Engine(be, config, max_batch=max(sizes), seed=seed, pools=pools,
                                      max_model_len=MAX_MODEL_LEN.get(config, 128),
                                      keep_outputs="weak" if strategy == "own-weakref" else "strong")
        batch = engine.example_batch(max(sizes), seed=seed)
        _prime_capture(be)
        before = _used(be)
        t0 = time.perf_counter()
        scope = (graphkit.graph_memory(be, verify=verifier.on(), outputs=OUTPUTS[strategy])
                 if strategy in OUTPUTS else contextlib.nullcontext(pools))
        with scope as pools, CAPTURE_TIMES.counting() as parts:
            if order == "on-demand":
                seconds = _capture_on_demand(engine, sizes, batch, seed)
            else:
                seconds = engine.capture_graphs(sizes, order, seed)
        wall = time.perf_counter() - t0
        memory = _used(be) - before
        report = pools.report() if pools is not None else None
        chunk_bytes = report.chunk_bytes if report is not None else None
        timed = sorted({1, max(sizes)})
        replay_ms = {str(n): median_ms(be, lambda n=n: engine.step(_rows(batch, n)), iters) for n in timed}
        eager_ms = {str(n): median_ms(be, lambda n=n: engine.eager_step(_rows(batch, n)), iters) for n in timed}
        error, tokens_equal = _check(engine, sizes, seed)
    finally:
        errors = _teardown(be, engine, pools)
    if errors:
        raise errors[0]
    return {"strategy": strategy, "order": order, "sizes": sizes, "config": config,
            "graph_memory_bytes": memory, "chunk_bytes": chunk_bytes, "capture_seconds": seconds,
            "map_calls": report.map_calls if report is not None else None,
            "map_seconds": report.map_seconds if report is not None else None,
            **verify_figures(report), **graphkit_share(parts, report, seconds),
            "capture_wall_seconds": wall, "replay_ms": replay_ms, "eager_ms": eager_ms,
            "replay_ms_1": replay_ms["1"], "replay_ms_max": replay_ms[str(max(sizes))],
            "max_abs_error": error, "tokens_equal": tokens_equal}


def _teardown(be: hal.Backend, engine: Any, pools: graphkit.GraphPools | None) -> list[BaseException]:
    """Graphs, then pools, then cached memory; keeps going past a failure (logged and returned)."""
    errors: list[BaseException] = []
    for step in (engine.close if engine is not None else None, pools.close if pools is not None else None,
                 lambda: release_cached_memory(be)):
        if step is None:
            continue
        try:
            step()
        except Exception as exc:  # noqa: BLE001 - collected and returned; teardown goes on
            log.error("engine case teardown: %s: %s", type(exc).__name__, exc)
            errors.append(exc)
    return errors


__all__ = ["ENGINE_ORDERS", "ENGINE_STRATEGIES", "engine_path", "graphkit_share", "load_engine_module",
           "run_engine_case", "verify_figures"]
