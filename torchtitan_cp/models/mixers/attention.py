"""Softmax attention layer (GQA, RoPE or NoPE) with a causal document mask over the packed stream.

Under context parallelism ``[model] attention_cp`` picks how keys/values cross ranks:
``all_gather`` (every rank gathers the whole stream's K/V, per backend as below) or ``pass_kv``
(``ops.pass_kv_attention``: each rank keeps its own K/V, blocks travel point to point between
the ranks whose documents meet, per-pair kernel math on sdpa, flex on flex;
``models/blocks/attention_cp.py``).

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

import torch
from torchtitan.protocols.module import Module

from torchtitan_cp.models.blocks.attention_cp import (
    DEFAULT_ATTENTION_CP,
    AttentionCP,
    check_attention_cp,
    routed_pass_kv,
)
from torchtitan_cp.models.blocks.flex import (
    AttentionBackend,
    DocumentFlexAttention,
    resolve_attention_backend,
)
from torchtitan_cp.models.blocks.init import linear
from torchtitan_cp.models.blocks.rope import apply_rope
from torchtitan_cp.models.context import SequenceContext
from torchtitan_cp.ops import context_parallel_attention


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
