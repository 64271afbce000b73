"""A decode loop whose KV cache grows with the load, under three cache strategies side by side.

Requests arrive while others decode and every sequence grows by one token
a step, so the paged KV cache needs more blocks as the run goes on. The
same decoder (Llama/Qwen3-shaped, random weights from a seed) runs the
same requests with three ways of holding the cache:

* ``elastic``: :class:`graphkit.ElasticBuffer` ranges (one per layer's K
  and V, vAttention style, carved from one :class:`graphkit.ElasticReservation`,
  so each layer's K and V stay contiguous) resized to the blocks in use.
  The attention reads the cache through a block table over
  ``view(..., whole_range=True)``: the address never moves and growth maps
  granules at the end of the range, copying nothing.
* ``prealloc``: the cache allocated at its maximum up front, as engines do.
* ``regrow``: allocate-and-copy; when more blocks are needed, a tensor twice
  as large is allocated and the old cache copied into it.

Per strategy: peak device memory (the driver's ``mem_info().used`` growth;
on ``fake`` the fake device's used memory), physical bytes against bytes in
use at every step, the median step time, bytes copied on growth, and how
often the cache's address moved. The decoded tokens and logits must be
equal (bit-exact) across strategies.

The strategies alternate: ``alternations`` rounds, each running every
strategy once in an order rotated from round to round (whichever runs first
in a process pays costs that are not its own); the step time is the median
of the rounds' medians with their range.

    python examples/elastic-kv/elastic_kv.py --backend fake --steps 64
    python examples/elastic-kv/elastic_kv.py --backend cuda --config reference --alternations 5
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import graphkit
import hal
from graphkit.graphs.capture import release_cached_memory
from graphkit_bench.elastic import CopyCounter, device_empty
from graphkit_bench.fair import fmt_spread, rotated, spread
from hal.registry import select_backend_name
from hal.types import fmt_bytes, round_up

STRATEGIES = ("elastic", "prealloc", "regrow")
#: strategies that take the elastic cache's gap to the preallocated one apart (not run unless asked for):
#: ``elastic-premapped`` is the elastic cache mapped to its maximum before the first step (its memory read the
#: same way, no growth during the run); ``prealloc-viewed`` is the preallocated memory read through tensors made
#: the way elastic views are (``Backend.tensor_at``), not through the framework's own
DIAGNOSTIC = ("elastic-premapped", "prealloc-viewed")
FAKE_GRANULARITY = 16 << 10  # small granules on fake, so a tiny cache spans several
STEP_TOLERANCE = 0.02  # the elastic cache's decode step within this share of the preallocated cache's
KEEP_LOGITS_LIMIT = 64 << 20  # keep every step's logits on the host up to this many bytes, else digests only
#: parts of a step, each the median over the steps of a run: the growth (host), issuing the forward (host), and
#: running it (the device's own time, CUDA events; None elsewhere)
PHASES = {"grow_ms": "grow_ms_median", "issue_ms": "issue_ms_median", "device_ms": "device_ms_median"}


# -- the model ---------------------------------------------------------------------------------


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
        return cls(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, mlp=128, vocab=512, dtype="float32")

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


@dataclass(frozen=True)
class Workload:
    """How the load grows: request ``i`` arrives at step ``i * arrive_every`` (up to ``max_batch``)."""

    steps: int = 64
    max_batch: int = 16
    max_model_len: int = 128
    block_size: int = 16
    arrive_every: int = 2
    seed: int = 0

    @property
    def max_blocks(self) -> int:
        """Blocks of a cache that holds every sequence at its longest, plus the scratch block."""
        return 1 + self.max_batch * math.ceil(self.max_model_len / self.block_size)


CONFIGS = {
    "tiny": (ModelConfig.tiny(), Workload()),
    "reference": (ModelConfig(), Workload(steps=512, max_batch=64, max_model_len=1024, arrive_every=4)),
}


class Model:
    """RMSNorm, rotary positions, grouped-query attention with q/k norms, a SiLU-gated MLP, tied embeddings."""

    def __init__(self, be: hal.Backend, cfg: ModelConfig, max_model_len: int, seed: int = 0) -> None:
        self.cfg, self.device = cfg, be.torch_device()
        dt = cfg.torch_dtype
        gen = torch.Generator(device=self.device).manual_seed(seed)

        def w(*shape: int) -> torch.Tensor:
            return (torch.randn(*shape, generator=gen, device=self.device) / shape[-1] ** 0.5).to(dt)

        def ones(n: int) -> torch.Tensor:
            return torch.ones(n, device=self.device, dtype=dt)

        q, kv = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
        self.embed = w(cfg.vocab, cfg.hidden)
        self.layers = [{"input_norm": ones(cfg.hidden), "qkv": w(q + 2 * kv, cfg.hidden),
                        "q_norm": ones(cfg.head_dim), "k_norm": ones(cfg.head_dim), "o": w(cfg.hidden, q),
                        "post_norm": ones(cfg.hidden), "gate_up": w(2 * cfg.mlp, cfg.hidden),
                        "down": w(cfg.hidden, cfg.mlp)} for _ in range(cfg.layers)]
        self.norm = ones(cfg.hidden)
        inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim)
        angles = torch.outer(torch.arange(max_model_len, dtype=torch.float32), inv_freq)
        angles = torch.cat((angles, angles), dim=-1).to(self.device)
        self.cos, self.sin = angles.cos().to(dt), angles.sin().to(dt)

    def _rotary(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin

    @torch.no_grad()
    def forward(self, cache: KVCache, input_ids: torch.Tensor, positions: torch.Tensor, slot_blocks: torch.Tensor,
                slot_offsets: torch.Tensor, context_lens: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
        """One decode step: write each new k/v at (block, offset) of the cache, attend through the block table."""
        cfg = self.cfg
        n, width = input_ids.shape[0], block_tables.shape[1]
        q_size, kv_size, group = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim, cfg.heads // cfg.kv_heads
        token_index = torch.arange(width * cache.block_size, device=self.device)
        visible = token_index[None, :] < context_lens[:, None]  # [n, tokens]
        h = F.embedding(input_ids, self.embed)
        for i, p in enumerate(self.layers):
            x = F.rms_norm(h, (cfg.hidden,), p["input_norm"], cfg.eps)
            q, k, v = F.linear(x, p["qkv"]).split([q_size, kv_size, kv_size], dim=-1)
            q = F.rms_norm(q.view(n, cfg.heads, cfg.head_dim), (cfg.head_dim,), p["q_norm"], cfg.eps)
            k = F.rms_norm(k.view(n, cfg.kv_heads, cfg.head_dim), (cfg.head_dim,), p["k_norm"], cfg.eps)
            q, k = self._rotary(q, positions), self._rotary(k, positions)
            k_cache, v_cache = cache.k[i], cache.v[i]  # [max_blocks, block_size, kv_heads, head_dim]
            k_cache[slot_blocks, slot_offsets] = k
            v_cache[slot_blocks, slot_offsets] = v.view(n, cfg.kv_heads, cfg.head_dim)
            keys = k_cache[block_tables].flatten(1, 2)  # reads only the blocks in the table: all mapped
            values = v_cache[block_tables].flatten(1, 2)
            scores = torch.einsum("nkgd,ntkd->nkgt", q.view(n, cfg.kv_heads, group, cfg.head_dim), keys)
            scores = (scores * cfg.head_dim ** -0.5).masked_fill(~visible[:, None, None, :], float("-inf"))
            probs = scores.softmax(dim=-1, dtype=torch.float32).to(q.dtype)
            attn = torch.einsum("nkgt,ntkd->nkgd", probs, values).reshape(n, q_size)
            h = h + F.linear(attn, p["o"])
            x = F.rms_norm(h, (cfg.hidden,), p["post_norm"], cfg.eps)
            gate, up = F.linear(x, p["gate_up"]).chunk(2, dim=-1)
            h = h + F.linear(F.silu(gate) * up, p["down"])
        return F.linear(F.rms_norm(h, (cfg.hidden,), self.norm, cfg.eps), self.embed)


# -- device memory and copies ----------------------------------------------------------------------


def _framework_idle(be: hal.Backend) -> int:
    """Bytes the framework's caching allocator holds from the device without a tensor in them."""
    dev = be.torch_device()
    module = getattr(torch, dev.type, None)
    if dev.type == "cpu" or not hasattr(module, "memory_reserved"):
        return 0
    return module.memory_reserved(dev) - module.memory_allocated(dev)


class Meter:
    """Device memory above a baseline, as the driver reports it; keeps the peak of every sample.

    ``peak`` is the driver's figure; ``peak_held`` leaves out what the framework's
    caching allocator holds idle (freed activations it keeps for reuse), which
    depends on the allocator's history more than on the strategy.
    """

    def __init__(self, be: hal.Backend) -> None:
        self.be = be
        be.synchronize()
        self.base = be.mem_info().used
        self.base_idle = _framework_idle(be)
        self.peak = 0
        self.peak_held = 0
        self.spent = 0.0

    def sample(self) -> int:
        t0 = time.perf_counter()
        used = self.be.mem_info().used - self.base
        self.peak = max(self.peak, used)
        self.peak_held = max(self.peak_held, used - (_framework_idle(self.be) - self.base_idle))
        self.spent += time.perf_counter() - t0  # left out of the step times
        return used


# -- the caches ------------------------------------------------------------------------------------


class KVCache:
    """Per layer ``k[i]``/``v[i]`` of shape ``[max_blocks, block_size, kv_heads, head_dim]``, growing on demand.

    Only ``[0, blocks)`` is in use (block 0 is the scratch block padded rows of the
    block table point at); :meth:`ensure` grows to hold more and zeroes the new blocks.
    """

    name = ""
    ranges = 0  # elastic ranges (the slack allowed is one granule per range)

    def __init__(self, be: hal.Backend, cfg: ModelConfig, wl: Workload, meter: Meter) -> None:
        self.be, self.cfg, self.meter = be, cfg, meter
        self.block_size, self.max_blocks = wl.block_size, wl.max_blocks
        self.block_shape = (wl.block_size, cfg.kv_heads, cfg.head_dim)
        self.itemsize = torch.empty((), dtype=cfg.torch_dtype).element_size()
        self.block_bytes = math.prod(self.block_shape) * self.itemsize  # one block of one layer's K (or V)
        self.blocks = 0
        self.copied_bytes = 0
        self.moves = 0
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []

    @property
    def used_bytes(self) -> int:
        """Bytes of the blocks in use, every layer's K and V."""
        return self.blocks * self.block_bytes * 2 * self.cfg.layers

    @property
    def physical_bytes(self) -> int:
        raise NotImplementedError

    def _addresses(self) -> tuple[int, ...]:
        return tuple(t.data_ptr() for t in (*self.k, *self.v))

    def ensure(self, blocks: int) -> None:
        if blocks <= self.blocks:
            return
        before = self._addresses()
        with CopyCounter() as copies:
            self._grow(blocks)
        self.copied_bytes += copies.bytes
        if before and self._addresses() != before:
            self.moves += 1
        for t in (*self.k, *self.v):
            t[self.blocks:blocks].zero_()  # the scratch block and fresh blocks read as zeros (masked anyway)
        self.blocks = blocks

    def _grow(self, blocks: int) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self.k, self.v = [], []


class ElasticCache(KVCache):
    """One elastic range per layer's K and per layer's V (``2 x layers``), carved from one reservation and resized to
    the blocks in use: every layer's K and V stays contiguous, as in a preallocated cache."""

    name = "elastic"

    def __init__(self, be: hal.Backend, cfg: ModelConfig, wl: Workload, meter: Meter, premapped: bool = False) -> None:
        super().__init__(be, cfg, wl, meter)
        g, L = be.granularity, cfg.layers
        range_bytes = self.max_blocks * self.block_bytes
        self.reservation = graphkit.ElasticReservation(be, reserve_bytes=2 * L * round_up(range_bytes, g))
        self.buffers = [self.reservation.buffer(range_bytes) for _ in range(2 * L)]
        if premapped:  # a diagnostic: the same memory, mapped to the maximum before the first step
            self.name = "elastic-premapped"
            for b in self.buffers:
                b.resize(range_bytes)
            meter.sample()
        views = [b.view(cfg.torch_dtype, (self.max_blocks, *self.block_shape), whole_range=True)
                 for b in self.buffers]
        self.k, self.v = views[:L], views[L:]
        self.row_bytes = self.block_bytes
        self.mapped_blocks = self.buffers[0].mapped_bytes // self.row_bytes  # every range is mapped alike

    @property
    def ranges(self) -> int:  # type: ignore[override]
        return len(self.buffers)

    @property
    def physical_bytes(self) -> int:
        return sum(b.mapped_bytes for b in self.buffers) + self.reservation.free_bytes

    def _grow(self, blocks: int) -> None:
        if blocks <= self.mapped_blocks:  # the granules mapped already hold them: no call at all
            return
        for buf in self.buffers:
            buf.resize(blocks * self.row_bytes)
        self.mapped_blocks = self.buffers[0].mapped_bytes // self.row_bytes
        self.meter.sample()  # it only ever grows: nothing transient to catch in between

    def close(self) -> None:
        super().close()
        self.reservation.close()


class PreallocCache(KVCache):
    """The whole cache allocated at its maximum before the first step."""

    name = "prealloc"

    def __init__(self, be: hal.Backend, cfg: ModelConfig, wl: Workload, meter: Meter) -> None:
        super().__init__(be, cfg, wl, meter)
        shape = (self.max_blocks, *self.block_shape)
        tensors = [device_empty(be, self.max_blocks * self.block_bytes).view(cfg.torch_dtype).view(shape)
                   for _ in range(2 * cfg.layers)]
        self.k, self.v = tensors[:cfg.layers], tensors[cfg.layers:]
        meter.sample()

    @property
    def physical_bytes(self) -> int:
        return 2 * self.cfg.layers * self.max_blocks * self.block_bytes

    def _grow(self, blocks: int) -> None:
        pass


class PreallocViewedCache(PreallocCache):
    """The preallocated cache read through tensors made as elastic views are (``Backend.tensor_at``): a diagnostic."""

    name = "prealloc-viewed"

    def __init__(self, be: hal.Backend, cfg: ModelConfig, wl: Workload, meter: Meter) -> None:
        super().__init__(be, cfg, wl, meter)
        shape = (self.max_blocks, *self.block_shape)
        nbytes = self.max_blocks * self.block_bytes
        self.k, self.v = ([be.tensor_at(t.data_ptr(), nbytes, owner=t).view(cfg.torch_dtype).view(shape) for t in ts]
                          for ts in (self.k, self.v))


class RegrowCache(KVCache):
    """Allocate-and-copy: when more blocks are needed, a tensor of twice the blocks, the old cache copied in."""

    name = "regrow"

    def __init__(self, be: hal.Backend, cfg: ModelConfig, wl: Workload, meter: Meter) -> None:
        super().__init__(be, cfg, wl, meter)
        self.capacity = 0

    @property
    def physical_bytes(self) -> int:
        return 2 * self.cfg.layers * self.capacity * self.block_bytes

    def _grow(self, blocks: int) -> None:
        if blocks <= self.capacity:
            return
        new_cap = min(max(blocks, 2 * self.capacity), self.max_blocks)
        shape = (new_cap, *self.block_shape)
        old_k, old_v = self.k, self.v
        self.k, self.v = [], []
        for olds, news in ((old_k, self.k), (old_v, self.v)):
            for i in range(self.cfg.layers):
                new = device_empty(self.be, new_cap * self.block_bytes).view(self.cfg.torch_dtype).view(shape)
                self.meter.sample()  # the old tensor of this layer is still alive: the transient peak
                if olds:
                    new[:self.capacity].copy_(olds[i])
                    olds[i] = None  # type: ignore[call-overload]
                news.append(new)
        del old_k, old_v
        release_cached_memory(self.be)
        self.capacity = new_cap


def make_cache(name: str, be: hal.Backend, cfg: ModelConfig, wl: Workload, meter: Meter) -> KVCache:
    if name in ("elastic", "elastic-premapped"):
        return ElasticCache(be, cfg, wl, meter, premapped=name == "elastic-premapped")
    if name == "prealloc":
        return PreallocCache(be, cfg, wl, meter)
    if name == "prealloc-viewed":
        return PreallocViewedCache(be, cfg, wl, meter)
    if name == "regrow":
        return RegrowCache(be, cfg, wl, meter)
    raise hal.InvalidArgumentError(f"strategy {name!r} must be one of {', '.join(STRATEGIES + DIAGNOSTIC)}",
                                   call="make_cache")


# -- the decode loop ---------------------------------------------------------------------------------


@dataclass
class Request:
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)  # prompt, then what was generated
    blocks: list[int] = field(default_factory=list)  # its row of the block table
    pos: int = 0  # tokens already in the cache


def prompts(wl: Workload, vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(wl.seed)
    return [torch.randint(0, vocab, (2 + i % 4,), generator=gen).tolist() for i in range(wl.max_batch)]


def _digest(logits: torch.Tensor, coef: list[torch.Tensor]) -> int:
    """A position-weighted sum of the logits' bits: equal digests for bit-equal logits."""
    bits = logits.float().contiguous().view(-1).view(torch.int32).to(torch.int64)
    if not coef or coef[0].numel() < bits.numel():  # one weight vector, grown to the largest batch seen
        coef[:] = [torch.arange(1, bits.numel() + 1, device=bits.device, dtype=torch.int64)]
    return int(bits.mul_(coef[0][:bits.numel()]).sum())


def decode(be: hal.Backend, model: Model, wl: Workload, strategy: str, keep_logits: bool = True) -> dict[str, Any]:
    """Run the workload with one cache strategy; return its figures, tokens and logits."""
    if wl.steps > wl.max_model_len:
        raise hal.InvalidArgumentError(f"steps={wl.steps} exceed max_model_len={wl.max_model_len}: the first "
                                       "request would outgrow its blocks", call="decode")
    release_cached_memory(be)
    coef = [torch.arange(1, wl.max_batch * model.cfg.vocab + 1, device=model.device, dtype=torch.int64)]
    meter = Meter(be)
    cache = make_cache(strategy, be, model.cfg, wl, meter)
    dev, bs = model.device, wl.block_size
    seqs: list[Request] = []
    next_block = 1  # block 0: the scratch block
    trace, step_s, grow_s, digests, logits_seen = [], [], [], [], []
    issue_s, device_ms = [], []  # the host's time to issue a step's forward; the device's time to run it
    events = DeviceEvents(dev)
    requests = prompts(wl, model.cfg.vocab)
    try:
        for t in range(wl.steps):
            if t % wl.arrive_every == 0 and len(seqs) < wl.max_batch:
                p = requests[len(seqs)]
                seqs.append(Request(prompt=p, tokens=list(p)))
            for s in seqs:  # the new token of every sequence needs a slot
                if s.pos % bs == 0:
                    s.blocks.append(next_block)
                    next_block += 1
            width = max(len(s.blocks) for s in seqs)
            table = torch.tensor([s.blocks + [0] * (width - len(s.blocks)) for s in seqs], dtype=torch.long)
            positions = torch.tensor([s.pos for s in seqs], dtype=torch.long)
            slot_blocks = table.gather(1, (positions // bs)[:, None]).squeeze(1)
            inputs = [torch.tensor([s.tokens[s.pos] for s in seqs]), positions, slot_blocks, positions % bs,
                      positions + 1, table]
            be.synchronize()
            spent = meter.spent
            t0 = time.perf_counter()
            cache.ensure(next_block)
            t1 = time.perf_counter()
            events.start()
            logits = model.forward(cache, *(x.to(dev, non_blocking=True) for x in inputs))
            events.end()
            issued = time.perf_counter()
            new_tokens = logits.argmax(dim=-1).tolist()
            be.synchronize()
            t2 = time.perf_counter()
            metering = meter.spent - spent  # samples taken inside a growth are not the strategy's time
            step_s.append(t2 - t0 - metering)
            grow_s.append(t1 - t0 - metering)
            issue_s.append(issued - t1)
            device_ms.append(events.elapsed_ms())
            digests.append(_digest(logits, coef))
            if keep_logits:
                logits_seen.append(logits.float().cpu())
            for s, token in zip(seqs, new_tokens, strict=True):
                s.pos += 1
                if s.pos >= len(s.tokens):
                    s.tokens.append(token)
            trace.append({"step": t, "sequences": len(seqs), "blocks": cache.blocks, "used": cache.used_bytes,
                          "physical": cache.physical_bytes, "device": meter.sample()})
        out = {"strategy": strategy, "ranges": cache.ranges, "granularity": be.granularity,
               "block_bytes": cache.block_bytes,
               "max_blocks": wl.max_blocks, "peak_device_bytes": meter.peak, "peak_held_bytes": meter.peak_held,
               "peak_physical_bytes": max(r["physical"] for r in trace),
               "final_used_bytes": trace[-1]["used"], "final_physical_bytes": trace[-1]["physical"],
               "max_slack_bytes": max(r["physical"] - r["used"] for r in trace),
               "copied_bytes": cache.copied_bytes, "moves": cache.moves,
               "step_ms_median": statistics.median(step_s) * 1e3, "step_ms_max": max(step_s) * 1e3,
               "grow_ms_total": sum(grow_s) * 1e3, "grow_ms_median": statistics.median(grow_s) * 1e3,
               "issue_ms_median": statistics.median(issue_s) * 1e3,
               "device_ms_median": statistics.median(device_ms) if events.on else None, "trace": trace,
               "tokens": [s.tokens[len(s.prompt):] for s in seqs], "digests": digests}
        out["logits"] = logits_seen if keep_logits else None
        return out
    finally:
        cache.close()
        del cache
        release_cached_memory(be)


class DeviceEvents:
    """The device's own time of the work issued between :meth:`start` and :meth:`end` (CUDA events); nothing
    elsewhere (``fake`` runs on the host: its issue time is its run time)."""

    def __init__(self, device: torch.device) -> None:
        self.on = device.type == "cuda"
        if self.on:
            self._start = torch.cuda.Event(enable_timing=True)
            self._end = torch.cuda.Event(enable_timing=True)

    def start(self) -> None:
        if self.on:
            self._start.record()

    def end(self) -> None:
        if self.on:
            self._end.record()

    def elapsed_ms(self) -> float:
        """After the device was synchronised: milliseconds between the two events (0 without events)."""
        return self._start.elapsed_time(self._end) if self.on else 0.0


class _ScratchCache:
    """One zero block per layer: enough for a warm-up step whose block table names only block 0."""

    def __init__(self, model: Model, block_size: int) -> None:
        cfg = model.cfg
        self.block_size = block_size
        shape = (1, block_size, cfg.kv_heads, cfg.head_dim)
        self.k = [torch.zeros(shape, dtype=cfg.torch_dtype, device=model.device) for _ in range(cfg.layers)]
        self.v = [torch.zeros(shape, dtype=cfg.torch_dtype, device=model.device) for _ in range(cfg.layers)]


def warm_up(model: Model, wl: Workload) -> None:
    """One untimed step, so that the first strategy does not pay the kernels' first-call costs."""
    zero = torch.zeros(1, dtype=torch.long, device=model.device)
    model.forward(_ScratchCache(model, wl.block_size), zero, zero, zero, zero, zero + 1, zero[:, None])


def run(be: hal.Backend, config: str = "tiny", workload: Workload | None = None,
        strategies: Sequence[str] = STRATEGIES, seed: int = 0, alternations: int = 1) -> dict[str, Any]:
    """Every strategy on the same model and requests, ``alternations`` times in a rotated order; the figures of
    the first round, the step time over every round, and the cross-strategy checks."""
    if not isinstance(alternations, int) or alternations < 1:
        raise hal.InvalidArgumentError(f"alternations={alternations!r} must be an int >= 1", backend=be.name,
                                       call="run")
    cfg, default_wl = CONFIGS[config]
    wl = workload or default_wl
    model = Model(be, cfg, wl.max_model_len, seed)
    warm_up(model, wl)
    keep = wl.steps * wl.max_batch * cfg.vocab * 4 * len(strategies) <= KEEP_LOGITS_LIMIT
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in strategies}
    for a in range(alternations):
        for name in rotated(list(strategies), a):
            rounds[name].append(decode(be, model, wl, name, keep_logits=keep and a == 0))
            if a:  # only the first round keeps its trace and tokens: later ones need their times and digests
                rounds[name][-1] = {k: rounds[name][-1][k] for k in ("step_ms_median", "step_ms_max", "digests",
                                                                     *PHASES.values())}
    results = {}
    for name, runs in rounds.items():
        medians = [r["step_ms_median"] for r in runs]
        results[name] = {**runs[0], "step_ms_median": spread(medians)["median"], "step_ms": spread(medians),
                         "step_ms_runs": medians, "digests_stable": all(r["digests"] == runs[0]["digests"]
                                                                        for r in runs),
                         **{phase: spread(r[key] for r in runs) for phase, key in PHASES.items()}}
    first = results[strategies[0]]
    tokens_equal = all(r["tokens"] == first["tokens"] for r in results.values())
    digests_equal = all(r["digests"] == first["digests"] and r["digests_stable"] for r in results.values())
    logits_equal = digests_equal and (not keep or all(
        len(r["logits"]) == len(first["logits"])
        and all(torch.equal(a, b) for a, b in zip(r["logits"], first["logits"], strict=True))
        for r in results.values()))
    checks: dict[str, Any] = {"tokens_equal": tokens_equal, "logits_equal": logits_equal,
                              "logits_compared": "bit-exact" if keep else "digests", "alternations": alternations}
    el = results.get("elastic")
    if el is not None:
        slack = el["ranges"] * el["granularity"]
        checks["elastic_within_granule"] = all(r["physical"] <= r["used"] + slack for r in el["trace"])
        checks["elastic_slack_limit_bytes"] = slack
        checks["elastic_copied_bytes"] = el["copied_bytes"]
        checks["elastic_moves"] = el["moves"]
        if "prealloc" in results:  # the median step against the preallocated cache's, both over every round
            checks["elastic_step_ratio"] = el["step_ms_median"] / results["prealloc"]["step_ms_median"]
    if "prealloc" in results:  # every strategy against the preallocated cache, round by round (the rounds pair up)
        base = results["prealloc"]["step_ms_runs"]
        checks["step_ratio_to_prealloc"] = {name: spread(a / b for a, b in zip(r["step_ms_runs"], base, strict=True))
                                            for name, r in results.items() if name != "prealloc"}
    return {"backend": be.name, "config": config, "model": asdict(cfg), "workload": {**asdict(wl),
            "max_blocks": wl.max_blocks}, "alternations": alternations, "results": results, "checks": checks}


# -- command line ------------------------------------------------------------------------------------


def print_report(out: dict[str, Any]) -> None:
    wl, checks = out["workload"], out["checks"]
    print(f"backend {out['backend']}, config {out['config']}, {wl['steps']} steps, up to {wl['max_batch']} "
          f"sequences (one every {wl['arrive_every']} steps), block size {wl['block_size']}, "
          f"cache of at most {wl['max_blocks']} blocks; {out['alternations']} alternation(s) of the strategies, "
          "step ms as the median of their medians (min-max)")
    print(f"{'strategy':<18}{'peak device':>13}{'peak held':>12}{'peak phys':>12}{'final phys':>12}"
          f"{'final used':>12}{'max slack':>11}{'copied':>11}{'moves':>7}{'step ms':>26}{'max ms':>8}{'grow ms':>9}")
    for r in out["results"].values():
        print(f"{r['strategy']:<18}{fmt_bytes(r['peak_device_bytes']):>13}{fmt_bytes(r['peak_held_bytes']):>12}"
              f"{fmt_bytes(r['peak_physical_bytes']):>12}"
              f"{fmt_bytes(r['final_physical_bytes']):>12}{fmt_bytes(r['final_used_bytes']):>12}"
              f"{fmt_bytes(r['max_slack_bytes']):>11}{fmt_bytes(r['copied_bytes']):>11}{r['moves']:>7}"
              f"{fmt_spread(r['step_ms']):>26}{r['step_ms_max']:>8.2f}{r['grow_ms_total']:>9.1f}")
    print_phases(out)
    print(f"tokens equal across strategies: {'yes' if checks['tokens_equal'] else 'NO'}; logits equal "
          f"({checks['logits_compared']}): {'yes' if checks['logits_equal'] else 'NO'}")
    if "elastic_within_granule" in checks:
        el = out["results"]["elastic"]
        print(f"elastic: physical <= used + {el['ranges']} x {fmt_bytes(el['granularity'])} at every step: "
              f"{'met' if checks['elastic_within_granule'] else 'MISS'}; bytes copied on growth: "
              f"{checks['elastic_copied_bytes']}; address moves: {checks['elastic_moves']}")
    if "elastic_step_ratio" in checks:
        ratio = checks["elastic_step_ratio"]
        met = "met" if ratio <= 1 + STEP_TOLERANCE else "MISS"
        print(f"elastic step / preallocated step (medians over {out['alternations']} alternation(s)): {ratio:.4f} "
              f"({(ratio - 1) * 100:+.2f}%; within {STEP_TOLERANCE:.0%}: {met})")


def print_phases(out: dict[str, Any]) -> None:
    """Where a step's time goes, per strategy (medians of the rounds' medians, min-max), and each strategy's step
    against the preallocated cache's, round by round."""
    ratios = out["checks"].get("step_ratio_to_prealloc", {})
    print(f"{'strategy':<18}{'grow ms (host)':>26}{'issue ms (host)':>26}{'forward ms (device)':>26}"
          f"{'step / prealloc':>26}")
    for name, r in out["results"].items():
        ratio = fmt_spread(ratios[name], digits=4) if name in ratios else "-"
        print(f"{name:<18}" + "".join(f"{fmt_spread(r[p]):>26}" for p in PHASES) + f"{ratio:>26}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default=None, help="hal backend (default: the best available)")
    parser.add_argument("--config", choices=sorted(CONFIGS), default=None,
                        help="model and workload sizes (default: reference on a GPU, tiny otherwise)")
    parser.add_argument("--steps", type=int, default=None, help="decode steps (default: the config's)")
    parser.add_argument("--max-batch", type=int, default=None, help="requests in all (one arrives at a time)")
    parser.add_argument("--max-model-len", type=int, default=None, help="tokens per sequence at most")
    parser.add_argument("--block-size", type=int, default=None, help="tokens per KV block")
    parser.add_argument("--arrive-every", type=int, default=None, help="steps between two arrivals")
    parser.add_argument("--strategies", default=",".join(STRATEGIES),
                        help=f"comma-separated, of {', '.join(STRATEGIES)}; diagnostics: {', '.join(DIAGNOSTIC)}")
    parser.add_argument("--alternations", type=int, default=None,
                        help="rounds of every strategy in a rotated order (default: 5 for the reference config, 1 "
                             "otherwise); the step time is the median of the rounds' medians")
    parser.add_argument("--granularity", type=int, default=FAKE_GRANULARITY, help="fake backend: bytes per granule")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures (traces included) here")
    args = parser.parse_args(argv)
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    if not strategies or set(strategies) - set(STRATEGIES + DIAGNOSTIC):
        parser.error(f"--strategies: choose from {', '.join(STRATEGIES + DIAGNOSTIC)}")
    name = select_backend_name(args.backend, requires=("graphs",))
    be = hal.get_backend(name, **({"granularity": args.granularity} if name == "fake" else {}))
    try:
        config = args.config or ("reference" if be.torch_device().type == "cuda" else "tiny")
        wl = CONFIGS[config][1]
        overrides = {k: getattr(args, k) for k in ("steps", "max_batch", "max_model_len", "block_size",
                                                    "arrive_every") if getattr(args, k) is not None}
        if any(v < 1 for v in overrides.values()):
            parser.error("--steps, --max-batch, --max-model-len, --block-size and --arrive-every must be >= 1")
        wl = replace(wl, **overrides)
        if wl.steps > wl.max_model_len:
            parser.error(f"--steps {wl.steps} exceed --max-model-len {wl.max_model_len}")
        alternations = args.alternations if args.alternations is not None else 5 if config == "reference" else 1
        if alternations < 1:
            parser.error("--alternations must be >= 1")
        out = run(be, config, wl, strategies, alternations=alternations)
    except hal.HalError as exc:
        print(f"error: {exc}")
        return 2
    finally:
        be.close()
    print_report(out)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        slim = {**out, "results": {k: {kk: vv for kk, vv in r.items() if kk != "logits"}
                                   for k, r in out["results"].items()}}
        args.json.write_text(json.dumps(slim, indent=1))
        print(f"wrote {args.json}")
    checks = out["checks"]
    ok = checks["tokens_equal"] and checks["logits_equal"] and checks.get("elastic_within_granule", True) \
        and checks.get("elastic_copied_bytes", 0) == 0
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
