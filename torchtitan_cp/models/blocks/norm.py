"""Gated RMSNorms of the linear-attention mixers: per head (KDA, GDN) and per group (Mamba2)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn
from torchtitan.protocols.module import Module

from torchtitan_cp.models.blocks.tensor_parallel import local
from torchtitan_cp.ops.common.dtypes import compute_dtype

__all__ = ["L2NORM_EPS", "GatedGroupRMSNorm", "GatedRMSNorm", "fla_l2norm"]

L2NORM_EPS = 1e-6  # fla-core's l2norm_fwd default, used by use_qk_l2norm_in_kernel


class GatedRMSNorm(Module):
    """RMSNorm over the head dimension followed by an output gate: ``norm(o) * act(gate)``."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        dim: int
        eps: float = 1e-5
        activation: Literal["sigmoid", "silu"] = "silu"

    def __init__(self, config: Config):
        super().__init__()
        self.eps = config.eps
        self.activation = config.activation
        self.weight = nn.Parameter(torch.empty(config.dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = o.dtype
        acc = compute_dtype(dtype)
        o32 = o.to(acc)
        o32 = o32 * torch.rsqrt(o32.pow(2).mean(-1, keepdim=True) + self.eps)
        gate = gate.to(acc)
        act = torch.sigmoid(gate) if self.activation == "sigmoid" else F.silu(gate)
        return (o32 * local(self.weight).to(acc) * act).to(dtype)


class GatedGroupRMSNorm(Module):
    """The reference's ``RMSNormGated(norm_before_gate=False)``: ``rmsnorm(y * silu(z))`` over
    groups of ``group_size`` channels, then a weight. ``y, z [.., D]``."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        dim: int
        group_size: int
        eps: float = 1e-5

    def __init__(self, config: Config):
        super().__init__()
        self.eps, self.group_size = config.eps, config.group_size
        self.weight = nn.Parameter(torch.empty(config.dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        acc = compute_dtype(y.dtype)
        u = (y.to(acc) * F.silu(z.to(acc))).unflatten(-1, (-1, self.group_size))
        u = (u * torch.rsqrt(u.pow(2).mean(-1, keepdim=True) + self.eps)).flatten(-2)
        return (u * local(self.weight).to(acc)).to(y.dtype)


def fla_l2norm(x: torch.Tensor) -> torch.Tensor:
    """fla-core's ``l2norm_fwd`` in PyTorch: ``x * rsqrt(sum(x^2) + 1e-6)`` over the last dim,
    accumulated in float32 (float64 for float64 input), returned in x's dtype."""
    acc = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(acc)
    return (xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + L2NORM_EPS)).to(x.dtype)
