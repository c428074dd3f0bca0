"""The hybrid decoder: a stack of KDA / GDN / softmax-attention blocks chosen by a layer pattern."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn
from torchtitan.models.common.embedding import Embedding
from torchtitan.models.common.feed_forward import FeedForward
from torchtitan.models.common.nn_modules import RMSNorm
from torchtitan.protocols.model import BaseModel
from torchtitan.protocols.module import Module, ModuleDict

from torchtitan_cp.models.attention import (
    AttentionBackend,
    SoftmaxAttention,
    resolve_attention_backend,
)
from torchtitan_cp.models.context import SequenceContext, context_from_device_positions
from torchtitan_cp.models.delta_net import DeltaNetMixer
from torchtitan_cp.models.init import linear, linear_config

LayerKind = Literal["kda", "gdn", "attention"]
LAYER_KINDS: dict[str, LayerKind] = {"K": "kda", "G": "gdn", "A": "attention"}


def parse_layer_pattern(pattern: str) -> list[LayerKind]:
    """``"KKGA"`` -> ``["kda", "kda", "gdn", "attention"]``; an unknown letter is a ValueError."""
    if not pattern:
        raise ValueError("model.layer_pattern must not be empty (use letters K, G, A)")
    bad = sorted({c for c in pattern if c not in LAYER_KINDS})
    if bad:
        raise ValueError(
            f"model.layer_pattern {pattern!r} has unknown layer letter(s) {', '.join(bad)}; "
            "use K (KDA), G (GDN) or A (softmax attention)"
        )
    return [LAYER_KINDS[c] for c in pattern]


def _norm(dim: int, eps: float) -> RMSNorm:
    return RMSNorm.Config(normalized_shape=dim, eps=eps).build()


class HybridBlock(Module):
    """Pre-norm residual block: ``x + mixer(norm(x)); x + ffn(norm(x))``."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        mixer: DeltaNetMixer.Config | SoftmaxAttention.Config
        dim: int
        ffn_hidden_dim: int
        norm_eps: float = 1e-5
        layer_id: int = 0

    def __init__(self, config: Config):
        super().__init__()
        self.is_attention = isinstance(config.mixer, SoftmaxAttention.Config)
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
        h = self.attention_norm(x)
        if self.is_attention:
            x = x + self.mixer(h, ctx, positions)
        else:
            x = x + self.mixer(h, ctx)
        return x + self.feed_forward(self.ffn_norm(x))


class HybridDecoder(BaseModel):
    """Token embedding, hybrid blocks, final norm, LM head.

    ``forward(tokens [B, L_local], positions [B, L_local] | None, seq_ctx)`` returns logits
    ``[B, L_local, vocab]`` (or hidden states when the trainer's chunked loss applies the head).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseModel.Config):
        vocab_size: int
        dim: int
        layer_pattern: str
        n_heads: int
        head_dim: int
        value_head_dim: int | None = None
        attn_n_heads: int
        attn_n_kv_heads: int
        attn_head_dim: int
        ffn_hidden_dim: int
        norm_eps: float = 1e-5
        conv_width: int = 4
        use_rope: bool = True
        rope_theta: float = 10000.0
        max_seq_len: int = 131072
        enable_weight_tying: bool = False
        linear_attention_backend: Literal["auto", "torch", "fla"] = "auto"
        attention_backend: AttentionBackend = "auto"

        def uses_flex_attention(self, device_type: str | torch.device) -> bool:
            """Whether the softmax attention layers run flex attention on ``device_type`` (and
            so every microbatch needs a document ``BlockMask``)."""
            return "attention" in parse_layer_pattern(self.layer_pattern) and (
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
                self.linear_attention_backend = la.backend

        def get_nparams_and_flops(self, model: nn.Module, seq_len: int) -> tuple[int, int]:
            nparams = sum(p.numel() for p in model.parameters())
            emb = sum(p.numel() for p in model.get_submodule("tok_embeddings").parameters())
            matmul_params = nparams if self.enable_weight_tying else nparams - emb
            kinds = parse_layer_pattern(self.layer_pattern)
            n_attn = kinds.count("attention")
            v = self.value_head_dim or self.head_dim
            # Softmax attention: QK^T and PV over the (causal, un-sparsified) context.
            attn = 6 * n_attn * self.attn_n_heads * 2 * self.attn_head_dim * seq_len
            # Delta rule per token and head: state update and readout, each ~2·K·V MACs, plus
            # the chunked intra-chunk work (~chunk·(K+V)); chunk = 64.
            linear_layers = len(kinds) - n_attn
            delta = (
                6
                * linear_layers
                * self.n_heads
                * (4 * self.head_dim * v + 64 * (self.head_dim + v))
            )
            return nparams, 6 * matmul_params + attn + delta

    def __init__(self, config: Config):
        super().__init__()
        self.config = config
        kinds = parse_layer_pattern(config.layer_pattern)
        self.tok_embeddings = Embedding.Config(
            num_embeddings=config.vocab_size,
            embedding_dim=config.dim,
            param_init={"weight": nn.init.normal_},
        ).build()
        self.layers = ModuleDict()
        for i, kind in enumerate(kinds):
            if kind == "attention":
                mixer = SoftmaxAttention.Config(
                    dim=config.dim,
                    n_heads=config.attn_n_heads,
                    n_kv_heads=config.attn_n_kv_heads,
                    head_dim=config.attn_head_dim,
                    use_rope=config.use_rope,
                    rope_theta=config.rope_theta,
                    layer_id=i,
                    backend=config.attention_backend,
                )
            else:
                mixer = DeltaNetMixer.Config(
                    kind=kind,
                    dim=config.dim,
                    n_heads=config.n_heads,
                    head_dim=config.head_dim,
                    value_head_dim=config.value_head_dim,
                    conv_width=config.conv_width,
                    norm_eps=config.norm_eps,
                    layer_id=i,
                    backend=config.linear_attention_backend,
                )
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

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        seq_ctx: SequenceContext | None = None,
    ) -> torch.Tensor:
        if seq_ctx is None:
            # A direct call (custom loader, evaluation script) without host metadata: derive
            # the documents from the device positions, which costs a device->host copy.
            seq_ctx = context_from_device_positions(
                tokens, positions, flex_mask=self.config.uses_flex_attention(tokens.device)
            )
        if positions is None:  # each row is one document: RoPE positions restart per row
            positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, seq_ctx, positions)
        h = self.norm(h)
        if self._skip_lm_head:
            return h
        return self.lm_head(h)
