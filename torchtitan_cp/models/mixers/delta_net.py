"""KDA (Kimi Delta Attention), GDN (Gated DeltaNet) and gated DeltaProduct token mixers.

Both follow the published layers (Kimi Linear; Qwen3-Next / Gated DeltaNet): q/k/v projections,
a width-4 causal depthwise convolution with SiLU per projection, L2-normalised q and k,
``beta = sigmoid(b_proj(x))``, a natural-log decay gate, the delta-rule recurrence, a gated RMSNorm
on the output and an output projection. KDA's gate is per channel,
``-exp(A_log) * softplus(f_b(f_a(x)) + dt_bias)`` with shape ``[.., H, K]``; GDN's is one scalar per
head, ``-exp(A_log) * softplus(a_proj(x) + dt_bias)``. Every document starts from a zero state
and zero convolution history; under context parallelism both are carried in from other ranks.

The gated DeltaProduct (Siems et al. 2025) is GDN with ``steps`` delta-rule updates per token:
k, v and beta project ``steps`` times as wide (head-major, so a TP rank's columns hold whole
heads with all their steps), the gate and the readout stay one per token.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torchtitan.distributed.tensor_parallel import NoParallel

from torchtitan_cp.models.blocks.conv import ShortConvolution
from torchtitan_cp.models.blocks.heads import HeadsMixer
from torchtitan_cp.models.blocks.init import init_decay, linear
from torchtitan_cp.models.blocks.norm import GatedRMSNorm, fla_l2norm
from torchtitan_cp.models.blocks.tensor_parallel import distribute_parameter, local, tp_heads
from torchtitan_cp.models.context import SequenceContext
from torchtitan_cp.ops import Backend
from torchtitan_cp.ops.common.dtypes import compute_dtype
from torchtitan_cp.ops.cp.recurrence import Recurrence, recurrence


class DeltaNetMixer(HeadsMixer):
    """The shared delta-rule token mixer. Input/output ``[B, L, D]``; B·L is the local span.

    A subclass fixes the registered recurrence ``kind`` and supplies the decay gate
    (``_init_gates``, ``_gate``) and the output gate (``_output_gate``, activated by
    ``gate_activation``). ``Config.steps`` > 1 widens k, v and beta to that many delta-rule
    steps per token (a recurrence that takes them: ``_recurrence``).
    """

    kind: ClassVar[str]
    gate_activation: ClassVar[Literal["sigmoid", "silu"]]
    # Gate projections: per head (column-sharded under TP) and shared by the heads (replicated).
    head_projections: ClassVar[tuple[str, ...]]
    shared_projections: ClassVar[tuple[str, ...]] = ()
    dt_bias: nn.Parameter  # created by _init_gates: [H*K] (KDA) or [H] (GDN)

    variant_fields = ("qk_norm",)

    @dataclass(kw_only=True, slots=True)
    class Config(HeadsMixer.Config):
        conv_width: int = 4
        # The L2 norm of q and k: "normalize" is ``F.normalize`` (``x / max(|x|, 1e-12)``);
        # "fla" is fla-core's in-kernel norm ``x * rsqrt(|x|^2 + 1e-6)``, which Kimi Linear's
        # published layer (and transformers' port of it) runs.
        qk_norm: Literal["normalize", "fla"] = "normalize"
        # Delta-rule steps per token: k, v and beta are this many per head (DeltaProduct).
        steps: int = 1

    def __init__(self, config: Config):
        super().__init__(config)
        h, k, v = self.n_heads, self.head_dim, self.value_head_dim
        self.steps = config.steps
        self.recurrence = self._recurrence(config)
        d = config.dim
        self.q_proj = linear(d, h * k)
        self.k_proj = linear(d, self.steps * h * k)
        self.v_proj = linear(d, self.steps * h * v)
        # One depthwise conv over [q | k | v] channels: the same as three separate ones, but a
        # single kernel call and a single history exchange under CP.
        self.qkv_conv = ShortConvolution.Config(
            channels=sum(self._widths(h)), width=config.conv_width
        ).build()
        self.qk_norm = config.qk_norm
        self.b_proj = linear(d, self.steps * h)
        self._init_gates(d, h, k, v)
        self.A_log = nn.Parameter(torch.empty(h))
        self.o_norm = GatedRMSNorm.Config(
            dim=v, eps=config.norm_eps, activation=self.gate_activation
        ).build()
        # Depth-scaled output projection, as torchtitan's decoders do.
        self.o_proj = linear(h * v, d, std=0.02 / math.sqrt(2 * (config.layer_id + 1)))

    def _recurrence(self, config: Config) -> Recurrence:
        """The registered recurrence ``kind`` (one delta-rule step per token)."""
        return recurrence(self.kind, backend=config.backend)

    def _widths(self, h: int) -> list[int]:
        """Channels of q, k and v for ``h`` heads (the conv's ``[q | k | v]`` split)."""
        k, v = self.head_dim, self.value_head_dim
        return [h * k, self.steps * h * k, self.steps * h * v]

    def _init_gates(self, d: int, h: int, k: int, v: int) -> None:
        """Create the decay-gate and output-gate parameters (and ``dt_bias``)."""
        raise NotImplementedError

    def parallelize_heads(self, mesh: DeviceMesh) -> None:
        """Tensor parallelism over heads on the TP ``mesh``: q/k/v, beta and the per-head gate
        projections column-wise, the output projection row-wise into the sequence-parallel
        layout, ``A_log`` / ``dt_bias`` sharded with their heads, the conv over its rank's
        rows of ``[q | k | v]``; the low-rank gate inputs and the norm weight, shared by the
        heads, replicated. The forward then runs on this rank's heads."""
        tp_heads(mesh, self.n_heads, "model.n_heads")
        columns = ("q_proj", "k_proj", "v_proj", "b_proj", *self.head_projections)
        plan: dict = {name: ColwiseParallel() for name in columns}
        plan |= {name: NoParallel(use_local_output=True) for name in self.shared_projections}
        plan["o_proj"] = RowwiseParallel(output_layouts=Shard(1))
        parallelize_module(self, mesh, plan)
        self.qkv_conv.parallelize_heads(mesh, self._widths(self.n_heads))
        distribute_parameter(self, "A_log", mesh, shard=True)
        distribute_parameter(self, "dt_bias", mesh, shard=True)
        distribute_parameter(self.o_norm, "weight", mesh, shard=False)

    def _gate_logits(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(f, dt_bias, A_log)`` broadcastable to the gate's shape."""
        raise NotImplementedError

    def _output_gate(self, x: torch.Tensor) -> torch.Tensor:
        """Output gate pre-activation ``[1, T, H*V]``."""
        raise NotImplementedError

    def reset_parameters(self) -> None:
        init_decay(self.A_log, self.dt_bias)

    def _gate(self, x: torch.Tensor) -> torch.Tensor:
        f, bias, a_log = self._gate_logits(x)
        acc = compute_dtype(x.dtype)
        # Gates stay in at least float32: they are summed over long ranges inside the kernel.
        # The decay rate exp(A_log) too: in the bf16 param dtype of FSDP's mixed precision it
        # would be off by up to 2^-9 relative (0.4 %), in every step of every token.
        return -a_log.to(acc).exp() * F.softplus(f.to(acc) + bias.to(acc))

    def forward(
        self, x: torch.Tensor, ctx: SequenceContext, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        k, v, n = self.head_dim, self.value_head_dim, self.steps
        # The local span is the B rows' local pieces back to back: one packed stream.
        xs = x.reshape(1, bsz * seqlen, -1)
        qkv = torch.cat([self.q_proj(xs), self.k_proj(xs), self.v_proj(xs)], dim=-1)
        h = qkv.shape[-1] // ((1 + n) * k + n * v)  # this rank's heads (all without TP)
        q, kk, vv = self.qkv_conv(qkv, ctx, self.backend).split(self._widths(h), dim=-1)
        beta = torch.sigmoid(self.b_proj(xs).to(compute_dtype(xs.dtype))).to(xs.dtype)
        q = q.unflatten(-1, (h, k))
        if n == 1:
            kk, vv = kk.unflatten(-1, (h, k)), vv.unflatten(-1, (h, v))
        else:  # head-major columns [h, n, .] to the recurrence's step-major [1, T, n, h, .]
            kk, vv = (y.unflatten(-1, (h, n, -1)).movedim(3, 2) for y in (kk, vv))
            beta = beta.unflatten(-1, (h, n)).movedim(3, 2)
        if self.qk_norm == "fla":
            q, kk = fla_l2norm(q), fla_l2norm(kk)
        else:
            q = F.normalize(q, p=2, dim=-1)
            kk = F.normalize(kk, p=2, dim=-1)
        o = ctx.run_recurrence(self.recurrence, (q, kk, vv, self._gate(xs), beta))
        gate = self._output_gate(xs)
        o = self.o_norm(o.to(xs.dtype), gate.unflatten(-1, (h, v)))
        # Rows back before the output projection: under TP it reduce-scatters over them.
        return self.o_proj(o.reshape(bsz, seqlen, -1))


class KDAMixer(DeltaNetMixer):
    """KDA: low-rank per-channel decay ``[.., H, K]`` and sigmoid output gate (Kimi Linear)."""

    kind = "kda"
    gate_activation = "sigmoid"
    head_projections = ("f_b_proj", "g_b_proj")
    shared_projections = ("f_a_proj", "g_a_proj")

    variant_fields = ("qk_norm", "output_gate_bias")

    @dataclass(kw_only=True, slots=True)
    class Config(DeltaNetMixer.Config):
        # The output gate's up-projection bias: the recipe's KDA has one; Kimi Linear's
        # published layer (``g_b_proj``) has none.
        output_gate_bias: bool = True

    def __init__(self, config: Config):
        self.output_gate_bias = config.output_gate_bias  # read by _init_gates
        super().__init__(config)

    def _init_gates(self, d: int, h: int, k: int, v: int) -> None:
        self.f_a_proj = linear(d, k)
        self.f_b_proj = linear(k, h * k)
        self.g_a_proj = linear(d, v)
        self.g_b_proj = linear(v, h * v, bias=self.output_gate_bias)
        self.dt_bias = nn.Parameter(torch.empty(h * k))

    def _gate_logits(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        k = self.head_dim  # this rank's heads: -1 (all of them without TP)
        f = self.f_b_proj(self.f_a_proj(x)).unflatten(-1, (-1, k))
        return f, local(self.dt_bias).view(-1, k), local(self.A_log).view(-1, 1)

    def _output_gate(self, x: torch.Tensor) -> torch.Tensor:
        return self.g_b_proj(self.g_a_proj(x))


class GDNMixer(DeltaNetMixer):
    """GDN: one decay scalar per head and SiLU output gate (Gated DeltaNet / Qwen3-Next)."""

    kind = "gdn"
    gate_activation = "silu"
    head_projections = ("a_proj", "g_proj")

    @dataclass(kw_only=True, slots=True)
    class Config(DeltaNetMixer.Config):
        pass

    def _init_gates(self, d: int, h: int, k: int, v: int) -> None:
        self.a_proj = linear(d, h)
        self.g_proj = linear(d, h * v)
        self.dt_bias = nn.Parameter(torch.empty(h))

    def _gate_logits(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.a_proj(x), local(self.dt_bias), local(self.A_log)

    def _output_gate(self, x: torch.Tensor) -> torch.Tensor:
        return self.g_proj(x)


@dataclass(kw_only=True, slots=True)
class GatedDeltaProductOptions:
    """``[model.layer_options.gated_delta_product]``: sizes of the P (gated DeltaProduct)
    layers."""

    householder: int = 2
    """Delta-rule steps (Householder reflections) per token: k, v and beta are this many per
    head, the gate and the readout one (DeltaProduct's ``n_h``; 1 is GDN)."""


class GatedDeltaProductMixer(GDNMixer):
    """Gated DeltaProduct: GDN's gates with ``householder`` delta-rule steps per token
    (Siems et al. 2025; fla's ``GatedDeltaProduct`` layer), the recurrence ``gdp``."""

    kind = "gdp"

    @dataclass(kw_only=True, slots=True)
    class Config(GDNMixer.Config):
        pass

    @classmethod
    def from_model(cls, cfg: Any, layer_id: int, backend: Backend) -> DeltaNetMixer.Config:
        steps = cfg.layer_options.gated_delta_product.householder
        if steps < 1:
            raise ValueError(
                f"model.layer_options.gated_delta_product.householder must be >= 1, got {steps}"
            )
        config = super().from_model(cfg, layer_id, backend)
        assert isinstance(config, DeltaNetMixer.Config)
        return dataclasses.replace(config, steps=steps)

    @staticmethod
    def flops(cfg: Any, seq_len: int) -> int:
        # The kernel runs the delta rule over ``householder`` steps per token.
        steps = cfg.layer_options.gated_delta_product.householder
        return steps * GDNMixer.flops(cfg, seq_len)

    def _recurrence(self, config: DeltaNetMixer.Config) -> Recurrence:
        return recurrence(self.kind, householder=config.steps, backend=config.backend)
