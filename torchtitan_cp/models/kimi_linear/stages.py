"""Where Kimi Linear's pipeline stages fall: its layers' costs under ``models.blocks.pipeline``'s
cost model, one letter per layer (K: KDA, A: MLA)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from torchtitan_cp.models.blocks.heads import attention_flops, recurrence_flops
from torchtitan_cp.models.blocks.pipeline import StagePlan, decoder_stage_plan

__all__ = ["PATTERN_NAME", "layer_flops", "layer_letters", "stage_plan"]

PATTERN_NAME = "the kimi_linear layers (K: KDA, A: MLA; model.n_layers keeps the first)"
"""What the stage messages call Kimi Linear's layer letters (it has no ``layer_pattern`` key)."""


def layer_letters(cfg: Any) -> str:
    """``"KKKA"``-style letters of the layer stack: K for a KDA layer, A for MLA."""
    return "".join("A" if lay.attention is not None else "K" for lay in cfg.layers)


def layer_flops(layer: Any, seq_len: int) -> int:
    """Training FLOPs per token of one layer (a ``KimiLinearBlock.Config``) beyond its
    parameter matmuls: MLA's ``attention_flops`` (q/k heads of nope + rope channels, values of
    ``v_head_dim``) or KDA's ``recurrence_flops``."""
    a = layer.attention
    if a is not None:
        qk = a.qk_nope_head_dim + a.qk_rope_head_dim
        return attention_flops(a.n_heads, qk, seq_len, a.v_head_dim)
    return recurrence_flops(layer.kda.n_heads, layer.kda.head_dim, layer.kda.v_dim)


def stage_plan(
    cfg: Any, n_stages: int, seq_len: int, split: str = "", model: nn.Module | None = None
) -> StagePlan:
    """Where Kimi Linear's pipeline stages fall (``decoder_stage_plan``: each block ``6 x
    params_per_token + layer_flops`` FLOPs per token, the LM head ``6 x dim x vocab``). ``model``:
    the built model (else one is built on the meta device to count the parameters)."""
    if model is None:
        with torch.device("meta"):
            model = cfg.build()
    assert model is not None
    flops = [layer_flops(lay, seq_len) for lay in cfg.layers]
    head = 6 * cfg.dim * cfg.vocab_size
    return decoder_stage_plan(model, layer_letters(cfg), flops, head, n_stages, split, PATTERN_NAME)
