"""Mamba2 (SSD) token mixer, as in "Transformers are SSMs" (Dao & Gu, 2024) and its reference
``Mamba2`` module: the input projections to ``z``, ``x``, ``B``, ``C`` and ``dt`` (the reference
packs them in one ``in_proj``; here one matrix each, so that tensor parallelism shards each by
group), a causal depthwise conv with SiLU over ``[x | B | C]``, ``dt = softplus(dt + dt_bias)``, a scalar per-head decay
``exp(dt * A)`` with ``A = -exp(A_log)``, dt-scaled inputs, the SSD recurrence
(``ops/ssd``), a ``D`` skip, a gated RMSNorm ``rmsnorm(y * silu(z))`` (per group) and an output projection.

Every document starts from a zero state and zero conv history; under context parallelism both
are carried in from other ranks (the conv halo and the generic recurrence driver).

Tensor parallelism (Megatron-Core's rule for Mamba): the degree divides ``n_groups`` and each
rank holds whole B/C groups with the heads that read them, so the group norm stays local and
the layer needs no collective beyond the plan's input gather and output reduce-scatter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module
from torchtitan.protocols.module import Module

from torchtitan_cp.models.blocks.conv import ShortConvolution
from torchtitan_cp.models.blocks.heads import config_from_model, recurrence_flops
from torchtitan_cp.models.blocks.init import init_decay, linear
from torchtitan_cp.models.blocks.norm import GatedGroupRMSNorm
from torchtitan_cp.models.blocks.tensor_parallel import (
    column_input,
    distribute_parameter,
    local,
    tp_heads,
)
from torchtitan_cp.models.context import SequenceContext
from torchtitan_cp.ops import Backend
from torchtitan_cp.ops.common.dtypes import compute_dtype
from torchtitan_cp.ops.cp.recurrence import recurrence
from torchtitan_cp.run.retired import retire_parameter

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

    # The reference's in_proj rows, in its order ``[z | x | B | C | dt]``, one weight each
    # (``<name>.weight``): a contiguous shard of each is a rank's groups and their heads, where
    # a shard of the packed matrix would hand a rank whole segments.
    in_projections = ("z_proj", "x_proj", "B_proj", "C_proj", "dt_proj")

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
        a ValueError naming the keys when the sizes do not fit together. ``dim``,
        ``conv_width``, ``norm_eps``: the decoder's fields of those names."""
        _check_sizes(cfg.dim, cfg.layer_options.mamba2)
        return config_from_model(
            Mamba2Mixer.Config,
            cfg,
            options=cfg.layer_options.mamba2,
            layer_id=layer_id,
            backend=backend,
        )

    @staticmethod
    def tensor_parallel_heads(cfg: Any) -> list[tuple[str, int]]:
        """The count TP must divide (the registry's hook): the B/C groups. A rank holds whole
        groups with their heads (the heads of a group are contiguous, and ``n_groups`` divides
        the heads), so the per-group norm never spans two ranks."""
        return [("model.layer_options.mamba2.n_groups", cfg.layer_options.mamba2.n_groups)]

    def parallelize_heads(self, mesh: DeviceMesh) -> None:
        """Tensor parallelism over groups on the TP ``mesh``: each input projection's weight
        column-wise (head-major ``z``, ``x``, ``dt`` and group-major ``B``, ``C``: a contiguous
        shard of each is the rank's groups and their heads), the output projection row-wise
        into the sequence-parallel layout, ``A_log`` / ``dt_bias`` / ``D`` and the norm's
        per-channel weight sharded with their heads, the conv over its rank's rows of
        ``[x | B | C]`` (``ShortConvolution.parallelize_heads``). The forward then runs on the
        rank's groups."""
        tp_heads(mesh, self.n_groups, "model.layer_options.mamba2.n_groups")
        # Column-wise by hand: each weight Shard(0), as ColwiseParallel shards a Linear's, but
        # the forward reads the five as one matrix (``_in_proj``), which ColwiseParallel's
        # per-module forward hooks cannot express.
        for name in self.in_projections:
            distribute_parameter(self.get_submodule(name), "weight", mesh, shard=True)
        parallelize_module(self, mesh, {"out_proj": RowwiseParallel(output_layouts=Shard(1))})
        bc = self.n_groups * self.state_dim
        self.conv.parallelize_heads(mesh, [self.d_inner, bc, bc])
        for name in ("A_log", "dt_bias", "D"):
            distribute_parameter(self, name, mesh, shard=True)
        distribute_parameter(self.norm, "weight", mesh, shard=True)

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
        bc = opt.n_groups * opt.state_dim
        # Holders of the weights (init, sharding, checkpoint names): _in_proj reads them.
        self.z_proj, self.x_proj = linear(config.dim, d_inner), linear(config.dim, d_inner)
        self.B_proj, self.C_proj = linear(config.dim, bc), linear(config.dim, bc)
        self.dt_proj = linear(config.dim, h)
        # One conv over [x | B | C] (the reference's weight): one kernel call and one history
        # exchange under CP.
        self.conv = ShortConvolution.Config(
            channels=d_inner + 2 * bc, width=config.conv_width
        ).build()
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

    def _in_proj(self, xs: torch.Tensor) -> torch.Tensor:
        """``[z | x | B | C | dt]`` of this rank's groups ``[1, T, 2·h·P + 2·g·N + h]`` from
        ``xs [1, T, D]``: one matmul over the five weights stacked, as the reference's packed
        in_proj computes it (five matmuls would give the same forward but sum the input's
        gradient in another order, off by an ulp). Under TP the weights are the rank's rows
        of each, and the input's gradient is summed over TP (``column_input``)."""
        weights = [self.get_parameter(f"{n}.weight") for n in self.in_projections]
        weight = torch.cat([local(w) for w in weights])
        return F.linear(column_input(xs, weights[0]), weight)

    def forward(
        self, x: torch.Tensor, ctx: SequenceContext, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        p, n = self.head_dim, self.state_dim
        xs = x.reshape(1, bsz * seqlen, -1)  # the local span as one packed stream
        proj = self._in_proj(xs)
        # This rank's heads and groups (all of them without TP): TP holds whole groups.
        share = proj.shape[-1], 2 * self.d_inner + 2 * self.n_groups * n + self.n_heads
        h, ng = self.n_heads * share[0] // share[1], self.n_groups * share[0] // share[1]
        z, xbc, dt = proj.split([h * p, h * p + 2 * ng * n, h], -1)
        xbc = self.conv(xbc, ctx, self.backend)
        xx, B, C = xbc.split([h * p, ng * n, ng * n], -1)
        xx = xx.unflatten(-1, (h, p))
        acc = compute_dtype(xs.dtype)
        # Decay and step stay in at least float32: they are summed over long ranges.
        dt = F.softplus(dt.to(acc) + local(self.dt_bias).to(acc))  # [1, T, h]
        g = -torch.exp(local(self.A_log).to(acc)) * dt  # natural-log decay dt * A <= 0
        v = (xx.to(acc) * dt.unsqueeze(-1)).to(xs.dtype)  # dt-scaled inputs
        q, k = C.unflatten(-1, (ng, n)), B.unflatten(-1, (ng, n))
        y = ctx.run_recurrence(self.recurrence, (q, k, v, g))
        y = y.to(acc) + local(self.D).to(acc).unsqueeze(-1) * xx.to(acc)  # D skip
        y = self.norm(y.flatten(-2).to(xs.dtype), z)
        # Rows back before the output projection: under TP it reduce-scatters over them.
        return self.out_proj(y.reshape(bsz, seqlen, -1))


# Checkpoints saved before the split hold the packed matrix: refused, naming it, not loaded
# with the projections left at their initial values.
retire_parameter(
    "mixer.in_proj.weight",
    "Mamba2's packed [z | x | B | C | dt] projection, split into z_proj, x_proj, B_proj, "
    "C_proj and dt_proj (its rows in that order) on 2026-12-03 so that tensor parallelism "
    "shards each by group",
)
