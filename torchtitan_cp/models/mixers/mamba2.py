"""Mamba2 (SSD) token mixer, as in "Transformers are SSMs" (Dao & Gu, 2024) and its reference
``Mamba2`` module: one input projection to ``[z | x | B | C | dt]``, a causal depthwise conv with
SiLU over ``[x | B | C]``, ``dt = softplus(dt + dt_bias)``, a scalar per-head decay
``exp(dt * A)`` with ``A = -exp(A_log)``, dt-scaled inputs, the SSD recurrence
(``ops/ssd``), a ``D`` skip, a gated RMSNorm ``rmsnorm(y * silu(z))`` (per group) and an output projection.

Every document starts from a zero state and zero conv history; under context parallelism both
are carried in from other ranks (the conv halo and the generic recurrence driver).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torchtitan.protocols.module import Module

from torchtitan_cp.models.blocks.conv import ShortConvolution
from torchtitan_cp.models.blocks.dtypes import upcast
from torchtitan_cp.models.blocks.init import linear
from torchtitan_cp.models.blocks.norm import GatedGroupRMSNorm
from torchtitan_cp.models.context import SequenceContext
from torchtitan_cp.ops import Backend
from torchtitan_cp.ops.ssd.local import chunk_ssd
from torchtitan_cp.ops.ssd.recurrence import context_parallel_ssd

__all__ = ["Mamba2Mixer", "Mamba2Options"]


@dataclass(kw_only=True, slots=True)
class Mamba2Options:
    """``[model.layer_options.mamba2]``: sizes of the M layers (defaults: the reference's)."""

    expand: int = 2
    """Inner width = expand * model.dim; it is n_heads * head_dim."""
    head_dim: int = 64
    """Channels per SSD head (the reference's headdim)."""
    state_dim: int = 128
    """SSM state size per head (d_state)."""
    n_groups: int = 1
    """Groups sharing B and C (ngroups); divides the number of heads."""


def _check_sizes(dim: int, opt: Mamba2Options) -> None:
    d_inner = opt.expand * dim
    if min(opt.expand, opt.head_dim, opt.state_dim, opt.n_groups) < 1:
        raise ValueError(f"model.layer_options.mamba2: every size must be >= 1, got {opt}")
    if d_inner % opt.head_dim or (d_inner // opt.head_dim) % opt.n_groups:
        raise ValueError(
            f"model.layer_options.mamba2: expand*dim = {d_inner} must be a multiple of "
            f"head_dim = {opt.head_dim}, and its {d_inner // opt.head_dim} heads a multiple of "
            f"n_groups = {opt.n_groups}"
        )


class Mamba2Mixer(Module):
    """Mamba2 token mixer. Input/output ``[B, L, D]``; B·L is the local span."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        dim: int
        options: Mamba2Options
        conv_width: int = 4
        norm_eps: float = 1e-5
        layer_id: int = 0
        backend: Backend = "auto"

    @staticmethod
    def from_model(cfg: Any, layer_id: int) -> Mamba2Mixer.Config:
        """The mixer of layer ``layer_id`` of a ``HybridDecoder.Config`` (the registry's hook);
        a ValueError naming the keys when the sizes do not fit together."""
        _check_sizes(cfg.dim, cfg.layer_options.mamba2)
        return Mamba2Mixer.Config(
            dim=cfg.dim, options=cfg.layer_options.mamba2, conv_width=cfg.conv_width,
            norm_eps=cfg.norm_eps, layer_id=layer_id, backend=cfg.linear_attention_backend,
        )  # fmt: skip

    @staticmethod
    def flops(cfg: Any, seq_len: int) -> int:
        """Training FLOPs per token beyond the parameter matmuls: per head, state update and
        readout ~2·N·P MACs each, plus the intra-chunk work ~64·(N+P)."""
        o = cfg.layer_options.mamba2
        h = o.expand * cfg.dim // o.head_dim
        return 6 * h * (4 * o.state_dim * o.head_dim + 64 * (o.state_dim + o.head_dim))

    def __init__(self, config: Config):
        super().__init__()
        opt = config.options
        _check_sizes(config.dim, opt)
        d_inner = opt.expand * config.dim
        self.n_heads = h = d_inner // opt.head_dim
        self.head_dim, self.state_dim, self.n_groups = opt.head_dim, opt.state_dim, opt.n_groups
        self.d_inner = d_inner
        self.backend = config.backend
        bc = 2 * opt.n_groups * opt.state_dim
        self.in_proj = linear(config.dim, 2 * d_inner + bc + h)  # [z | x | B | C | dt]
        self.conv = ShortConvolution.Config(channels=d_inner + bc, width=config.conv_width).build()
        self.dt_bias = nn.Parameter(torch.empty(h))
        self.A_log = nn.Parameter(torch.empty(h))
        self.D = nn.Parameter(torch.empty(h))
        self.norm = GatedGroupRMSNorm.Config(
            dim=d_inner, group_size=d_inner // opt.n_groups, eps=config.norm_eps
        ).build()
        self.out_proj = linear(d_inner, config.dim, std=0.02 / math.sqrt(2 * (config.layer_id + 1)))

    def reset_parameters(self) -> None:
        # As the reference: A in [1, 16], dt in [1e-3, 1e-1] log-uniform, D = 1.
        with torch.no_grad():
            self.A_log.copy_(torch.empty_like(self.A_log).uniform_(1, 16).log())
            dt = torch.exp(
                torch.empty_like(self.dt_bias).uniform_(math.log(1e-3), math.log(1e-1))
            ).clamp_min(1e-4)
            self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus
            self.D.fill_(1.0)

    def forward(
        self, x: torch.Tensor, ctx: SequenceContext, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        h, p, n, ng = self.n_heads, self.head_dim, self.state_dim, self.n_groups
        xs = x.reshape(1, bsz * seqlen, -1)  # the local span as one packed stream
        z, xbc, dt = self.in_proj(xs).split([self.d_inner, self.d_inner + 2 * ng * n, h], -1)
        xbc = self.conv(xbc, ctx, self.backend)
        xx, B, C = xbc.split([self.d_inner, ng * n, ng * n], -1)
        xx = xx.unflatten(-1, (h, p))
        acc = upcast(xs.dtype)
        # Decay and step stay in at least float32: they are summed over long ranges.
        dt = F.softplus(dt.to(acc) + self.dt_bias.to(acc))  # [1, T, h]
        g = -torch.exp(self.A_log.to(acc)) * dt  # natural-log decay dt * A <= 0
        v = (xx.to(acc) * dt.unsqueeze(-1)).to(xs.dtype)  # dt-scaled inputs
        q, k = C.unflatten(-1, (ng, n)), B.unflatten(-1, (ng, n))
        if ctx.cp_enabled:
            y, _ = context_parallel_ssd(
                q, k, v, g, routing=ctx.routing, group=ctx.group, scale=1.0, backend=self.backend
            )
        else:
            r = ctx.routing
            y, _ = chunk_ssd(
                q, k, v, g, scale=1.0, cu_seqlens=r.cu_seqlens, cu_seqlens_cpu=r.cu_seqlens_cpu,
                backend=self.backend, chunk_indices=r.chunk_indices, chunk_offsets=r.chunk_offsets,
            )  # fmt: skip
        y = y.to(acc) + self.D.to(acc).unsqueeze(-1) * xx.to(acc)  # D skip
        y = self.norm(y.flatten(-2).to(xs.dtype), z)
        return self.out_proj(y).reshape(bsz, seqlen, -1)
