"""A pure-torch stand-in for the two flash-attn functions nano-vllm calls (tests only).

Same signatures and layouts as flash-attn's: ``flash_attn_varlen_func`` over packed
sequences (prefill, optionally reading a paged cache through ``block_table``) and
``flash_attn_with_kvcache`` over a paged cache (decode). The decode path has no host
synchronisation, so it can be captured into a CUDA graph.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    """q [Lq, Hq, D], k/v [Lk, Hk, D] -> [Lq, Hq, D]; grouped heads, causal aligned to the end."""
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    mask = None
    if causal:
        lq, lk = q.shape[0], k.shape[0]
        mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(diagonal=lk - lq)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         attn_mask=mask, scale=scale)
    return out.transpose(0, 1)


def _paged(cache: torch.Tensor, table: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` tokens of one sequence from a paged cache [blocks, block_size, H, D]."""
    blocks = cache[table[table >= 0].long()]
    return blocks.reshape(-1, *cache.shape[2:])[:length]


def flash_attn_varlen_func(q, k, v, max_seqlen_q=None, cu_seqlens_q=None, max_seqlen_k=None, cu_seqlens_k=None,
                           softmax_scale=None, causal=False, block_table=None, **_):
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    out = torch.empty_like(q)
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for i in range(len(cq) - 1):
        if block_table is None:
            ki, vi = k[ck[i]:ck[i + 1]], v[ck[i]:ck[i + 1]]
        else:
            length = ck[i + 1] - ck[i]
            ki, vi = _paged(k, block_table[i], length), _paged(v, block_table[i], length)
        out[cq[i]:cq[i + 1]] = _attend(q[cq[i]:cq[i + 1]], ki, vi, scale, causal)
    return out


def flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=None, block_table=None, softmax_scale=None,
                            causal=False, **_):
    """q [B, 1, Hq, D]; caches [blocks, block_size, Hk, D]; block_table [B, max_blocks] -> [B, 1, Hq, D]."""
    batch, _, heads, dim = q.shape
    scale = softmax_scale if softmax_scale is not None else dim ** -0.5
    table = block_table.clamp(min=0).long()
    kv_heads = k_cache.shape[2]
    k = k_cache[table].reshape(batch, -1, kv_heads, dim)  # [B, T, Hk, D]
    v = v_cache[table].reshape(batch, -1, kv_heads, dim)
    qg = q.reshape(batch, kv_heads, heads // kv_heads, dim).float()
    scores = torch.einsum("bhgd,bthd->bhgt", qg, k.float()) * scale
    positions = torch.arange(k.shape[1], device=q.device)
    scores = scores.masked_fill(positions >= cache_seqlens.view(batch, 1, 1, 1).long(), float("-inf"))
    out = torch.einsum("bhgt,bthd->bhgd", scores.softmax(dim=-1).nan_to_num(0.0), v.float())
    return out.reshape(batch, 1, heads, dim).to(q.dtype)
