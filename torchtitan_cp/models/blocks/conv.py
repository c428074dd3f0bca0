"""The short causal convolution layer: per document, SiLU, its CP history exchange included."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torchtitan.protocols.module import Module

from torchtitan_cp.models.blocks.tensor_parallel import distribute_parameter, head_rows, local
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
        # Under tensor parallelism: the weight rows of this rank's channels (parallelize_heads).
        self.tp_rows: list[tuple[int, int]] | None = None

    def reset_parameters(self) -> None:
        # nn.Conv1d's default for a depthwise kernel: fan_in = width.
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))

    def parallelize_heads(self, mesh: DeviceMesh, segments: list[int]) -> None:
        """Tensor parallelism over heads: the input is this rank's part of each of the
        channel ``segments`` (``[q | k | v]``). The weight stays whole on every rank (``W``
        values per channel: small) and each rank convolves with its rows; a contiguous
        ``Shard(0)`` would hand a rank whole segments instead of its heads of each."""
        distribute_parameter(self, "weight", mesh, shard=False)
        self.tp_rows = head_rows(segments, mesh.get_local_rank(), mesh.size())

    def forward(self, x: torch.Tensor, ctx: SequenceContext, backend: Backend) -> torch.Tensor:
        routing = ctx.routing
        weight = local(self.weight)
        if self.tp_rows is not None:
            weight = torch.cat([weight[a:b] for a, b in self.tp_rows])
        history = None
        if ctx.cp_enabled:
            # Tokens before each continued fragment come from the ranks that own them.
            history = context_parallel_conv_history(x, routing=routing, group=ctx.group)
        return causal_conv1d(
            x,
            weight,
            None,
            cu_seqlens=routing.cu_seqlens,
            cu_seqlens_cpu=routing.cu_seqlens_cpu,
            chunk_indices=routing.chunk_indices,
            initial_state=history,
            activation="silu",
            backend=backend,
        )
