"""Where the hybrid decoder's pipeline stages fall: its layers' costs under
``models.blocks.pipeline``'s cost model."""

from __future__ import annotations

import torch
from torch import nn

from torchtitan_cp.models.blocks.pipeline import StagePlan
from torchtitan_cp.models.hybrid.decoder import HybridDecoder
from torchtitan_cp.models.hybrid.layers import LAYERS

__all__ = ["stage_plan"]


def stage_plan(
    cfg: HybridDecoder.Config,
    n_stages: int,
    seq_len: int,
    split: str = "",
    model: nn.Module | None = None,
) -> StagePlan:
    """Where the hybrid decoder's pipeline stages fall (``models.blocks.pipeline``'s cost
    model): each block ``6 x its parameters + LAYERS[letter].flops(cfg, seq_len)`` FLOPs per
    token, the LM head ``6 x dim x vocab``. ``model``: the built decoder (else one is built on
    the meta device to count the parameters)."""
    if model is None:
        with torch.device("meta"):
            model = HybridDecoder(cfg)
    costs = [
        6 * sum(p.numel() for p in model.get_submodule(f"layers.{i}").parameters())
        + LAYERS[c].flops(cfg, seq_len)
        for i, c in enumerate(cfg.layer_pattern)
    ]
    return StagePlan.build(cfg.layer_pattern, costs, 6 * cfg.dim * cfg.vocab_size, n_stages, split)
