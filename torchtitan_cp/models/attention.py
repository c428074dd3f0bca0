"""Softmax attention layer (GQA, RoPE or NoPE) with a causal document mask over the packed stream.

Under context parallelism ``[model] attention_cp`` picks how keys/values cross ranks:
``all_gather`` (every rank gathers the whole stream's K/V, per backend as below) or ``pass_kv``
(``ops.pass_kv_attention``: each rank keeps its own K/V, blocks travel point to point between
the ranks whose documents meet, per-pair kernel math on sdpa, flex on flex).

Two backends, chosen by ``[model] attention_backend``:

* ``flex``: torchtitan's ``FlexAttention`` (compiled flex attention) with the microbatch's
  document ``BlockMask``. Under CP it runs torchtitan's own CP path: ``apply_cp_to_forward``
  all-gathers K/V and the mask covers this rank's queries (``ops.flex_document_mask``).
  The default on CUDA. On CPU it runs forward only (flex has no CPU backward).
* ``sdpa``: SDPA with an explicit document mask built from global token/document ids, the
  all-gather-K/V CP op ``ops.context_parallel_attention``. The default elsewhere.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from torchtitan.models.common.attention import FlexAttention
from torchtitan.protocols.module import Module

from torchtitan_cp.models.context import SequenceContext
from torchtitan_cp.models.init import linear
from torchtitan_cp.ops import context_parallel_attention, pass_kv_attention

AttentionBackend = Literal["auto", "flex", "sdpa"]
ATTENTION_BACKENDS = ("auto", "flex", "sdpa")
AttentionCP = Literal["all_gather", "pass_kv"]
ATTENTION_CP_MODES = ("all_gather", "pass_kv")
DEFAULT_ATTENTION_CP: AttentionCP = "all_gather"


def check_attention_cp(mode: str) -> None:
    """A ValueError naming ``model.attention_cp`` for an unknown mode."""
    if mode not in ATTENTION_CP_MODES:
        raise ValueError(f"model.attention_cp must be one of {ATTENTION_CP_MODES}, got {mode!r}")


def routed_pass_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ctx: SequenceContext,
    backend: Literal["flex", "sdpa"],
    scale: float | None = None,
) -> torch.Tensor:
    """Pass-KV attention of ``q [1, T, Hq, D]``, ``k``/``v [1, T, Hkv, ·]`` over ``ctx``'s
    schedule; the per-pair kernel is flex on the flex backend, plain math on sdpa (which returns
    no log-sum-exp)."""
    if ctx.pass_kv is None:
        raise ValueError(
            "model.attention_cp = 'pass_kv' under context parallelism needs a SequenceContext "
            "with the pass-KV schedule (SequencePreprocessor(attention_cp='pass_kv') builds one)"
        )
    kernel = "flex" if backend == "flex" else "math"
    return pass_kv_attention(
        q, k, v, routing=ctx.pass_kv, group=ctx.group, scale=scale, kernel=kernel
    )


def resolve_attention_backend(
    backend: str, device_type: str | torch.device
) -> Literal["flex", "sdpa"]:
    """``auto`` is flex on CUDA and sdpa elsewhere; an unknown name is a ValueError."""
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(
            f"model.attention_backend must be one of {ATTENTION_BACKENDS}, got {backend!r}"
        )
    if backend == "auto":
        return "flex" if torch.device(device_type).type == "cuda" else "sdpa"
    return "flex" if backend == "flex" else "sdpa"


def apply_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding of ``x [1, T, H, D]`` at document-relative ``positions [T]``."""
    half = x.shape[-1] // 2
    acc = torch.promote_types(x.dtype, torch.float32)
    inv_freq = theta ** (-torch.arange(0, half, device=x.device, dtype=acc) / half)
    angles = positions.to(acc)[:, None] * inv_freq[None, :]  # [T, D/2]
    cos, sin = angles.cos()[None, :, None, :], angles.sin()[None, :, None, :]
    x1, x2 = x.to(acc)[..., :half], x.to(acc)[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class DocumentFlexAttention(FlexAttention):
    """torchtitan's ``FlexAttention`` (``[B, L, H, D]`` in and out); torchtitan's CP wrapper
    accepts it as one. On CUDA it is torchtitan's compiled kernel; elsewhere flex runs eagerly,
    because inductor's CPU flex template fails to compile CP-sharded masks (torch 2.14.1) and
    CPU flex is forward-only anyway (evaluation, tests)."""

    def forward(  # pyrefly: ignore[bad-override]
        self,
        q_BLNH: torch.Tensor,
        k_BLNH: torch.Tensor,
        v_BLNH: torch.Tensor,
        *,
        attention_masks: BlockMask,
        enable_gqa: bool = False,
        **kwargs,
    ) -> torch.Tensor:
        if q_BLNH.is_cuda:
            return super().forward(
                q_BLNH, k_BLNH, v_BLNH, attention_masks=attention_masks,
                enable_gqa=enable_gqa, **kwargs,
            )  # fmt: skip
        if kwargs:
            raise NotImplementedError(f"eager flex attention takes no {sorted(kwargs)}")
        out = flex_attention(
            q_BLNH.transpose(1, 2),
            k_BLNH.transpose(1, 2),
            v_BLNH.transpose(1, 2),
            block_mask=attention_masks,
            enable_gqa=enable_gqa,
        )
        assert isinstance(out, torch.Tensor)
        return out.transpose(1, 2)


class SoftmaxAttention(Module):
    """Grouped-query attention; no token attends across a document boundary.

    Input/output ``[B, L, D]``. Under context parallelism each rank's queries attend to the
    keys/values of the whole stream: all-gathered (flex: torchtitan's ``apply_cp_to_forward``
    on ``self.flex``; sdpa: ``ops.context_parallel_attention``) or, with ``cp_mode =
    "pass_kv"``, passed between ranks in rounds (``ops.pass_kv_attention``).
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
        backend: AttentionBackend = "auto"
        cp_mode: AttentionCP = DEFAULT_ATTENTION_CP

    def __init__(self, config: Config):
        super().__init__()
        check_attention_cp(config.cp_mode)
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
        resolve_attention_backend(config.backend, "cpu")  # reject a bad name at build time
        self.backend = config.backend
        self.cp_mode = config.cp_mode
        # Parameter-free; present for every backend so "auto" can pick it on CUDA.
        self.flex = DocumentFlexAttention(DocumentFlexAttention.Config())
        self.flex_cp = False  # set by apply_flex_context_parallel once K/V are gathered

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
        backend = resolve_attention_backend(self.backend, x.device)
        if ctx.cp_enabled and self.cp_mode == "pass_kv":
            o = routed_pass_kv(q, k, v, ctx, backend)
        elif backend == "flex":
            o = self._flex(q, k, v, ctx, bsz, seqlen)
        else:
            # Every CP rank holds B·L/W tokens (torch's load balancers split evenly), so the
            # gather size is known without asking the other ranks.
            o = context_parallel_attention(
                q, k, v, token_ids=ctx.token_ids, doc_ids=ctx.doc_ids, group=ctx.group,
                max_tokens=ctx.routing.num_tokens,
            )  # fmt: skip
        return self.wo(o.flatten(-2)).reshape(bsz, seqlen, -1)

    def _flex(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        ctx: SequenceContext,
        bsz: int,
        seqlen: int,
    ) -> torch.Tensor:
        if ctx.block_mask is None:
            raise ValueError(
                "attention_backend 'flex' needs a SequenceContext with a document block_mask "
                "(SequencePreprocessor(flex_attention=True) builds one)"
            )
        if ctx.cp_enabled and not self.flex_cp:
            raise RuntimeError(
                "flex attention under context parallelism needs its K/V all-gather: call "
                "apply_flex_context_parallel(model, cp_mesh) (parallelize_hybrid does)"
            )
        # Rows back: the mask is per row, and under CP torchtitan gathers K/V along dim 1.
        o = self.flex(
            q.reshape(bsz, seqlen, self.n_heads, self.head_dim),
            k.reshape(bsz, seqlen, self.n_kv_heads, self.head_dim),
            v.reshape(bsz, seqlen, self.n_kv_heads, self.head_dim),
            attention_masks=ctx.block_mask,
            enable_gqa=self.n_heads != self.n_kv_heads,
        )
        return o.reshape(1, bsz * seqlen, self.n_heads, self.head_dim)
