"""Softmax attention layer (GQA, RoPE or NoPE) with a causal document mask over the packed stream."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torchtitan.protocols.module import Module

from torchtitan_cp.models.context import SequenceContext
from torchtitan_cp.models.init import linear
from torchtitan_cp.ops import context_parallel_attention


def apply_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding of ``x [1, T, H, D]`` at document-relative ``positions [T]``."""
    half = x.shape[-1] // 2
    acc = torch.promote_types(x.dtype, torch.float32)
    inv_freq = theta ** (-torch.arange(0, half, device=x.device, dtype=acc) / half)
    angles = positions.to(acc)[:, None] * inv_freq[None, :]  # [T, D/2]
    cos, sin = angles.cos()[None, :, None, :], angles.sin()[None, :, None, :]
    x1, x2 = x.to(acc)[..., :half], x.to(acc)[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class SoftmaxAttention(Module):
    """Grouped-query attention; no token attends across a document boundary.

    Input/output ``[B, L, D]``. Under context parallelism each rank's queries attend to the
    all-gathered keys/values of the whole stream (see ``ops.context_parallel_attention``).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        dim: int
        n_heads: int
        n_kv_heads: int
        head_dim: int
        use_rope: bool = True
        rope_theta: float = 10000.0
        layer_id: int = 0

    def __init__(self, config: Config):
        super().__init__()
        if config.n_heads % config.n_kv_heads:
            raise ValueError(
                f"attention n_heads ({config.n_heads}) must be a multiple of "
                f"n_kv_heads ({config.n_kv_heads})"
            )
        self.n_heads, self.n_kv_heads, self.head_dim = (
            config.n_heads,
            config.n_kv_heads,
            config.head_dim,
        )
        self.use_rope, self.rope_theta = config.use_rope, config.rope_theta
        d, hd = config.dim, config.head_dim
        self.wq = linear(d, config.n_heads * hd)
        self.wk = linear(d, config.n_kv_heads * hd)
        self.wv = linear(d, config.n_kv_heads * hd)
        self.wo = linear(config.n_heads * hd, d, std=0.02 / math.sqrt(2 * (config.layer_id + 1)))

    def forward(
        self, x: torch.Tensor, ctx: SequenceContext, positions: torch.Tensor | None
    ) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        xs = x.reshape(1, bsz * seqlen, -1)
        q = self.wq(xs).unflatten(-1, (self.n_heads, self.head_dim))
        k = self.wk(xs).unflatten(-1, (self.n_kv_heads, self.head_dim))
        v = self.wv(xs).unflatten(-1, (self.n_kv_heads, self.head_dim))
        if self.use_rope:
            if positions is None:
                raise ValueError("SoftmaxAttention with RoPE needs the document positions")
            pos = positions.reshape(-1)
            q, k = apply_rope(q, pos, self.rope_theta), apply_rope(k, pos, self.rope_theta)
        # Every CP rank holds B·L/W tokens (torch's load balancers split evenly), so the gather
        # size is known without asking the other ranks.
        o = context_parallel_attention(
            q, k, v, token_ids=ctx.token_ids, doc_ids=ctx.doc_ids, group=ctx.group,
            max_tokens=ctx.routing.num_tokens,
        )  # fmt: skip
        return self.wo(o.flatten(-2)).reshape(bsz, seqlen, -1)
