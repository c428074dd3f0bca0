"""The hybrid decoder: a stack of blocks whose mixers the layer pattern picks from the registry
(``models.hybrid.layers``: KDA, GDN, softmax attention, Mamba2)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn
from torchtitan.models.common.embedding import Embedding
from torchtitan.models.common.feed_forward import FeedForward
from torchtitan.models.common.nn_modules import RMSNorm
from torchtitan.protocols.model import BaseModel
from torchtitan.protocols.module import Module, ModuleDict

from torchtitan_cp.models.blocks.attention_cp import DEFAULT_ATTENTION_CP, AttentionCP
from torchtitan_cp.models.blocks.flex import AttentionBackend, resolve_attention_backend
from torchtitan_cp.models.blocks.init import linear, linear_config
from torchtitan_cp.models.blocks.routed_decoder import RoutedDecoder
from torchtitan_cp.models.context import SequenceContext
from torchtitan_cp.models.hybrid.layers import (
    LAYERS,
    LayerOptions,
    check_backend,
    parse_layer_pattern,
)

__all__ = ["HybridBlock", "HybridDecoder", "parse_layer_pattern"]


def _norm(dim: int, eps: float) -> RMSNorm:
    return RMSNorm.Config(normalized_shape=dim, eps=eps).build()


class HybridBlock(Module):
    """Pre-norm residual block: ``x + mixer(norm(x)); x + ffn(norm(x))``."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        mixer: Module.Config  # a registered kind's mixer (models.hybrid.layers)
        dim: int
        ffn_hidden_dim: int
        norm_eps: float = 1e-5
        layer_id: int = 0

    def __init__(self, config: Config):
        super().__init__()
        self.mixer = config.mixer.build()
        self.attention_norm = _norm(config.dim, config.norm_eps)
        self.ffn_norm = _norm(config.dim, config.norm_eps)
        out_std = 0.02 / math.sqrt(2 * (config.layer_id + 1))
        self.feed_forward = FeedForward.Config(
            w1=linear_config(config.dim, config.ffn_hidden_dim),
            w2=linear_config(config.ffn_hidden_dim, config.dim, std=out_std),
            w3=linear_config(config.dim, config.ffn_hidden_dim),
        ).build()

    def forward(
        self, x: torch.Tensor, ctx: SequenceContext, positions: torch.Tensor | None
    ) -> torch.Tensor:
        x = x + self.mixer(self.attention_norm(x), ctx, positions)
        return x + self.feed_forward(self.ffn_norm(x))


class HybridDecoder(RoutedDecoder, BaseModel):
    """Token embedding, hybrid blocks, final norm, LM head.

    ``forward(tokens [B, L_local], positions [B, L_local] | None, seq_ctx)`` returns logits
    ``[B, L_local, vocab]`` (or hidden states when the trainer's chunked loss applies the head).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseModel.Config):
        vocab_size: int
        """Tokens of the embedding and the LM head (at least the tokenizer's vocabulary)."""
        dim: int
        """Model width: the residual stream's channels."""
        layer_pattern: str
        """One letter per layer, a kind of ``models/hybrid/layers.py``'s registry: K (KDA),
        G (GDN), A (softmax attention), M (Mamba2), R (RetNet retention); e.g. KKKA."""
        n_heads: int
        """Heads of the linear-attention layers (KDA, GDN, retention)."""
        head_dim: int
        """Query/key channels per head of the linear-attention layers."""
        value_head_dim: int | None = None
        """Value channels per head of the linear-attention layers (None: head_dim)."""
        attn_n_heads: int
        """Query heads of the softmax attention layers."""
        attn_n_kv_heads: int
        """Key/value heads of the softmax attention layers (grouped-query attention: divides
        attn_n_heads)."""
        attn_head_dim: int
        """Channels per head of the softmax attention layers."""
        ffn_hidden_dim: int
        """Hidden units of every block's SwiGLU feed-forward."""
        norm_eps: float = 1e-5
        """Epsilon of the RMSNorms (blocks, final norm, the mixers' gated norms)."""
        conv_width: int = 4
        """Width of the causal depthwise convolution before the recurrence (KDA, GDN, Mamba2;
        under CP each rank reads conv_width - 1 tokens of history)."""
        use_rope: bool = True
        """RoPE on the softmax attention's queries and keys; false: NoPE."""
        rope_theta: float = 10000.0
        """RoPE base (softmax attention, and retention's rotary positions)."""
        max_seq_len: int = 131072
        """Longest row the model takes (training.seq_len must not exceed it)."""
        enable_weight_tying: bool = False
        """Share the embedding's weight with the LM head."""
        linear_attention_backend: Literal["auto", "torch", "fla"] = "auto"
        """Kernels of the linear-attention layers (set by ``[linear_attention] backend``)."""
        attention_backend: AttentionBackend = "auto"
        """Softmax attention kernel: flex (torchtitan's FlexAttention with the document
        BlockMask; CUDA), sdpa (an explicit document mask), auto = flex on CUDA, sdpa
        elsewhere."""
        attention_cp: AttentionCP = DEFAULT_ATTENTION_CP
        """How softmax attention's keys/values cross CP ranks: all_gather (every rank gathers
        the whole stream's K/V) or pass_kv (K/V blocks travel point to point between the
        ranks whose documents meet)."""
        layer_options: LayerOptions = field(default_factory=LayerOptions)
        """Per-kind sizes the shared fields do not cover."""

        def uses_flex_attention(self, device_type: str | torch.device) -> bool:
            """Whether the softmax attention layers run flex attention on ``device_type`` (and
            so every microbatch needs a document ``BlockMask``)."""
            parse_layer_pattern(self.layer_pattern)
            return any(LAYERS[c].flex_mask for c in self.layer_pattern) and (
                resolve_attention_backend(self.attention_backend, device_type) == "flex"
            )

        def update_from_config(self, *, config, **kwargs) -> None:
            seq_len = config.training.seq_len
            if seq_len > self.max_seq_len:
                raise ValueError(
                    f"training.seq_len ({seq_len}) exceeds model.max_seq_len ({self.max_seq_len})"
                )
            la = getattr(config, "linear_attention", None)
            if la is not None:
                check_backend(self.layer_pattern, la.backend)
                self.linear_attention_backend = la.backend

        def get_nparams_and_flops(self, model: nn.Module, seq_len: int) -> tuple[int, int]:
            nparams = sum(p.numel() for p in model.parameters())
            emb = sum(p.numel() for p in model.get_submodule("tok_embeddings").parameters())
            matmul_params = nparams if self.enable_weight_tying else nparams - emb
            parse_layer_pattern(self.layer_pattern)
            mixers = sum(LAYERS[c].flops(self, seq_len) for c in self.layer_pattern)
            return nparams, 6 * matmul_params + mixers

    def __init__(self, config: Config):
        super().__init__()
        self.config = config
        parse_layer_pattern(config.layer_pattern)
        self.tok_embeddings = Embedding.Config(
            num_embeddings=config.vocab_size,
            embedding_dim=config.dim,
            param_init={"weight": nn.init.normal_},
        ).build()
        self.layers = ModuleDict()
        for i, letter in enumerate(config.layer_pattern):
            mixer = LAYERS[letter].build(config, i)
            self.layers[str(i)] = HybridBlock.Config(
                mixer=mixer,
                dim=config.dim,
                ffn_hidden_dim=config.ffn_hidden_dim,
                norm_eps=config.norm_eps,
                layer_id=i,
            ).build()
        self.norm = _norm(config.dim, config.norm_eps)
        s = config.dim**-0.5
        self.lm_head = linear(config.dim, config.vocab_size, std=s)
        self.enable_weight_tying = config.enable_weight_tying
        if self.enable_weight_tying:
            self.tok_embeddings.weight = self.lm_head.weight

    # Set by torchtitan's trainer when its chunked loss applies the LM head itself.
    _skip_lm_head: bool = False

    def routed_forward(
        self, tokens: torch.Tensor, positions: torch.Tensor | None, seq_ctx: SequenceContext
    ) -> torch.Tensor:
        # Under pipeline parallelism a stage holds some of the modules (torchtitan's split sets
        # the others to None): a later stage's ``tokens`` are the previous stage's hidden
        # states [B, L_local, dim], and a stage before the last returns its hidden states.
        if positions is None:  # each row is one document: RoPE positions restart per row
            positions = torch.arange(tokens.shape[1], device=tokens.device)
            positions = positions.expand(tokens.shape[0], -1)
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h, seq_ctx, positions)
        if self.norm is not None:
            h = self.norm(h)
        if self._skip_lm_head or self.lm_head is None:
            return h
        return self.lm_head(h)
