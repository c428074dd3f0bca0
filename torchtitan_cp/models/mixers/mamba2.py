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
from torchtitan_cp.models.blocks.heads import recurrence_flops
from torchtitan_cp.models.blocks.init import init_decay, linear
from torchtitan_cp.models.blocks.norm import GatedGroupRMSNorm
from torchtitan_cp.models.context import SequenceContext
from torchtitan_cp.ops import Backend
from torchtitan_cp.ops.common.dtypes import compute_dtype
from torchtitan_cp.ops.cp.recurrence import recurrence

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
    def from_model(cfg: Any, layer_id: int, backend: Backend) -> Mamba2Mixer.Config:
        """The mixer of layer ``layer_id`` of a ``HybridDecoder.Config`` (the registry's hook);
        a ValueError naming the keys when the sizes do not fit together."""
        _check_sizes(cfg.dim, cfg.layer_options.mamba2)
        return Mamba2Mixer.Config(
            dim=cfg.dim, options=cfg.layer_options.mamba2, conv_width=cfg.conv_width,
            norm_eps=cfg.norm_eps, layer_id=layer_id, backend=backend,
        )  # fmt: skip

    @staticmethod
    def tensor_parallel_heads(cfg: Any) -> list[tuple[str, int]]:
        """The registry's hook: Mamba2 does not shard over TP (yet). Its ``in_proj`` packs
        ``[z | x | B | C | dt]`` in one matrix (the reference's layout, kept for its
        checkpoints), so a column shard would hand a rank whole segments, not its heads of
        each; and its gated norm spans a whole group of heads."""
        raise ValueError(
            "layer M (Mamba2) cannot run under parallelism.tensor_parallel_degree > 1: its "
            "in_proj packs [z|x|B|C|dt] in one matrix, which a column shard would split by "
            "segment instead of by head; use K, G, R or A layers, or tensor_parallel_degree 1"
        )

    def parallelize_heads(self, mesh: Any) -> None:
        """Refused (``tensor_parallel_heads``)."""
        self.tensor_parallel_heads(None)

    @staticmethod
    def flops(cfg: Any, seq_len: int) -> int:
        """Training FLOPs per token beyond the parameter matmuls: ``recurrence_flops`` over
        the heads, K = state_dim (N), V = head_dim (P)."""
        o = cfg.layer_options.mamba2
        return recurrence_flops(o.expand * cfg.dim // o.head_dim, o.state_dim, o.head_dim)

    def __init__(self, config: Config):
        super().__init__()
        opt = config.options
        _check_sizes(config.dim, opt)
        d_inner = opt.expand * config.dim
        self.n_heads = h = d_inner // opt.head_dim
        self.head_dim, self.state_dim, self.n_groups = opt.head_dim, opt.state_dim, opt.n_groups
        self.d_inner = d_inner
        self.backend = config.backend
        # Mamba2 reads the state unscaled (C·h, no K^-1/2).
        self.recurrence = recurrence("ssd", scale=1.0, backend=config.backend)
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
        init_decay(self.A_log, self.dt_bias)  # as the reference, and D = 1
        with torch.no_grad():
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
        acc = compute_dtype(xs.dtype)
        # Decay and step stay in at least float32: they are summed over long ranges.
        dt = F.softplus(dt.to(acc) + self.dt_bias.to(acc))  # [1, T, h]
        g = -torch.exp(self.A_log.to(acc)) * dt  # natural-log decay dt * A <= 0
        v = (xx.to(acc) * dt.unsqueeze(-1)).to(xs.dtype)  # dt-scaled inputs
        q, k = C.unflatten(-1, (ng, n)), B.unflatten(-1, (ng, n))
        y = ctx.run_recurrence(self.recurrence, (q, k, v, g))
        y = y.to(acc) + self.D.to(acc).unsqueeze(-1) * xx.to(acc)  # D skip
        y = self.norm(y.flatten(-2).to(xs.dtype), z)
        return self.out_proj(y).reshape(bsz, seqlen, -1)
