"""A Hugging Face transformers decoder (random weights) captured one decode step per batch size.

:func:`build_hf_decoder` builds a Qwen3-shaped causal LM from a config (no
download: the weights are random), a transformers ``StaticCache`` for
``max_batch`` sequences of ``max_len`` tokens, and static input buffers;
:class:`HFDecode` runs one decode step over the first ``batch`` rows of them,
the way an engine's capture loop does, so each captured graph serves one
batch size. :func:`run_hf_case` captures it at many sizes with one memory
strategy and capture order, replays it, and measures memory, time and the
error against eager.

What makes the forward capturable (checked on transformers 4.51 to 5.x):

* **no host read of the cache length.** Every input the forward would
  otherwise derive from the cache is given: ``position_ids`` (and
  ``cache_position`` where the model still takes it), so neither
  ``get_seq_length()`` (a ``.sum()`` over the cache in 4.5x) nor anything
  built on it runs;
* **the write position is a device tensor.** transformers 5.x's
  ``StaticLayer`` writes at its own ``cumulative_length`` tensor and adds the
  new tokens to it in place; a graph replays that increment, so the step
  first copies the position buffer into every layer's ``cumulative_length``
  (captured with the rest): each replay writes where its inputs say.
  4.5x writes at ``cache_position``, a static buffer;
* **an explicit causal mask over the static cache.** With ``attention_mask``
  left ``None`` and a compileable (static) cache, transformers never takes
  the "skip the mask, let SDPA use ``is_causal``" shortcut for one query
  token, whose checks read tensors on the host; the mask is built from
  ``arange`` and the position tensor, all on the device;
* **``sdpa`` attention** (``eager`` captures too); the flash kernels'
  wrappers read sequence lengths on the host;
* **one cache view per batch size.** ``StaticCache`` writes every row of its
  batch, so the step runs on a shallow copy of the cache whose layers hold
  ``keys[:batch]`` / ``values[:batch]`` of the one full-size cache; the
  views allocate nothing and are made outside the capture.

On CUDA transformers also sees ``torch.cuda.is_current_stream_capturing()``
(its ``is_tracing``) and avoids data-dependent shortcuts by itself; the fake
backend sets no such flag, which is why none of the above may rely on it.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import random
import time
from dataclasses import dataclass
from typing import Any, Literal, cast

import torch

import graphkit
import hal
from graphkit.graphs.capture import release_cached_memory, weak_alias
from graphkit.graphs.runner import ordered_sizes
from graphkit.memory.phases import CAPTURE_TIMES
from graphkit_bench import verifier
from graphkit_bench.case_figures import graphkit_share, verify_figures
from graphkit_bench.strategies import Order
from graphkit_bench.timing import median_ms
from hal.gcguard import gc_disabled

Size = Literal["tiny", "reference"]
STRATEGIES = ("own-kept", "own-weakref", "graph_memory", "graph_memory-replay", "graph_pools")
ORDERS = ("descending", "ascending", "random", "on-demand")

#: largest error of captured logits against eager, relative to the largest eager logit
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 1e-2}

#: Qwen3-0.6B's shape; "tiny" runs in seconds on a 2-core CPU
SHAPES: dict[str, dict[str, Any]] = {
    "reference": dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                      head_dim=128, intermediate_size=3072, vocab_size=151936, rms_norm_eps=1e-6,
                      rope_theta=1_000_000.0, max_position_embeddings=40960, tie_word_embeddings=True),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 intermediate_size=128, vocab_size=512, rms_norm_eps=1e-6, rope_theta=10000.0,
                 max_position_embeddings=256, tie_word_embeddings=False),
}
DTYPES = {"reference": torch.bfloat16, "tiny": torch.float32}


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("graphkit_bench.hf needs transformers (pip install 'transformers>=4.51')") from exc
    return transformers


def hf_config(size: Size) -> Any:
    """The config of ``size``: a ``Qwen3Config`` (a ``LlamaConfig`` of the same shape before Qwen3 existed)."""
    tf = _transformers()
    if size not in SHAPES:
        raise ValueError(f"size={size!r} must be one of {sorted(SHAPES)}")
    shape = dict(SHAPES[size])
    config_class = getattr(tf, "Qwen3Config", None)
    if config_class is None:  # transformers < 4.51
        config_class = tf.LlamaConfig
    rope_theta = shape.pop("rope_theta")
    if config_class is not tf.LlamaConfig:
        shape.update(use_sliding_window=False, sliding_window=None)  # as Qwen3-0.6B's own config
    config = config_class(**shape, attention_dropout=0.0, use_cache=True)
    # 5.x keeps rope parameters in a dict (rope_parameters), 4.x in rope_theta
    if isinstance(getattr(config, "rope_parameters", None), dict):
        config.rope_parameters["rope_theta"] = rope_theta
    else:
        config.rope_theta = rope_theta
    return config


def _new_model(config: Any, device: torch.device, dtype: torch.dtype) -> Any:
    tf = _transformers()
    version = tuple(int(part) for part in tf.__version__.split(".")[:2])
    dtype_kw = "dtype" if version >= (4, 56) else "torch_dtype"  # torch_dtype is deprecated from 4.56 on
    kwargs = {dtype_kw: dtype, "attn_implementation": "sdpa"}
    try:
        with torch.device(device):  # initialise on the device: 0.6B parameters initialise in no time there
            model = tf.AutoModelForCausalLM.from_config(config, **kwargs)
    except (RuntimeError, NotImplementedError, TypeError):  # pragma: no cover - older transformers
        model = tf.AutoModelForCausalLM.from_config(config, **kwargs)
    # inference only: no parameter asks for gradients (the fake backend replays its tape under the
    # caller's grad mode, where ops on parameters would record autograd history)
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)


class HFDecode:
    """One decode step of a transformers causal LM over static buffers, per batch size.

    ``set_inputs(tokens, position)`` copies the new token of each sequence
    into ``input_ids`` and the (shared) position into ``position_ids`` /
    ``cache_position``; ``step(batch)`` runs the model over the first
    ``batch`` rows and returns their logits, ``[batch, vocab]``. Graph
    outputs live in graph memory: read them right after the replay.
    """

    def __init__(self, model: Any, config: Any, max_batch: int, max_len: int, device: torch.device,
                 dtype: torch.dtype, seed: int = 0) -> None:
        tf = _transformers()
        self.transformers_version = tf.__version__
        self.model, self.config = model, config
        self.max_batch, self.max_len = max_batch, max_len
        self.device, self.dtype, self.seed = torch.device(device), dtype, seed
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.vocab = config.vocab_size
        self.input_ids = torch.zeros(max_batch, 1, dtype=torch.long, device=self.device)
        self.position_ids = torch.zeros(max_batch, 1, dtype=torch.long, device=self.device)
        self.cache_position = torch.zeros(1, dtype=torch.long, device=self.device)
        params = inspect.signature(model.model.forward).parameters
        self.takes_cache_position = "cache_position" in params
        self.cache = self._new_cache(tf)
        self.layered = hasattr(self.cache, "layers")
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] = (
            [(layer.keys, layer.values) for layer in self.cache.layers] if self.layered
            else list(zip(self.cache.key_cache, self.cache.value_cache, strict=True)))
        # transformers >= 5.x: the write position is a tensor of each layer, advanced in place
        self.cumulative = [layer.cumulative_length for layer in getattr(self.cache, "layers", [])
                           if isinstance(getattr(layer, "cumulative_length", None), torch.Tensor)]
        if not self.takes_cache_position and len(self.cumulative) != len(self.kv):
            raise NotImplementedError(f"transformers {tf.__version__}: the static cache takes neither "
                                      "cache_position nor a position tensor; this version is not supported")
        self._views: dict[int, Any] = {max_batch: self.cache}
        self.reset_cache()

    # -- the cache ------------------------------------------------------------------

    def _new_cache(self, tf: Any) -> Any:
        shape = (self.max_batch, self.kv_heads, self.max_len, self.head_dim)
        params = inspect.signature(tf.StaticCache.__init__).parameters
        if "max_batch_size" in params or "max_cache_len" not in params:
            # 4.50 - 4.55: the constructor makes the tensors (4.55's takes *args, **kwargs)
            cache = tf.StaticCache(config=self.config, max_batch_size=self.max_batch, max_cache_len=self.max_len,
                                   device=self.device, dtype=self.dtype)
        else:  # 4.56 on: the layers are sized by early_initialization or the first update
            cache = tf.StaticCache(config=self.config, max_cache_len=self.max_len)
        layers = getattr(cache, "layers", [])
        if any(getattr(layer, "keys", None) is None for layer in layers):
            if hasattr(cache, "early_initialization"):
                cache.early_initialization(batch_size=self.max_batch, num_heads=self.kv_heads,
                                           head_dim=self.head_dim, dtype=self.dtype, device=self.device)
            else:  # pragma: no cover - a layered cache without early_initialization: what its first update does
                kv = torch.zeros(shape, dtype=self.dtype, device=self.device)[:, :, :1]
                for layer in layers:
                    try:
                        layer.lazy_initialization(kv, kv)
                    except TypeError:
                        layer.lazy_initialization(kv)
        for layer in getattr(cache, "layers", []):
            if tuple(layer.keys.shape) != shape:
                raise NotImplementedError(f"transformers {tf.__version__}: static cache layer of shape "
                                          f"{tuple(layer.keys.shape)}, expected {shape}")
        return cache

    def cache_view(self, batch: int) -> Any:
        """A shallow copy of the cache over its first ``batch`` rows (made once per size, allocates nothing)."""
        view = self._views.get(batch)
        if view is not None:
            return view
        if not 1 <= batch <= self.max_batch:
            raise ValueError(f"batch={batch} must be within 1..{self.max_batch}")
        view = copy.copy(self.cache)
        if self.layered:
            layers = []
            for layer in self.cache.layers:
                part = copy.copy(layer)  # shares cumulative_length (a tensor) with the full cache
                part.keys, part.values = layer.keys[:batch], layer.values[:batch]
                for name in ("batch_size", "max_batch_size"):
                    if name in vars(layer):
                        setattr(part, name, batch)
                layers.append(part)
            view.layers = layers
        else:
            view.key_cache = [k[:batch] for k, _ in self.kv]
            view.value_cache = [v[:batch] for _, v in self.kv]
            if "max_batch_size" in vars(self.cache):
                view.max_batch_size = batch
        self._views[batch] = view
        return view

    def reset_cache(self) -> None:
        """Refill the cache with the same pseudo-random history, so runs can be compared."""
        gen = torch.Generator(self.device).manual_seed(self.seed + 1)
        with torch.no_grad():
            for keys, values in self.kv:
                keys.normal_(generator=gen)
                values.normal_(generator=gen)

    def weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    def kv_cache_bytes(self) -> int:
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self.kv)

    # -- inputs and the step ------------------------------------------------------------

    def example_inputs(self, batch: int, seed: int = 0) -> tuple[torch.Tensor, int]:
        """Tokens of ``batch`` sequences and the position they all decode at."""
        gen = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, self.vocab, (batch,), generator=gen)
        position = int(torch.randint(1, self.max_len, (1,), generator=gen))
        return tokens.to(self.device), position

    def set_inputs(self, tokens: torch.Tensor, position: int) -> None:
        """Copy the inputs of one step into the static buffers (outside any capture)."""
        if not 0 <= position < self.max_len:
            raise ValueError(f"position={position} must be within 0..{self.max_len - 1}")
        n = tokens.shape[0]
        self.input_ids[:n, 0].copy_(tokens)
        self.position_ids.fill_(position)
        self.cache_position.fill_(position)

    def prepare(self, batch: int) -> None:
        """Make what ``step(batch)`` needs besides device work (call before capturing; step calls it too)."""
        self.cache_view(batch)

    def step(self, batch: int) -> torch.Tensor:
        """Logits ``[batch, vocab]`` of one decode step over the first ``batch`` rows of the buffers."""
        cache = self.cache_view(batch)
        position = self.cache_position[0]
        for length in self.cumulative:  # where 5.x's StaticLayer writes: the position of this step
            length.copy_(position)
        kwargs: dict[str, Any] = dict(input_ids=self.input_ids[:batch], position_ids=self.position_ids[:batch],
                                      past_key_values=cache, use_cache=True)
        if self.takes_cache_position:
            kwargs["cache_position"] = self.cache_position
        with torch.no_grad():
            logits = self.model(**kwargs).logits
        return logits[:, -1, :]

    def eager(self, batch: int, tokens: torch.Tensor, position: int) -> torch.Tensor:
        """The eager logits of one step from the reset cache state (a copy)."""
        self.reset_cache()
        self.set_inputs(tokens, position)
        return self.step(batch).clone()


def build_hf_decoder(size: Size = "tiny", device: Any = "cpu", dtype: torch.dtype | None = None, seed: int = 0,
                     max_batch: int = 16, max_len: int = 64) -> HFDecode:
    """A Qwen3-shaped transformers model with random weights, its static cache and buffers on ``device``.

    ``reference``: Qwen3-0.6B's shape in bfloat16; ``tiny``: 2 layers,
    hidden 64, vocabulary 512, float32, for a CPU. Nothing is downloaded.
    """
    config = hf_config(size)
    dtype = dtype or DTYPES[size]
    device = torch.device(device)
    torch.manual_seed(seed)
    model = _new_model(config, device, dtype)
    return HFDecode(model, model.config, max_batch, max_len, device, dtype, seed)


# -- one case: a strategy, an order, the sizes ---------------------------------------------


def capture_order(order: str, sizes: list[int], seed: int = 0) -> list[int]:
    """The sizes in the order they are captured (``on-demand``: the order of first arrival)."""
    if order == "on-demand":
        return list(dict.fromkeys(arrivals(sizes, seed)))
    if order not in ORDERS:
        raise ValueError(f"order={order!r} must be one of {ORDERS}")
    return ordered_sizes(sorted(sizes), cast(Order, order), seed)


def arrivals(sizes: list[int], seed: int = 0) -> list[int]:
    """A seeded random stream of batch sizes: every size at least once, some more than once."""
    rng = random.Random(seed)
    stream = sorted(sizes) + rng.choices(sorted(sizes), k=len(sizes))
    rng.shuffle(stream)
    return stream


@dataclass
class _Check:
    worst_abs: float = 0.0
    worst_rel: float = 0.0
    checks: int = 0

    def add(self, got: torch.Tensor, want: torch.Tensor) -> None:
        got, want = got.float(), want.float()
        err = float((got - want).abs().max())
        scale = float(want.abs().max().clamp_min(1e-12))
        self.worst_abs = max(self.worst_abs, err)
        self.worst_rel = max(self.worst_rel, err / scale)
        self.checks += 1


def run_hf_case(strategy: str, order: str, sizes: list[int], backend: hal.Backend | str | None = None,
                size: Size = "reference", seed: int = 0, iters: int = 20, *, decode: HFDecode | None = None,
                max_len: int = 64) -> dict[str, Any]:
    """Capture ``decode.step`` at every size with one memory strategy and order; measure and check it.

    Strategies: ``own-kept`` (one pool from ``be.create_pool()`` passed to
    every capture, outputs kept: SGLang, nano-vllm), ``own-weakref`` (the
    same, outputs held by :func:`graphkit.graphs.capture.weak_alias`: vLLM),
    ``graph_memory`` (the engine's loop unchanged, passing ``pool=None``,
    inside :func:`graphkit.graph_memory`), ``graph_pools``
    (``GraphPools(be).pool(size)`` per size). Orders: ``descending``,
    ``ascending``, ``random`` (seeded), ``on-demand`` (each size captured
    when it first arrives in a seeded random stream of batches, which is
    served and checked as it goes).

    ``decode`` reuses a model built by :func:`build_hf_decoder` (its
    ``max_batch`` must cover the sizes). Graphs are released and pools
    closed before returning. Every size runs once on the capture stream
    before memory is measured (workspaces, lazily loaded kernels). The
    first graph capture of a process also costs the driver memory that
    later ones do not (46 MiB on an H100, whatever the pool): compare
    strategies after one case has run.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy={strategy!r} must be one of {STRATEGIES}")
    plan = capture_order(order, sizes, seed)
    if isinstance(backend, hal.Backend):
        be, owns_backend = backend, False
    else:
        be, owns_backend = hal.get_backend(backend, requires=("graphs",)), True
    try:
        return _run_case(be, strategy, order, sorted(set(sizes)), plan, size, seed, iters, decode, max_len)
    finally:
        if owns_backend:
            be.close()


def _run_case(be: hal.Backend, strategy: str, order: str, sizes: list[int], plan: list[int], size: Size,
              seed: int, iters: int, decode: HFDecode | None, max_len: int) -> dict[str, Any]:
    dec = decode or build_hf_decoder(size, be.torch_device(), None, seed, max(sizes), max_len)
    if dec.max_batch < max(sizes):
        raise ValueError(f"the decoder holds {dec.max_batch} sequences; sizes go up to {max(sizes)}")
    inputs = {n: dec.example_inputs(n, seed=seed * 1000 + n) for n in sizes}
    reference = {n: dec.eager(n, *inputs[n]) for n in sizes}
    largest, smallest = max(sizes), min(sizes)
    eager_ms = median_ms(be, lambda: dec.step(smallest), iters, warmup=2)
    stream = be.create_stream()

    own_pool = be.create_pool() if strategy in ("own-kept", "own-weakref") else None
    replay_scoped = strategy == "graph_memory-replay"
    pools = (graphkit.GraphPools(be, verify=verifier.on(), outputs="replay" if replay_scoped else "kept")
             if strategy in ("graph_memory", "graph_memory-replay", "graph_pools") else None)
    scope = (graphkit.graph_memory(be, pools=pools) if strategy in ("graph_memory", "graph_memory-replay")
             else contextlib.nullcontext())
    graphs: dict[int, Any] = {}
    outputs: dict[int, torch.Tensor] = {}
    check = _Check()
    capture_seconds = 0.0
    result: dict[str, Any] = {}

    def capture(n: int) -> None:
        nonlocal capture_seconds
        dec.prepare(n)
        for _ in range(2):  # the engine's own warm-up, on its stream (hal makes the capture stream's state)
            dec.step(n)
        be.synchronize()
        t0 = time.perf_counter()  # getting the pool counts: graph_memory makes its space inside the capture
        pool = (own_pool if own_pool is not None
                else pools.pool(n) if pools is not None and strategy == "graph_pools" else None)
        graph = be.create_graph()
        try:
            with gc_disabled(), torch.no_grad(), be.capture(graph, pool=pool, stream=stream):
                out = dec.step(n)
            be.synchronize(stream)
        except BaseException:
            be.release_graph(graph)
            raise
        capture_seconds += time.perf_counter() - t0
        graphs[n] = graph
        outputs[n] = weak_alias(out) if strategy == "own-weakref" else out

    def serve(n: int) -> torch.Tensor:
        dec.reset_cache()
        dec.set_inputs(*inputs[n])
        be.replay(graphs[n])
        return outputs[n]

    try:
        # what a stream and each shape get on first use (cuBLAS workspaces, lazily loaded kernels) is not
        # graph memory: born before measuring
        be.synchronize()
        with be.use_stream(stream):
            for n in sizes:
                dec.step(n)
        release_cached_memory(be)
        be.synchronize()
        before = be.mem_info().used
        with scope, CAPTURE_TIMES.counting() as parts:
            if order == "on-demand":
                for n in arrivals(sizes, seed):
                    if n not in graphs:
                        capture(n)
                    check.add(serve(n), reference[n])
            else:
                for n in plan:
                    capture(n)
        release_cached_memory(be)
        be.synchronize()
        result["graph_memory_bytes"] = be.mem_info().used - before
        if pools is not None:
            report = pools.report()
            result.update(chunk_bytes=report.chunk_bytes, reserved_bytes=report.reserved_bytes,
                          spaces=len(report.keys), graphs_per_space=sorted({k.graphs for k in report.keys}),
                          map_calls=report.map_calls, map_seconds=report.map_seconds, **verify_figures(report))
        else:
            result["chunk_bytes"] = 0
        result.update(graphkit_share(parts, pools.report() if pools is not None else None, capture_seconds))
        for n in sizes:
            check.add(serve(n), reference[n])
        replay_ms = {}
        for n in sorted({smallest, largest}):
            dec.reset_cache()
            dec.set_inputs(*inputs[n])
            replay_ms[str(n)] = median_ms(be, lambda n=n: be.replay(graphs[n]), iters, warmup=2)
    finally:
        outputs.clear()
        be.synchronize()
        for graph in graphs.values():
            be.release_graph(graph)
        graphs.clear()
        if own_pool is not None:
            be.release_pool(own_pool)
        if pools is not None:
            pools.close()
        release_cached_memory(be)

    tolerance = TOLERANCE.get(dec.dtype, 2e-2)
    return {
        "strategy": strategy,
        "order": order,
        "sizes": sizes,
        "capture_order": plan,
        "size": size,
        "dtype": str(dec.dtype).replace("torch.", ""),
        "backend": be.name,
        "transformers": dec.transformers_version,
        **result,
        "capture_seconds": capture_seconds,
        "replay_ms": replay_ms,
        "replay_ms_1": replay_ms[str(smallest)],
        "replay_ms_max": replay_ms[str(largest)],
        "eager_ms": {str(smallest): eager_ms},
        "max_abs_error": check.worst_abs,
        "max_rel_error": check.worst_rel,
        "checks": check.checks,
        "tolerance": tolerance,
        "ok": check.worst_rel <= tolerance and check.checks >= len(sizes),
    }


__all__ = ["HFDecode", "ORDERS", "STRATEGIES", "build_hf_decoder", "hf_config", "run_hf_case"]
