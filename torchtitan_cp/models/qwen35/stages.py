"""Where Qwen3.5's pipeline stages fall: its layers' costs under ``models.blocks.pipeline``'s
cost model, its layer letters those of ``qwen35_layers_summary`` (G: GatedDeltaNet, A: gated
attention)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from torchtitan_cp.models.blocks.heads import attention_flops, recurrence_flops
from torchtitan_cp.models.blocks.pipeline import StagePlan, decoder_stage_plan
from torchtitan_cp.models.qwen35.model import qwen35_layers_summary

__all__ = ["PATTERN_NAME", "layer_flops", "stage_plan"]

PATTERN_NAME = "the qwen3_5 layers (G: GatedDeltaNet, A: attention; model.n_layers keeps the first)"
"""What the stage messages call Qwen3.5's layer letters (it has no ``layer_pattern`` key)."""


def layer_flops(layer: Any, seq_len: int) -> int:
    """Training FLOPs per token of one Qwen3.5 layer (a ``Qwen35TransformerBlock.Config``)
    beyond its parameter matmuls: its attention's ``attention_flops`` or its GatedDeltaNet's
    ``recurrence_flops`` over the value heads."""
    if layer.attention is not None:
        return attention_flops(layer.attention.n_heads, layer.attention.head_dim, seq_len)
    dn = layer.delta_net
    return recurrence_flops(dn.in_proj_a.out_features, dn.key_head_dim, dn.value_head_dim)


def stage_plan(
    cfg: Any, n_stages: int, seq_len: int, split: str = "", model: nn.Module | None = None
) -> StagePlan:
    """Where Qwen3.5's pipeline stages fall (``models.blocks.pipeline``'s cost model): each
    block ``6 x params_per_token + layer_flops`` FLOPs per token (``decoder_stage_plan``), the LM head
    ``6 x dim x vocab``. ``model``: the built model (else one is built on the meta device to
    count the parameters)."""
    if model is None:
        with torch.device("meta"):
            model = cfg.build()
    assert model is not None
    flops = [layer_flops(lay, seq_len) for lay in cfg.layers]
    pattern, head = qwen35_layers_summary(cfg), 6 * cfg.dim * cfg.vocab_size
    return decoder_stage_plan(model, pattern, flops, head, n_stages, split, PATTERN_NAME)
