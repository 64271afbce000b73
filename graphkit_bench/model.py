"""A Llama/Qwen3-shaped decoder with random weights and a static KV cache, for benchmarks.

One decode step: embed the new token of each sequence, and through every
layer RMSNorm, q/k/v projections with grouped-query heads, rotary position
embedding, a write of k/v into the static cache at each sequence's position,
attention over the cache up to that position, the output projection, a
SiLU-gated MLP; then the final norm and the logits.

Inputs (dim 0 is the batch): ``tokens`` (long), ``positions`` (long),
``slots`` (long: the cache row of each sequence). Padding rows use the
scratch slot ``max_batch`` (a cache row no sequence owns), so padded rows
never touch live state.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class DecoderConfig:
    hidden: int = 1024
    layers: int = 28
    heads: int = 16
    kv_heads: int = 8
    head_dim: int = 128
    mlp: int = 3072
    vocab: int = 151936
    context: int = 128
    dtype: str = "bfloat16"

    @classmethod
    def tiny(cls) -> DecoderConfig:
        """Small enough for a 2-core CPU in seconds."""
        return cls(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, mlp=128, vocab=512, context=16,
                   dtype="float32")

    def as_dict(self) -> dict:
        return asdict(self)

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


class Decoder:
    """Weights and KV cache on one device; ``step(tokens, positions, slots)`` returns logits."""

    def __init__(self, cfg: DecoderConfig, max_batch: int, device: torch.device, seed: int = 0) -> None:
        self.cfg = cfg
        self.max_batch = max_batch
        dt = cfg.torch_dtype
        gen = torch.Generator().manual_seed(seed)

        def w(*shape: int) -> torch.Tensor:
            return (torch.randn(*shape, generator=gen) / shape[-1] ** 0.5).to(device=device, dtype=dt)

        q, kv = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
        self.embed = w(cfg.vocab, cfg.hidden)
        self.layers = [
            {"norm1": torch.ones(cfg.hidden, device=device, dtype=dt), "wqkv": w(q + 2 * kv, cfg.hidden),
             "wo": w(cfg.hidden, q), "norm2": torch.ones(cfg.hidden, device=device, dtype=dt),
             "w_gate_up": w(2 * cfg.mlp, cfg.hidden), "w_down": w(cfg.hidden, cfg.mlp)}
            for _ in range(cfg.layers)
        ]
        self.norm = torch.ones(cfg.hidden, device=device, dtype=dt)
        self.lm_head = w(cfg.vocab, cfg.hidden)
        # one cache row per sequence slot, plus the scratch slot for padding
        shape = (cfg.layers, max_batch + 1, cfg.context, cfg.kv_heads, cfg.head_dim)
        self.k_cache = torch.empty(shape, device=device, dtype=dt)
        self.v_cache = torch.empty(shape, device=device, dtype=dt)
        self.seed = seed
        self.reset_cache()
        inv = 1.0 / (10000 ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim))
        angles = torch.outer(torch.arange(cfg.context, dtype=torch.float32), inv)
        self.cos = angles.cos().to(device=device, dtype=dt)
        self.sin = angles.sin().to(device=device, dtype=dt)
        self.steps = torch.arange(cfg.context, device=device)

    def reset_cache(self) -> None:
        """Refill the KV cache with the same pseudo-random history (so runs can be compared)."""
        gen = torch.Generator(self.k_cache.device).manual_seed(self.seed + 1)
        self.k_cache.normal_(generator=gen)
        self.v_cache.normal_(generator=gen)

    @property
    def scratch_slot(self) -> int:
        return self.max_batch

    def weight_bytes(self) -> int:
        tensors = [self.embed, self.lm_head, self.norm] + [t for layer in self.layers for t in layer.values()]
        return sum(t.numel() * t.element_size() for t in tensors)

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
        x1, x2 = x[..., ::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)

    def step(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        return self.head(self.run_layers(self.embed_tokens(tokens), positions, slots))

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """The first part of a step: the hidden state of each sequence's new token."""
        return self.embed[tokens]

    def run_layers(self, h: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, first: int = 0,
                   last: int | None = None) -> torch.Tensor:
        """Layers ``first`` to ``last`` (excluded; all by default) of a step over the hidden state ``h``."""
        cfg = self.cfg
        b = h.shape[0]
        q_size, kv_size = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
        mask = (self.steps[None, :] <= positions[:, None])[:, None, None, :]  # (b, 1, 1, context)
        for i in range(first, cfg.layers if last is None else last):
            layer = self.layers[i]
            x = F.rms_norm(h, (cfg.hidden,), layer["norm1"])
            q, k, v = F.linear(x, layer["wqkv"]).split([q_size, kv_size, kv_size], dim=-1)
            q = self._rope(q.view(b, cfg.heads, cfg.head_dim), positions)
            k = self._rope(k.view(b, cfg.kv_heads, cfg.head_dim), positions)
            self.k_cache[i].index_put_((slots, positions), k)
            self.v_cache[i].index_put_((slots, positions), v.view(b, cfg.kv_heads, cfg.head_dim))
            keys = self.k_cache[i][slots].transpose(1, 2)  # (b, kv_heads, context, head_dim)
            values = self.v_cache[i][slots].transpose(1, 2)
            attn = F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, attn_mask=mask, enable_gqa=True)
            h = h + F.linear(attn.reshape(b, q_size), layer["wo"])
            x = F.rms_norm(h, (cfg.hidden,), layer["norm2"])
            gate, up = F.linear(x, layer["w_gate_up"]).chunk(2, dim=-1)
            h = h + F.linear(F.silu(gate) * up, layer["w_down"])
        return h

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """The last part of a step: the logits of the hidden state ``h``."""
        return F.linear(F.rms_norm(h, (self.cfg.hidden,), self.norm), self.lm_head)

    def example_inputs(self, batch: int, seed: int = 0) -> dict[str, torch.Tensor]:
        """Tokens, positions and distinct slots for ``batch`` sequences."""
        gen = torch.Generator().manual_seed(seed)
        device = self.embed.device
        return {
            "tokens": torch.randint(0, self.cfg.vocab, (batch,), generator=gen).to(device),
            "positions": torch.randint(0, self.cfg.context, (batch,), generator=gen).to(device),
            "slots": torch.randperm(self.max_batch, generator=gen)[:batch].to(device),
        }

    def padding(self) -> dict[str, int]:
        """Fill values that make padded rows harmless: the scratch slot, position 0, token 0."""
        return {"tokens": 0, "positions": 0, "slots": self.scratch_slot}
