"""The layer registry: every ``layer_pattern`` letter maps to one ``LayerKind`` here.

A kind says how to build its mixer's config from the model config, how many FLOPs per token
its mixer adds beyond its parameters' matmuls, and whether it needs the document ``BlockMask``
of flex attention. The decoder, its FLOPs count, init and parallelize only ever ask this table.
A layer kind's own sizes live in ``LayerOptions`` (``[model.layer_options.<name>]``), so adding
a kind is its module plus two lines here (docs/architecture.md, "Adding a layer kind").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torchtitan.protocols.module import Module

from torchtitan_cp.models.mixers.attention import SoftmaxAttention
from torchtitan_cp.models.mixers.delta_net import DeltaNetMixer, GDNMixer, KDAMixer
from torchtitan_cp.models.mixers.mamba2 import Mamba2Mixer, Mamba2Options

__all__ = ["LAYERS", "LayerKind", "LayerOptions", "parse_layer_pattern"]

# Chunk length of the linear-attention kernels (FLOPs of their intra-chunk work).
_CHUNK = 64


@dataclass(kw_only=True, slots=True)
class LayerOptions:
    """``[model.layer_options]``: per-kind sizes that the shared model fields do not cover."""

    mamba2: Mamba2Options = field(default_factory=Mamba2Options)


@dataclass(frozen=True)
class LayerKind:
    """One letter of ``layer_pattern``.

    ``mixer(cfg, layer_id)`` builds the mixer's ``Module.Config`` from ``HybridDecoder.Config``;
    the mixer's forward is ``(x [B, L, D], ctx, positions [B, L] | None) -> [B, L, D]``.
    ``flops(cfg, seq_len)``: training FLOPs per token (forward + backward) beyond the mixer's
    parameter matmuls. ``flex_mask``: needs the document ``BlockMask`` when flex runs.
    ``compiles``: its kernels run under ``torch.compile`` without graph breaks (custom ops in
    ``ops/<family>/custom_ops.py``); ``compile.enable`` with a kind that does not is a config
    error. Every shipped kind compiles.
    """

    name: str
    description: str
    mixer: Callable[[Any, int], Module.Config]
    flops: Callable[[Any, int], int]
    flex_mask: bool = False
    compiles: bool = True


def _delta_net(mixer: type[DeltaNetMixer]) -> Callable[[Any, int], Module.Config]:
    def build(cfg: Any, layer_id: int) -> Module.Config:
        return mixer.Config(
            dim=cfg.dim, n_heads=cfg.n_heads, head_dim=cfg.head_dim,
            value_head_dim=cfg.value_head_dim, conv_width=cfg.conv_width, norm_eps=cfg.norm_eps,
            layer_id=layer_id, backend=cfg.linear_attention_backend,
        )  # fmt: skip

    return build


def _delta_flops(cfg: Any, seq_len: int) -> int:
    # Per token and head: state update and readout, each ~2·K·V MACs, plus the chunked
    # intra-chunk work (~chunk·(K+V)).
    k, v = cfg.head_dim, cfg.value_head_dim or cfg.head_dim
    return 6 * cfg.n_heads * (4 * k * v + _CHUNK * (k + v))


def _attention(cfg: Any, layer_id: int) -> Module.Config:
    return SoftmaxAttention.Config(
        dim=cfg.dim, n_heads=cfg.attn_n_heads, n_kv_heads=cfg.attn_n_kv_heads,
        head_dim=cfg.attn_head_dim, use_rope=cfg.use_rope, rope_theta=cfg.rope_theta,
        layer_id=layer_id, backend=cfg.attention_backend, cp_mode=cfg.attention_cp,
    )  # fmt: skip


def _attention_flops(cfg: Any, seq_len: int) -> int:
    # QK^T and PV over the (causal, un-sparsified) context.
    return 6 * cfg.attn_n_heads * 2 * cfg.attn_head_dim * seq_len


LAYERS: dict[str, LayerKind] = {
    "K": LayerKind("kda", "KDA (Kimi Delta Attention)", _delta_net(KDAMixer), _delta_flops),
    "G": LayerKind("gdn", "GDN (Gated DeltaNet)", _delta_net(GDNMixer), _delta_flops),
    "A": LayerKind("attention", "softmax attention", _attention, _attention_flops, True),
    "M": LayerKind("mamba2", "Mamba2 (SSD)", Mamba2Mixer.from_model, Mamba2Mixer.flops),
}


def parse_layer_pattern(pattern: str) -> list[str]:
    """``"KKGA"`` -> ``["kda", "kda", "gdn", "attention"]``; an unknown letter is a ValueError."""
    letters = ", ".join(f"{c} ({k.description})" for c, k in LAYERS.items())
    if not pattern:
        raise ValueError(f"model.layer_pattern must not be empty (use letters {letters})")
    bad = sorted({c for c in pattern if c not in LAYERS})
    if bad:
        raise ValueError(
            f"model.layer_pattern {pattern!r} has unknown layer letter(s) {', '.join(bad)}; "
            f"use {letters}"
        )
    return [LAYERS[c].name for c in pattern]
