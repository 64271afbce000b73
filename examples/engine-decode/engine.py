"""A decode loop written the way serving engines write theirs, captured into graphs through hal.

The model is a small Llama/Qwen3-shaped decoder with random weights
(RMSNorm, rotary positions, grouped-query attention with q/k norms, a
SiLU-gated MLP, tied embeddings). Its keys and values live in a **paged KV
cache**: per layer ``[num_blocks, block_size, kv_heads, head_dim]``; each
sequence owns blocks listed in its row of the **block table**, the **slot
mapping** says where each new token's k/v go, and **context lengths** mask
attention. Attention gathers a sequence's blocks with plain torch ops: no
host synchronisation and no data-dependent shape, so a decode step can be
captured.

The engine owns its capture loop (nano-vllm's ``capture_cudagraph``,
SGLang's ``CudaGraphRunner``): static input buffers sized for the largest
batch, and for each batch size a warm-up, a capture into the engine's own
shared pool, and the outputs kept. Adopting graphkit takes no change
(``with graphkit.graph_memory(be): engine.capture_graphs(sizes)``) or one
(``Engine(..., pools=graphkit.GraphPools(be))``: ``pool=pools.pool(bs)``).

``pieces=N`` captures each batch as N graphs over consecutive layers, as
vLLM's and SGLang's piecewise modes do: each piece reads the residual stream
that the previous piece's graph left in its own memory. Inside
``graph_memory`` the pieces of one batch must share one space: give the
engine ``group=pools.group`` (the one line), or graphkit refuses the second
piece's capture (``graphkit.IsolationError``) instead of letting it replay
wrong results.

``kv="elastic"`` reserves the KV cache as :class:`graphkit.ElasticBuffer`
ranges at their maximum (one per layer's K and V) with only the scratch block
mapped; the graphs are captured against views over the whole ranges (block
tables name only mapped blocks); :meth:`Engine.grow_kv` then maps what the
device has left after capture, less a margin, in whole blocks: the KV cache is
sized from the graph memory as it is, not from an estimate made before.

    python examples/engine-decode/engine.py --backend fake --mode {own,scope,pools} --order descending
    python examples/engine-decode/engine.py --backend fake --mode scope --pieces 2 [--group]
    python examples/engine-decode/engine.py --backend fake --mode scope --kv elastic --kv-margin-mib 4
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import math
import random
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, fields
from typing import Any, Literal

import torch
import torch.nn.functional as F

import graphkit
import hal
from graphkit.graphs.capture import release_cached_memory, weak_alias
from hal.registry import select_backend_name
from hal.types import fmt_bytes, round_up

log = logging.getLogger("engine_decode")

Order = Literal["descending", "ascending", "random"]
KV = Literal["static", "elastic"]
FAKE_CAPACITY = 64 << 20  # the fake device's memory when the KV cache grows into what is left


@dataclass(frozen=True)
class ModelConfig:
    """Sizes of the decoder; the defaults are shaped like Qwen3-0.6B."""

    hidden: int = 1024
    layers: int = 28
    heads: int = 16
    kv_heads: int = 8
    head_dim: int = 128
    mlp: int = 3072
    vocab: int = 151936
    dtype: str = "bfloat16"
    rope_theta: float = 1e6
    eps: float = 1e-6

    @classmethod
    def tiny(cls) -> ModelConfig:
        """Small enough for a 2-core CPU in well under a second per capture."""
        return cls(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, mlp=128, vocab=512, dtype="float32")

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


CONFIGS = {"reference": ModelConfig(), "tiny": ModelConfig.tiny()}


@dataclass
class DecodeBatch:
    """The inputs of one decode step, one row per sequence (all on the device)."""

    input_ids: torch.Tensor  # [n] the newest token of each sequence
    positions: torch.Tensor  # [n] its position
    slot_mapping: torch.Tensor  # [n] cache slot (block * block_size + offset) its k/v go to
    context_lens: torch.Tensor  # [n] tokens to attend to, the new one included
    block_tables: torch.Tensor  # [n, max_blocks_per_seq] blocks of each sequence, padded

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def items(self) -> list[tuple[str, torch.Tensor]]:
        return [(f.name, getattr(self, f.name)) for f in fields(self)]


@dataclass
class Generation:
    """What :meth:`Engine.generate` produced: new tokens per sequence and the logits of every step."""

    tokens: list[list[int]]
    logits: list[torch.Tensor] = field(default_factory=list)  # one [n, vocab] tensor per step


class Engine:
    """Weights, a paged KV cache, static buffers and graphs of decode steps for several batch sizes.

    :param backend: where to run (``hal.get_backend()``).
    :param config: ``"tiny"``, ``"reference"`` or a :class:`ModelConfig`.
    :param max_batch: sequences per step at most; the static buffers are this large.
    :param max_model_len: tokens per sequence at most (prompt and generated).
    :param pools: capture batch ``bs`` into ``pools.pool(bs)`` instead of the engine's own pool.
    :param keep_outputs: ``"strong"`` keeps every graph's output tensor (nano-vllm, SGLang);
        ``"weak"`` keeps a non-owning alias (vLLM), so later captures may reuse its memory.
    :param use_torch_api: capture with ``torch.cuda.CUDAGraph`` / ``torch.cuda.graph`` directly (CUDA only).
    :param pieces: 0 captures one graph per batch size; ``N`` captures N graphs over consecutive layers,
        each reading the previous one's output (the residual stream) directly.
    :param group: around the capture of one batch's pieces, ``group(bs)`` (``pools.group`` inside
        ``graphkit.graph_memory``: the pieces share one space).
    :param kv: ``"static"``: the KV cache allocated whole (``max_batch`` sequences of ``max_model_len``);
        ``"elastic"``: reserved as elastic ranges of ``kv_max_blocks`` blocks with only the scratch block
        mapped, grown later with :meth:`resize_kv` or :meth:`grow_kv`.
    :param kv_max_blocks: the elastic cache's reservation in blocks (default: what the device's whole
        memory would hold).
    :param memory: ``memory(part)`` is entered around the allocation of ``"weights"`` and of the static
        ``"kv_cache"`` (e.g. ``lambda part: saver.region(part, backup=part == "weights")``).
    """

    def __init__(self, backend: hal.Backend, config: str | ModelConfig = "tiny", *, max_batch: int = 16,
                 max_model_len: int = 64, block_size: int = 16, seed: int = 0,
                 pools: graphkit.GraphPools | None = None, keep_outputs: Literal["strong", "weak"] = "strong",
                 use_torch_api: bool = False, pieces: int = 0,
                 group: Callable[[int], AbstractContextManager[Any]] | None = None, kv: KV = "static",
                 kv_max_blocks: int | None = None,
                 memory: Callable[[str], AbstractContextManager[Any]] | None = None) -> None:
        self.backend = be = backend
        self.cfg = cfg = CONFIGS[config] if isinstance(config, str) else config
        self.device = be.torch_device()
        if use_torch_api and self.device.type != "cuda":
            raise hal.UnsupportedError("use_torch_api=True captures with torch.cuda.graph; this backend's "
                                       f"device is {self.device.type}", backend=be.name, call="Engine")
        if keep_outputs not in ("strong", "weak"):
            raise hal.InvalidArgumentError(f"keep_outputs={keep_outputs!r} must be strong or weak", call="Engine")
        self.max_batch, self.max_model_len, self.block_size = max_batch, max_model_len, block_size
        self.pools, self.keep_outputs, self.use_torch_api = pools, keep_outputs, use_torch_api
        if not isinstance(pieces, int) or not 0 <= pieces <= cfg.layers:
            raise hal.InvalidArgumentError(f"pieces={pieces!r} must be an int in 0..{cfg.layers} (the layers)",
                                           call="Engine")
        self.pieces, self.group = pieces, group
        if kv not in ("static", "elastic"):
            raise hal.InvalidArgumentError(f"kv={kv!r} must be static or elastic", backend=be.name, call="Engine")
        self.kv = kv
        memory = memory or (lambda part: contextlib.nullcontext())
        # piece k runs layers bounds[k]..bounds[k+1]
        self.bounds = [round(k * cfg.layers / max(pieces, 1)) for k in range(max(pieces, 1) + 1)]
        with memory("weights"):
            self._init_weights(seed)
        # paged KV cache: every sequence can hold max_model_len tokens; the scratch block is the one that
        # padded rows read and write, so they never touch a live sequence
        self.max_blocks_per_seq = math.ceil(max_model_len / block_size)
        self.kv_reservation: graphkit.ElasticReservation | None = None
        self.kv_buffers: list[graphkit.ElasticBuffer] = []
        if kv == "static":
            self.num_blocks = max_batch * self.max_blocks_per_seq + 1
            self.scratch_block = self.num_blocks - 1  # the last one
            shape = (self.num_blocks, block_size, cfg.kv_heads, cfg.head_dim)
            with memory("kv_cache"):
                self.k_cache = [torch.zeros(shape, device=self.device, dtype=cfg.torch_dtype)
                                for _ in range(cfg.layers)]
                self.v_cache = [torch.zeros(shape, device=self.device, dtype=cfg.torch_dtype)
                                for _ in range(cfg.layers)]
        else:
            self._reserve_kv(kv_max_blocks)
        self.token_index = torch.arange(self.max_blocks_per_seq * block_size, device=self.device)
        # static input buffers sized for the largest batch, filled with harmless padding
        self.padding = {"input_ids": 0, "positions": 0, "slot_mapping": self.scratch_block * block_size,
                        "context_lens": 1, "block_tables": self.scratch_block}
        shapes = {"block_tables": (max_batch, self.max_blocks_per_seq)}
        self.buffers = DecodeBatch(**{name: torch.full(shapes.get(name, (max_batch,)), value, dtype=torch.long,
                                                       device=self.device) for name, value in self.padding.items()})
        self.capture_stream = be.create_stream()
        self.graphs: dict[int, Any] = {}  # one graph per batch size, or the list of its pieces' graphs
        self.graph_outputs: dict[int, torch.Tensor] = {}
        self.piece_outputs: dict[int, list[torch.Tensor]] = {}  # what each piece hands the next one
        self.capture_seconds: dict[int, float] = {}
        self.graph_pool: Any = None  # the engine's own shared pool, created at the first capture

    # -- an elastic KV cache -----------------------------------------------------------------

    @property
    def kv_block_bytes(self) -> int:
        """Bytes of one block of one layer's K (or V)."""
        cfg = self.cfg
        return self.block_size * cfg.kv_heads * cfg.head_dim * torch.empty((), dtype=cfg.torch_dtype).element_size()

    @property
    def kv_bytes(self) -> int:
        """Bytes of the usable KV cache: every layer's K and V over the blocks that can be used."""
        return 2 * self.cfg.layers * self.num_blocks * self.kv_block_bytes

    def _reserve_kv(self, max_blocks: int | None) -> None:
        be, cfg, g = self.backend, self.cfg, self.backend.granularity
        per_block = 2 * cfg.layers * self.kv_block_bytes
        if max_blocks is None:
            max_blocks = max(2, be.mem_info().total // per_block)
        if not isinstance(max_blocks, int) or isinstance(max_blocks, bool) or max_blocks < 2:
            raise hal.InvalidArgumentError(f"kv_max_blocks={max_blocks!r} must be an int >= 2 (the scratch block "
                                           "and one more)", backend=be.name, call="Engine")
        self.kv_max_blocks = max_blocks
        range_bytes = max_blocks * self.kv_block_bytes
        self.kv_reservation = graphkit.ElasticReservation(be, reserve_bytes=2 * cfg.layers * round_up(range_bytes, g))
        self.kv_buffers = [self.kv_reservation.buffer(range_bytes) for _ in range(2 * cfg.layers)]
        # the views span the whole reservation; the block tables only ever name mapped blocks
        shape = (max_blocks, self.block_size, cfg.kv_heads, cfg.head_dim)
        views = [b.view(cfg.torch_dtype, shape, whole_range=True) for b in self.kv_buffers]
        self.k_cache, self.v_cache = views[:cfg.layers], views[cfg.layers:]
        self.scratch_block = 0  # the first block: mapped from the start
        self.num_blocks = 0
        self.resize_kv(1)

    def resize_kv(self, blocks: int) -> int:
        """Map the elastic KV cache's first ``blocks`` blocks (at least the scratch block), zero the new ones;
        return the blocks now usable (whole granules are mapped: a few more may fit)."""
        be = self.backend
        if self.kv != "elastic":
            raise hal.InvalidStateError("resize_kv needs kv='elastic'", backend=be.name, call="Engine.resize_kv")
        if not isinstance(blocks, int) or isinstance(blocks, bool) or not 1 <= blocks <= self.kv_max_blocks:
            raise hal.InvalidArgumentError(f"blocks={blocks!r} must be an int in 1..{self.kv_max_blocks}",
                                           backend=be.name, call="Engine.resize_kv")
        for buf in self.kv_buffers:
            buf.resize(blocks * self.kv_block_bytes)
        usable = min(self.kv_max_blocks, self.kv_buffers[0].mapped_bytes // self.kv_block_bytes)
        for cache in (*self.k_cache, *self.v_cache):
            cache[self.num_blocks:usable].zero_()  # fresh memory holds anything: padded reads must see zeros
        self.num_blocks = usable
        return usable

    def kv_blocks_for(self, free_bytes: int, margin_bytes: int = 0) -> int:
        """The blocks the elastic KV cache can hold with ``free_bytes`` more device memory, ``margin_bytes``
        left alone: whole granules per range, rounded down to whole blocks."""
        g, ranges = self.backend.granularity, len(self.kv_buffers)
        granules = self.kv_buffers[0].mapped_bytes // g + max(0, free_bytes - margin_bytes) // (ranges * g)
        return max(1, min(self.kv_max_blocks, granules * g // self.kv_block_bytes))

    def grow_kv(self, margin_bytes: int = 0) -> int:
        """Grow the elastic KV cache to the device memory left now (after capture) less ``margin_bytes``;
        return the blocks usable. Exact: the driver's free memory, not an estimate."""
        if self.kv != "elastic":
            raise hal.InvalidStateError("grow_kv needs kv='elastic'", backend=self.backend.name,
                                        call="Engine.grow_kv")
        release_cached_memory(self.backend)
        self.backend.synchronize()
        return self.resize_kv(self.kv_blocks_for(self.backend.mem_info().free, margin_bytes))

    # -- the model -----------------------------------------------------------------------

    def _init_weights(self, seed: int) -> None:
        cfg, dt = self.cfg, self.cfg.torch_dtype
        gen = torch.Generator(device=self.device).manual_seed(seed)

        def w(*shape: int) -> torch.Tensor:
            return (torch.randn(*shape, generator=gen, device=self.device) / shape[-1] ** 0.5).to(dt)

        def ones(n: int) -> torch.Tensor:
            return torch.ones(n, device=self.device, dtype=dt)

        q, kv = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
        self.embed = w(cfg.vocab, cfg.hidden)  # tied with the output head, as in Qwen3-0.6B
        self.layers = [{"input_norm": ones(cfg.hidden), "qkv": w(q + 2 * kv, cfg.hidden),
                        "q_norm": ones(cfg.head_dim), "k_norm": ones(cfg.head_dim), "o": w(cfg.hidden, q),
                        "post_norm": ones(cfg.hidden), "gate_up": w(2 * cfg.mlp, cfg.hidden),
                        "down": w(cfg.hidden, cfg.mlp)} for _ in range(cfg.layers)]
        self.norm = ones(cfg.hidden)
        inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim)
        angles = torch.outer(torch.arange(self.max_model_len, dtype=torch.float32), inv_freq)
        angles = torch.cat((angles, angles), dim=-1).to(self.device)
        self.cos, self.sin = angles.cos().to(dt), angles.sin().to(dt)

    def _rotary(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin

    def _attention(self, q: torch.Tensor, layer: int, context_lens: torch.Tensor,
                   block_tables: torch.Tensor) -> torch.Tensor:
        """Decode attention over the paged cache: gather each sequence's blocks, mask past its length."""
        cfg = self.cfg
        n, group = q.shape[0], cfg.heads // cfg.kv_heads
        keys = self.k_cache[layer][block_tables].flatten(1, 2)  # [n, max_tokens, kv_heads, head_dim]
        values = self.v_cache[layer][block_tables].flatten(1, 2)
        q = q.view(n, cfg.kv_heads, group, cfg.head_dim)
        scores = torch.einsum("nkgd,ntkd->nkgt", q, keys) * cfg.head_dim ** -0.5
        visible = self.token_index[None, :] < context_lens[:, None]  # [n, max_tokens]
        scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
        probs = scores.softmax(dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.einsum("nkgt,ntkd->nkgd", probs, values).reshape(n, cfg.heads * cfg.head_dim)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                context_lens: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
        """One decode step: write each sequence's new k/v into its slot, return the logits ``[n, vocab]``."""
        h = self._layers(F.embedding(input_ids, self.embed), 0, self.cfg.layers, positions, slot_mapping,
                         context_lens, block_tables)
        return self._head(h)

    def forward_piece(self, k: int, h: torch.Tensor | None, input_ids: torch.Tensor, positions: torch.Tensor,
                      slot_mapping: torch.Tensor, context_lens: torch.Tensor,
                      block_tables: torch.Tensor) -> torch.Tensor:
        """Piece ``k`` of the step: its layers over the residual stream ``h`` (the embedding for piece 0);
        the last piece returns the logits."""
        if k == 0:
            h = F.embedding(input_ids, self.embed)
        assert h is not None
        h = self._layers(h, self.bounds[k], self.bounds[k + 1], positions, slot_mapping, context_lens, block_tables)
        return self._head(h) if k == len(self.bounds) - 2 else h

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(F.rms_norm(h, (self.cfg.hidden,), self.norm, self.cfg.eps), self.embed)

    def _layers(self, h: torch.Tensor, start: int, stop: int, positions: torch.Tensor, slot_mapping: torch.Tensor,
                context_lens: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        n = h.shape[0]
        q_size, kv_size = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
        for i in range(start, stop):
            p = self.layers[i]
            x = F.rms_norm(h, (cfg.hidden,), p["input_norm"], cfg.eps)
            q, k, v = F.linear(x, p["qkv"]).split([q_size, kv_size, kv_size], dim=-1)
            q = F.rms_norm(q.view(n, cfg.heads, cfg.head_dim), (cfg.head_dim,), p["q_norm"], cfg.eps)
            k = F.rms_norm(k.view(n, cfg.kv_heads, cfg.head_dim), (cfg.head_dim,), p["k_norm"], cfg.eps)
            q, k = self._rotary(q, positions), self._rotary(k, positions)
            self.k_cache[i].view(-1, cfg.kv_heads, cfg.head_dim).index_copy_(0, slot_mapping, k)
            self.v_cache[i].view(-1, cfg.kv_heads, cfg.head_dim).index_copy_(
                0, slot_mapping, v.view(n, cfg.kv_heads, cfg.head_dim))
            h = h + F.linear(self._attention(q, i, context_lens, block_tables), p["o"])
            x = F.rms_norm(h, (cfg.hidden,), p["post_norm"], cfg.eps)
            gate, up = F.linear(x, p["gate_up"]).chunk(2, dim=-1)
            h = h + F.linear(F.silu(gate) * up, p["down"])
        return h

    # -- capture ---------------------------------------------------------------------------

    def static_inputs(self, bs: int) -> dict[str, torch.Tensor]:
        """The first ``bs`` rows of every static input buffer (what a graph of size ``bs`` reads)."""
        return {name: buf[:bs] for name, buf in self.buffers.items()}

    @property
    def graph_pool_id(self) -> tuple[int, int]:
        """The id of the engine's own pool, what ``torch.cuda.graph(pool=...)`` takes (``graph_pool_handle()``)."""
        if self.graph_pool is None:
            self.graph_pool = self.backend.create_pool()
        return tuple(self.graph_pool.id)

    def _pool_for(self, bs: int) -> Any:
        if self.pools is not None:
            return self.pools.pool(bs)  # the one-line change: a graphkit pool per batch size
        if self.use_torch_api:
            return self.graph_pool_id
        if self.graph_pool is None:
            self.graph_pool = self.backend.create_pool()
        return self.graph_pool

    @torch.no_grad()
    def capture_graph(self, bs: int) -> float:
        """Warm up and capture the decode step for batch ``bs``; return the capture's seconds."""
        if not 0 < bs <= self.max_batch:
            raise hal.InvalidArgumentError(f"batch size {bs} is not in 1..{self.max_batch}", call="capture_graph")
        be, inputs = self.backend, self.static_inputs(bs)
        be.synchronize()  # the side stream must see the buffers and cache as the default stream left them
        with be.use_stream(self.capture_stream):  # lazily made state is born outside the capture
            self.forward(**inputs)
        be.synchronize(self.capture_stream)
        t0 = time.perf_counter()  # getting the pool counts: graph_memory makes its space inside the capture
        if self.pieces:
            graphs: list[Any] = []
            self.graphs[bs], self.piece_outputs[bs] = graphs, []
            with self.group(bs) if self.group is not None else contextlib.nullcontext():
                h = None
                for k in range(self.pieces):
                    graph, h = self._capture_one(bs, lambda h=h, k=k: self.forward_piece(k, h, **inputs))
                    graphs.append(graph)
                    self.piece_outputs[bs].append(h)
            out = h
        else:
            self.graphs[bs], out = self._capture_one(bs, lambda: self.forward(**inputs))
        be.synchronize()
        seconds = self.capture_seconds[bs] = time.perf_counter() - t0
        self.graph_outputs[bs] = weak_alias(out) if self.keep_outputs == "weak" else out
        log.debug("captured batch %d in %.3f s", bs, seconds)
        return seconds

    def _capture_one(self, bs: int, run: Callable[[], torch.Tensor]) -> tuple[Any, torch.Tensor]:
        """One graph of batch ``bs``: ``run()`` captured into the engine's pool (or graphkit's)."""
        be, pool = self.backend, self._pool_for(bs)
        if self.use_torch_api:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=self.capture_stream):
                out = run()
            return graph, out
        graph = be.create_graph()
        try:
            with be.capture(graph, pool=pool, stream=self.capture_stream):
                out = run()
        except BaseException:
            be.release_graph(graph)
            raise
        return graph, out

    def capture_graphs(self, sizes: Sequence[int], order: Order = "descending", seed: int = 0) -> float:
        """Capture every size of ``sizes`` in ``order``; return the total capture seconds."""
        ordered = sorted(set(sizes), reverse=order == "descending")
        if order == "random":
            random.Random(seed).shuffle(ordered)
        elif order not in ("descending", "ascending"):
            raise hal.InvalidArgumentError(f"order={order!r} must be descending, ascending or random",
                                           call="capture_graphs")
        return sum(self.capture_graph(bs) for bs in ordered)

    def reset_graphs(self) -> None:
        """Drop every graph and output, then the engine's own pool."""
        self.backend.synchronize()
        self.graph_outputs.clear()
        self.piece_outputs.clear()
        for graph in self._each_graph():
            graph.reset() if self.use_torch_api else self.backend.release_graph(graph)
        self.graphs.clear()
        if self.graph_pool is not None:
            self.backend.release_pool(self.graph_pool)
            self.graph_pool = None

    def close(self) -> None:
        """Release what the engine holds on the device through hal (graphs, its pool, an elastic KV cache);
        idempotent."""
        self.reset_graphs()
        if self.kv_reservation is not None:
            self.k_cache, self.v_cache = [], []
            gc.collect()  # views caught in reference cycles must go before their buffers close
            self.kv_reservation.close()
            self.kv_reservation, self.kv_buffers = None, []

    def _each_graph(self) -> list[Any]:
        return [g for value in self.graphs.values() for g in (value if isinstance(value, list) else [value])]

    # -- decoding --------------------------------------------------------------------------

    def graph_size_for(self, n: int) -> int | None:
        """The smallest captured batch size that holds ``n`` sequences (None: run eagerly)."""
        return min((bs for bs in self.graphs if bs >= n), default=None)

    @torch.no_grad()
    def eager_step(self, batch: DecodeBatch) -> torch.Tensor:
        return self.forward(**dict(batch.items()))

    @torch.no_grad()
    def step(self, batch: DecodeBatch, replay: bool = True) -> torch.Tensor:
        """Logits ``[n, vocab]`` of one decode step: a graph replay where one fits, else eager.

        A replayed graph's logits are valid until the next replay. With
        ``replay=False`` the step runs eagerly on exactly what the graph
        would read (the static buffers, padded to the graph's batch size).
        """
        n = len(batch)
        bs = self.graph_size_for(n)
        if bs is None:
            return self.eager_step(batch)
        for name, buf in self.buffers.items():
            buf[:n].copy_(getattr(batch, name))
            buf[n:bs].fill_(self.padding[name])
        if not replay:
            return self.forward(**self.static_inputs(bs))[:n]
        value = self.graphs[bs]
        for graph in value if isinstance(value, list) else [value]:
            graph.replay() if self.use_torch_api else self.backend.replay(graph)
        return self.graph_outputs[bs][:n]

    def block_tables_for(self, n: int, tokens: int, seed: int = 0) -> torch.Tensor:
        """Give ``n`` sequences blocks for ``tokens`` tokens each, scattered over the cache (a seeded shuffle)."""
        if n > self.max_batch or tokens > self.max_model_len:
            raise hal.InvalidArgumentError(f"{n} sequences of {tokens} tokens exceed the cache "
                                           f"({self.max_batch} of {self.max_model_len})", call="block_tables_for")
        free = [b for b in range(self.num_blocks) if b != self.scratch_block]
        random.Random(seed).shuffle(free)
        need = math.ceil(tokens / self.block_size)
        if n * need > len(free):
            raise hal.InvalidArgumentError(f"{n} sequences of {tokens} tokens need {n * need} blocks; the KV cache "
                                           f"has {len(free)} (grow it first)", backend=self.backend.name,
                                           call="block_tables_for")
        table = torch.full((n, self.max_blocks_per_seq), self.scratch_block, dtype=torch.long)
        for i in range(n):
            table[i, :need] = torch.tensor(free[i * need:(i + 1) * need])
        return table.to(self.device)

    def decode_batch(self, input_ids: torch.Tensor, positions: torch.Tensor,
                     block_tables: torch.Tensor) -> DecodeBatch:
        """The step inputs for new tokens at ``positions`` of sequences owning ``block_tables``."""
        blocks = block_tables.gather(1, (positions // self.block_size)[:, None]).squeeze(1)
        return DecodeBatch(input_ids, positions, blocks * self.block_size + positions % self.block_size,
                           positions + 1, block_tables)

    def example_batch(self, n: int, seed: int = 0) -> DecodeBatch:
        """``n`` sequences at random positions with random new tokens (for timing)."""
        gen = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, self.cfg.vocab, (n,), generator=gen).to(self.device)
        positions = torch.randint(0, self.max_model_len, (n,), generator=gen).to(self.device)
        return self.decode_batch(ids, positions, self.block_tables_for(n, self.max_model_len, seed))

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], steps: int, use_graphs: bool = True,
                 keep_logits: bool = True, padded: bool = False) -> Generation:
        """Greedy decoding of ``steps`` new tokens for every prompt, all sequences in one batch.

        The prompts go through the decode step one token per step (prefill
        token by token): step ``t`` feeds token ``t`` of every sequence (its
        prompt's, or the one generated before) and, once past the prompt,
        appends the argmax of its logits. ``use_graphs=False`` decodes
        eagerly, on the batch as it is or, with ``padded``, padded as the
        graph would see it (the same shapes, so the same rounding in bf16).
        """
        n, lengths = len(prompts), [len(p) for p in prompts]
        if not n or min(lengths) == 0 or steps <= 0:
            raise hal.InvalidArgumentError("need at least one non-empty prompt and steps > 0", call="generate")
        seqs = [list(p) for p in prompts]
        total = max(lengths) + steps
        tables = self.block_tables_for(n, total)
        logits_seen = []
        for t in range(total - 1):
            ids = torch.tensor([s[t] for s in seqs], device=self.device)
            batch = self.decode_batch(ids, torch.full((n,), t, device=self.device), tables)
            logits = self.step(batch, replay=use_graphs) if use_graphs or padded else self.eager_step(batch)
            if keep_logits:
                logits_seen.append(logits.clone())
            for s, token, length in zip(seqs, logits.argmax(dim=-1).tolist(), lengths, strict=True):
                if t + 1 >= length:
                    s.append(token)
        return Generation([s[length:length + steps] for s, length in zip(seqs, lengths, strict=True)], logits_seen)


# -- command line ------------------------------------------------------------------------------


def _used(be: hal.Backend) -> int:
    release_cached_memory(be)
    be.synchronize()
    return be.mem_info().used


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default=None, help="hal backend (default: the best available)")
    parser.add_argument("--mode", choices=("own", "scope", "pools"), default="own",
                        help="own: the engine's shared pool; scope: graphkit.graph_memory around the capture "
                             "loop; pools: Engine(pools=GraphPools(be))")
    parser.add_argument("--order", choices=("descending", "ascending", "random"), default="descending")
    parser.add_argument("--config", choices=sorted(CONFIGS), default=None,
                        help="model sizes (default: reference on a GPU, tiny otherwise)")
    parser.add_argument("--sizes", default=None, help="comma-separated batch sizes to capture")
    parser.add_argument("--keep-outputs", choices=("strong", "weak"), default="strong")
    parser.add_argument("--torch-api", action="store_true", help="capture with torch.cuda.graph (CUDA only)")
    parser.add_argument("--pieces", type=int, default=0,
                        help="capture each batch as this many graphs over consecutive layers (0: one graph)")
    parser.add_argument("--group", action="store_true",
                        help="with --mode scope and --pieces: capture the pieces of a batch in pools.group(bs)")
    parser.add_argument("--kv", choices=("static", "elastic"), default="static",
                        help="elastic: reserve the KV cache, capture, then grow it to the memory left")
    parser.add_argument("--kv-margin-mib", type=float, default=None,
                        help="with --kv elastic: device memory left alone when the cache grows after capture "
                             "(default: 1024 MiB on a GPU, 1 MiB otherwise)")
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")

    name = select_backend_name(args.backend, requires=("graphs",))
    fake = {"granularity": 1 << 16}  # small chunks on fake; a small device for a KV cache that takes what is left
    if args.kv == "elastic":
        fake["capacity"] = FAKE_CAPACITY
    be = hal.get_backend(name, **(fake if name == "fake" else {}))
    try:
        return _run(be, args)
    except hal.HalError as exc:
        print(f"error: {exc}")
        return 2
    finally:
        be.close()


def _run(be: hal.Backend, args: argparse.Namespace) -> int:
    config = args.config or ("reference" if be.torch_device().type == "cuda" else "tiny")
    default_sizes = [1, 2, 4, *range(8, 257, 8)] if config == "reference" else [1, 2, 4, 8, 16]
    sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else default_sizes
    pools = graphkit.GraphPools(be) if args.mode in ("pools", "scope") else None
    engine = Engine(be, config, max_batch=max(sizes), max_model_len=128 if config == "reference" else 64,
                    pools=pools if args.mode == "pools" else None, keep_outputs=args.keep_outputs,
                    use_torch_api=args.torch_api, pieces=args.pieces,
                    group=pools.group if args.group and pools is not None else None, kv=args.kv)
    try:
        before = _used(be)
        if args.mode == "scope":
            with graphkit.graph_memory(be, pools=pools):  # no line of the engine changes
                seconds = engine.capture_graphs(sizes, args.order)
        else:
            seconds = engine.capture_graphs(sizes, args.order)
        growth = _used(be) - before
        if args.kv == "elastic":  # sized now, from what capture left: no estimate
            default_margin = 1024 if be.torch_device().type == "cuda" else 1
            margin = int((args.kv_margin_mib if args.kv_margin_mib is not None else default_margin) * 2**20)
            engine.grow_kv(margin)
            print(f"KV cache grown after capture to {engine.num_blocks} blocks ({fmt_bytes(engine.kv_bytes)}), "
                  f"{fmt_bytes(be.mem_info().free)} left (margin {fmt_bytes(margin)})")
        prompts = [[(7 * i + j) % engine.cfg.vocab for j in range(2 + i % 3)] for i in range(3)]
        out = engine.generate(prompts, args.steps, keep_logits=False)
        eager = engine.generate(prompts, args.steps, use_graphs=False, keep_logits=False)
        print(f"mode {args.mode}, order {args.order}, config {config} ({engine.cfg.dtype}), "
              f"{len(sizes)} sizes up to {max(sizes)}")
        print(f"tokens (graphs): {out.tokens}")
        print(f"tokens (eager):  {eager.tokens}  {'equal' if out.tokens == eager.tokens else 'DIFFERENT'}")
        print(f"capture: {seconds:.3f} s; device memory +{growth / 2**20:.1f} MiB")
        if pools is not None:
            print(pools.report())
    finally:
        engine.close()  # graphs first, then the pools they drew from
        if pools is not None:
            pools.close()
    return 0 if out.tokens == eager.tokens else 1

if __name__ == "__main__":
    raise SystemExit(main())
