"""The short causal convolution layer: per document, SiLU, its CP history exchange included."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torchtitan.protocols.module import Module

from torchtitan_cp.models.context import SequenceContext
from torchtitan_cp.ops import Backend, causal_conv1d, context_parallel_conv_history

__all__ = ["ShortConvolution"]


class ShortConvolution(Module):
    """Causal depthwise convolution over the packed stream, per document, SiLU activation.

    Weight ``[D, W]``; input/output ``[1, T, D]``.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        channels: int
        width: int = 4

    def __init__(self, config: Config):
        super().__init__()
        self.width = config.width
        self.weight = nn.Parameter(torch.empty(config.channels, config.width))

    def reset_parameters(self) -> None:
        # nn.Conv1d's default for a depthwise kernel: fan_in = width.
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))

    def forward(self, x: torch.Tensor, ctx: SequenceContext, backend: Backend) -> torch.Tensor:
        routing = ctx.routing
        history = None
        if ctx.cp_enabled:
            # Tokens before each continued fragment come from the ranks that own them.
            history = context_parallel_conv_history(x, routing=routing, group=ctx.group)
        return causal_conv1d(
            x,
            self.weight,
            None,
            cu_seqlens=routing.cu_seqlens,
            cu_seqlens_cpu=routing.cu_seqlens_cpu,
            chunk_indices=routing.chunk_indices,
            initial_state=history,
            activation="silu",
            backend=backend,
        )
