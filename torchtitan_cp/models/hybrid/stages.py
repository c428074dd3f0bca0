"""Where the hybrid decoder's pipeline stages fall: its layers' costs under
``models.blocks.pipeline``'s cost model."""

from __future__ import annotations

import torch
from torch import nn

from torchtitan_cp.models.blocks.pipeline import StagePlan, decoder_stage_plan
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
    flops = [LAYERS[c].flops(cfg, seq_len) for c in cfg.layer_pattern]
    head = 6 * cfg.dim * cfg.vocab_size
    return decoder_stage_plan(model, cfg.layer_pattern, flops, head, n_stages, split)
