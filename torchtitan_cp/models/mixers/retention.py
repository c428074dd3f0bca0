"""RetNet's multi-scale retention (Sun et al., 2023, "Retentive Network"), as fla-core's
``MultiScaleRetention`` layer builds it: q/k/v projections, RoPE on q and k at document
positions, a fixed decay per head ``gamma_h = 1 - 2^(-5-h)``, retention
``S_t = gamma_h S_{t-1} + k_t v_tᵀ``, ``o_t = S_tᵀ (q_t / sqrt(K))``, a per-head RMSNorm gated by
``swish(g_proj x)`` and an output projection.

Retention is SSD with a fixed decay (``ops/ssd``, ``SSD.fixed_decay``): the same torch kernel,
fla's ``chunk_simple_gla`` on CUDA, and under context parallelism the same summaries (one log
decay per head), so every document's state is carried in from other ranks by the one driver.
Sizes are the shared model fields (``n_heads``, ``head_dim``, ``value_head_dim``, ``rope_theta``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from torchtitan_cp.models.blocks.heads import HeadsMixer
from torchtitan_cp.models.blocks.init import linear
from torchtitan_cp.models.blocks.norm import GatedRMSNorm
from torchtitan_cp.models.blocks.rope import apply_rope
from torchtitan_cp.models.blocks.tensor_parallel import distribute_parameter, tp_heads
from torchtitan_cp.models.context import SequenceContext
from torchtitan_cp.ops.common.dtypes import compute_dtype
from torchtitan_cp.ops.cp.recurrence import recurrence

__all__ = ["RetentionMixer", "retention_decay"]


def retention_decay(heads: int, like: Tensor, first: int = 0) -> Tensor:
    """RetNet's decay of head h, ``log(1 - 2^(-5-h))`` for ``first <= h < first + heads``
    (``first``: the first head of a TP rank): ``[heads]`` on ``like``'s device in its
    ``compute_dtype`` (built there: no host-to-device copy)."""
    h = torch.arange(first, first + heads, device=like.device, dtype=compute_dtype(like.dtype))
    return torch.log1p(-torch.exp2(-5.0 - h))


class RetentionMixer(HeadsMixer):
    """Multi-scale retention. Input/output ``[B, L, D]``; B·L is the local span."""

    @dataclass(kw_only=True, slots=True)
    class Config(HeadsMixer.Config):
        rope_theta: float = 10000.0

    def __init__(self, config: Config):
        super().__init__(config)
        h, k, v = self.n_heads, self.head_dim, self.value_head_dim
        self.rope_theta = config.rope_theta
        self.recurrence = recurrence("ssd", backend=config.backend, fixed_decay=retention_decay)
        d = config.dim
        self.q_proj, self.k_proj = linear(d, h * k), linear(d, h * k)
        self.v_proj, self.g_proj = linear(d, h * v), linear(d, h * v)
        self.o_norm = GatedRMSNorm.Config(dim=v, eps=config.norm_eps, activation="silu").build()
        self.o_proj = linear(h * v, d, std=0.02 / math.sqrt(2 * (config.layer_id + 1)))

    def parallelize_heads(self, mesh: DeviceMesh) -> None:
        """Tensor parallelism over heads on the TP ``mesh``: q/k/v/g column-wise, the output
        projection row-wise into the sequence-parallel layout, the norm weight (shared by the
        heads) replicated; each rank's fixed decays are those of its own heads."""
        local_heads = tp_heads(mesh, self.n_heads, "model.n_heads")
        plan: dict = {name: ColwiseParallel() for name in ("q_proj", "k_proj", "v_proj", "g_proj")}
        plan["o_proj"] = RowwiseParallel(output_layouts=Shard(1))
        parallelize_module(self, mesh, plan)
        distribute_parameter(self.o_norm, "weight", mesh, shard=False)
        first = mesh.get_local_rank() * local_heads
        decay = partial(retention_decay, first=first)
        self.recurrence = recurrence("ssd", backend=self.backend, fixed_decay=decay)

    def forward(
        self, x: torch.Tensor, ctx: SequenceContext, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        h, k, v = -1, self.head_dim, self.value_head_dim  # h: this rank's heads (all off TP)
        xs = x.reshape(1, bsz * seqlen, -1)  # the local span as one packed stream
        if positions is None:
            raise ValueError("RetentionMixer needs the document positions (RoPE)")
        pos = positions.reshape(-1)
        q = apply_rope(self.q_proj(xs).unflatten(-1, (h, k)), pos, self.rope_theta)
        kk = apply_rope(self.k_proj(xs).unflatten(-1, (h, k)), pos, self.rope_theta)
        o = ctx.run_recurrence(self.recurrence, (q, kk, self.v_proj(xs).unflatten(-1, (h, v))))
        o = self.o_norm(o.to(xs.dtype), self.g_proj(xs).unflatten(-1, (h, v)))
        # Rows back before the output projection: under TP it reduce-scatters over them.
        return self.o_proj(o.reshape(bsz, seqlen, -1))
