"""The one attention router of the recipe: ``RoutedInnerAttention``, the ``inner_attention`` of
every softmax attention layer (the hybrid decoder's ``SoftmaxAttention``, Qwen3.5's gated
attention, Kimi Linear's MLA), which picks per call how the layer's queries meet the keys and
values over the microbatch's ``SequenceContext``: pass-KV under context parallelism with
``[model] attention_cp = "pass_kv"``, else flex (the document ``BlockMask``) or sdpa (the
all-gather CP op), as ``[model] attention_backend`` says. And the per-layer metadata that
carries the context where upstream passes its ``VarlenMetadata`` (the models built on
torchtitan's own decoders: ``models.qwen35``, ``models.kimi_linear``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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
from torchtitan_cp.models.context import SequenceContext
from torchtitan_cp.ops import context_parallel_attention

__all__ = [
    "RoutedInnerAttention",
    "RoutedVarlenMetadata",
    "routed_varlen_metadata",
    "seq_ctx_of",
]


@dataclass(frozen=True, eq=False)
class RoutedVarlenMetadata:
    """What every layer receives where upstream passes its ``VarlenMetadata``: the microbatch's
    ``SequenceContext``, whose routing holds this rank's document offsets (device and host).

    Upstream's own layer code (Qwen3.5's ``GatedDeltaNet``) reads none of it (its kernel and conv, which would
    take the offsets, are swapped for ones that read the routing), so no per-layout host value
    enters a compiled block. A plain dataclass rather than a ``VarlenMetadata`` subclass: pytree
    maps over a block's inputs (FSDP's input cast, activation checkpointing) rebuild NamedTuples
    from their fields and would drop ``seq_ctx``; a dataclass is a leaf and passes through
    whole."""

    seq_ctx: SequenceContext


def routed_varlen_metadata(ctx: SequenceContext) -> RoutedVarlenMetadata:
    """The per-layer metadata of this microbatch (no device read: the routing is built on the
    host)."""
    return RoutedVarlenMetadata(ctx)


def seq_ctx_of(masks: Any, where: str) -> SequenceContext:
    """The ``SequenceContext`` that ``masks`` (a ``RoutedVarlenMetadata``) carries; a ValueError
    naming ``where`` when a caller passed upstream's own masks instead."""
    ctx = getattr(masks, "seq_ctx", None)
    if ctx is None:
        raise ValueError(
            f"{where} under torchtitan_cp needs the microbatch's SequenceContext: call "
            "the model's forward(tokens, positions, seq_ctx) (SequencePreprocessor builds it)"
        )
    return ctx


class RoutedInnerAttention(Module):
    """The ``inner_attention`` of the recipe's softmax attention layers, as torchtitan's
    attention modules hold one, over the packed documents of the microbatch.

    In/out ``[B, L_local, H, D]``. flex: torchtitan's ``FlexAttention`` (``self.flex``) with the
    context's document ``BlockMask`` (under CP wrapped by ``apply_cp_to_forward``); sdpa:
    ``ops.context_parallel_attention`` over the flattened span with global token/document ids;
    under CP with ``cp_mode = "pass_kv"``: ``ops.pass_kv_attention`` (either backend).
    ``forward`` takes torchtitan's ``attention_masks`` (a ``RoutedVarlenMetadata``), ``route``
    the context itself.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        backend: AttentionBackend = "auto"
        cp_mode: AttentionCP = DEFAULT_ATTENTION_CP

    def __init__(self, config: Config):
        super().__init__()
        resolve_attention_backend(config.backend, "cpu")  # reject a bad name at build time
        check_attention_cp(config.cp_mode)
        self.backend = config.backend
        self.cp_mode = config.cp_mode
        # Parameter-free; present for every backend so "auto" can pick it on CUDA.
        self.flex = DocumentFlexAttention(DocumentFlexAttention.Config())
        self.flex_cp = False  # set once torchtitan's CP wrapper gathers K/V for self.flex

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        attention_masks: Any = None,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        ctx = seq_ctx_of(attention_masks, "softmax attention")
        return self.route(q, k, v, ctx, scale=scale, enable_gqa=enable_gqa)

    def route(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        ctx: SequenceContext,
        *,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        """Attention of ``q [B, L_local, Hq, D]`` over ``k``/``v [B, L_local, Hkv, ·]`` and the
        keys/values of the other CP ranks' documents, as ``ctx`` lays them out; returns
        ``[B, L_local, Hq, Dv]``."""
        bsz, seqlen, n_heads, head_dim = q.shape
        backend = resolve_attention_backend(self.backend, q.device)
        if backend == "flex" and not (ctx.cp_enabled and self.cp_mode == "pass_kv"):
            if ctx.cp_enabled and not self.flex_cp:
                raise RuntimeError(
                    "flex attention under context parallelism needs its K/V all-gather: "
                    "the model's parallelize (apply_flex_context_parallel) applies it"
                )
            return self._flex(self.flex, q, k, v, ctx, scale, enable_gqa)
        # pass-KV and sdpa take the span flattened: [1, B x L_local, H, D]
        q, k, v = (t.reshape(1, bsz * seqlen, *t.shape[2:]) for t in (q, k, v))
        if ctx.cp_enabled and self.cp_mode == "pass_kv":
            o = routed_pass_kv(q, k, v, ctx, backend, scale)
        else:
            # Every CP rank holds B·L/W tokens (torch's load balancers split evenly), so the
            # gather size is known without asking the other ranks.
            o = context_parallel_attention(
                q,
                k,
                v,
                token_ids=ctx.token_ids,
                doc_ids=ctx.doc_ids,
                group=ctx.group,
                scale=scale,
                max_tokens=ctx.routing.num_tokens,
            )
        return o.reshape(bsz, seqlen, n_heads, v.shape[3])

    def flex_gathered(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        ctx: SequenceContext,
        scale: float | None = None,
    ) -> torch.Tensor:
        """Flex attention of this rank's queries ``q [B, L_local, H, D]`` over keys and values
        the caller already gathered over the CP group (``[B, world x L_local, H, D]``, rank
        order, as torchtitan's flex K/V all-gather lays them out; MLA gathers its compressed
        latent and expands it): this rank's document ``BlockMask``, no second gather."""
        # the class's forward, not the instance's: torchtitan's CP wrapper would gather again
        return self._flex(DocumentFlexAttention.forward.__get__(self.flex), q, k, v, ctx, scale)

    @staticmethod
    def _flex(
        flex: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        ctx: SequenceContext,
        scale: float | None,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        if ctx.block_mask is None:
            raise ValueError(
                "attention_backend 'flex' needs a SequenceContext with a document "
                "block_mask (SequencePreprocessor(flex_attention=True) builds one)"
            )
        if scale is not None and scale != q.shape[-1] ** -0.5:
            raise ValueError(f"flex path supports the default scale only, got {scale}")
        return flex(q, k, v, attention_masks=ctx.block_mask, enable_gqa=enable_gqa)
