"""torchtitan 0.3.0's Qwen3.5 through this recipe: host routing, context parallelism, CPU kernels.

The architecture is torchtitan's own (``torchtitan.models.qwen3_5``: ``Qwen35Model``,
``GatedDeltaNet``, ``Qwen35Attention``, its flavors and ``Qwen35StateDictAdapter``). This module
changes only what crosses the module boundaries torchtitan provides:

* ``Qwen35TextModel.forward(tokens, positions, seq_ctx)`` takes the microbatch's
  ``SequenceContext`` (built by ``SequencePreprocessor`` from the loader's host positions) and
  hands every layer a ``RoutedVarlenMetadata`` carrying it: the routing has the device *and*
  host document offsets of this rank's span — no ``nonzero``/``.tolist()`` on device positions
  (upstream's ``create_varlen_metadata_for_document``).
* ``GatedDeltaNet.kernel`` becomes ``RoutedGatedDeltaKernel``: the same math as upstream's
  ``chunk_gated_delta_rule(..., use_qk_l2norm_in_kernel=True)`` (q/k heads repeated to the value
  heads, FLA's L2 norm ``x / sqrt(sum x^2 + 1e-6)``, scale ``K^-0.5``), run by this recipe's
  ``chunk_delta_rule`` or, under CP, ``context_parallel_delta_rule`` over the routing.
* ``GatedDeltaNet._causal_conv`` becomes the recipe's causal conv with the CP halo exchange.
* ``Qwen35Attention.inner_attention`` becomes ``RoutedInnerAttention``: flex (torchtitan's
  ``FlexAttention`` with the document ``BlockMask``; under CP torchtitan's ``apply_cp_to_forward``
  K/V all-gather) or sdpa (``ops.context_parallel_attention``), chosen as for the hybrid model;
  with ``model.attention_cp = "pass_kv"`` under CP, ``ops.pass_kv_attention`` instead.

Text only: the vision encoder is dropped unless ``vision=True``, which context parallelism
rejects (multimodal batches scatter image embeddings before CP sharding).
"""

from __future__ import annotations

import dataclasses
import types
from dataclasses import dataclass
from typing import Any, Literal, cast

import torch
from torch import nn
from torchtitan.distributed.utils import get_spmd_backend
from torchtitan.models.common.decoder import Decoder
from torchtitan.models.qwen3_5 import qwen3_5_configs
from torchtitan.models.qwen3_5.model import GatedDeltaNet, Qwen35Model
from torchtitan.models.qwen3_5.sharding import _set_shared_expert_gate_sharding
from torchtitan.models.qwen3_5.vision_encoder import Qwen35VisionEncoder
from torchtitan.protocols.module import Module

from torchtitan_cp.models.blocks.experts import check_expert_parallel

# Shared with models.kimi_linear, so they live in blocks/ (re-exported for existing callers).
from torchtitan_cp.models.blocks.norm import L2NORM_EPS as L2NORM_EPS
from torchtitan_cp.models.blocks.norm import fla_l2norm
from torchtitan_cp.models.blocks.routed_attention import (
    RoutedVarlenMetadata as RoutedVarlenMetadata,
)
from torchtitan_cp.models.blocks.routed_attention import (
    routed_varlen_metadata,
    seq_ctx_of,
)
from torchtitan_cp.models.blocks.routed_decoder import (
    RoutedDecoder,
    RoutedDecoderConfig,
    RoutedOptions,
)
from torchtitan_cp.models.blocks.tensor_parallel import local
from torchtitan_cp.models.context import SequenceContext
from torchtitan_cp.ops import (
    causal_conv1d,
    chunk_delta_rule,
    context_parallel_conv_history,
    context_parallel_delta_rule,
)

QWEN35_FLAVORS: tuple[str, ...] = tuple(qwen3_5_configs)
"""torchtitan 0.3.0's Qwen3.5 flavors (``debugmodel``, ``0.8B``, ``2B``, ...)."""

_TEXT_ONLY_TOKENS = {"image_id": -1, "video_id": -1}


class RoutedGatedDeltaKernel(Module):
    """Stand-in for upstream's ``GatedDeltaKernel``: same inputs and output, this recipe's delta
    rule over the microbatch's routing.

    q, k ``[1, T, H, K]``; v ``[1, T, HV, V]`` (HV a multiple of H: grouped value heads);
    g ``[1, T, HV]`` natural-log decay; beta ``[1, T, HV]``. Returns ``o [1, T, HV, V]``.
    ``seq_ctx`` is set by the owning ``GatedDeltaNet`` for the duration of its forward.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        backend: Literal["auto", "torch", "fla"] = "auto"

    def __init__(self, config: Config) -> None:
        super().__init__()
        self.backend = config.backend
        self.seq_ctx: SequenceContext | None = None

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        *,
        cu_seqlens: torch.Tensor | None = None,
        cu_seqlens_cpu: torch.Tensor | None = None,
    ) -> torch.Tensor:
        ctx = self.seq_ctx
        assert ctx is not None, "set by the GatedDeltaNet forward wrapper"
        if q.shape[2] != v.shape[2]:  # upstream's grouped value heads: q/k head h serves HV/H
            rep = v.shape[2] // q.shape[2]
            q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
        q, k = fla_l2norm(q), fla_l2norm(k)  # use_qk_l2norm_in_kernel=True
        if ctx.cp_enabled:
            o, _ = context_parallel_delta_rule(
                q,
                k,
                v,
                g,
                beta,
                kind="gdn",
                routing=ctx.routing,
                group=ctx.group,
                backend=self.backend,
            )
        else:
            o, _ = chunk_delta_rule(
                q,
                k,
                v,
                g,
                beta,
                kind="gdn",
                cu_seqlens=ctx.routing.cu_seqlens,
                cu_seqlens_cpu=ctx.routing.cu_seqlens_cpu,
                chunk_indices=ctx.routing.chunk_indices,
                chunk_offsets=ctx.routing.chunk_offsets,
                backend=self.backend,
            )
        return o


def _routed_causal_conv(
    self: GatedDeltaNet,
    x_BLD: torch.Tensor,
    conv: nn.Module,
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
) -> torch.Tensor:
    """``GatedDeltaNet._causal_conv`` on this recipe's conv: depthwise, SiLU, per-document
    resets, and under CP the W-1 tokens of history borrowed from earlier fragments.
    x ``[1, T, D]`` -> ``[1, T, D]``. The context and backend live on the swapped kernel."""
    kernel = cast(RoutedGatedDeltaKernel, self.kernel)
    ctx = kernel.seq_ctx
    assert ctx is not None, "set by the GatedDeltaNet forward wrapper"
    # [D, 1, W] -> [D, W]; under TP this rank's channels (the conv is sharded with its heads)
    weight = local(cast(torch.Tensor, conv.weight)).squeeze(1)
    history = None
    if ctx.cp_enabled:
        history = context_parallel_conv_history(x_BLD, routing=ctx.routing, group=ctx.group)
    return causal_conv1d(
        x_BLD,
        weight,
        None,
        cu_seqlens=ctx.routing.cu_seqlens,
        cu_seqlens_cpu=ctx.routing.cu_seqlens_cpu,
        chunk_indices=ctx.routing.chunk_indices,
        initial_state=history,
        activation="silu",
        backend=kernel.backend,
    )


def _routed_delta_net_forward(
    self: GatedDeltaNet, x_BLD: torch.Tensor, attention_masks: Any = None
) -> torch.Tensor:
    """Upstream's ``GatedDeltaNet.forward`` with the microbatch's context visible to the swapped
    conv and kernel for the duration of the call (activation-checkpoint recompute calls this
    again with the same masks, so it sees the same context)."""
    kernel = cast(RoutedGatedDeltaKernel, self.kernel)
    kernel.seq_ctx = seq_ctx_of(attention_masks, "Qwen3.5 GatedDeltaNet")
    try:
        # No metadata for upstream's own code: it would only turn the offsets into the
        # cu_seqlens arguments of the kernel and conv, which read the routing instead.
        return GatedDeltaNet.forward(self, x_BLD, None)
    finally:
        kernel.seq_ctx = None


def route_delta_nets(model: nn.Module, backend: Literal["auto", "torch", "fla"]) -> int:
    """Swap every ``GatedDeltaNet``'s kernel and causal conv for this recipe's (see module
    docstring); parameters and state-dict keys are unchanged. Returns the number swapped."""
    n = 0
    for m in model.modules():
        if not isinstance(m, GatedDeltaNet) or isinstance(m.kernel, RoutedGatedDeltaKernel):
            continue
        m.kernel = RoutedGatedDeltaKernel.Config(backend=backend).build()
        m._causal_conv = types.MethodType(_routed_causal_conv, m)  # pyrefly: ignore[bad-assignment]
        m.forward = types.MethodType(_routed_delta_net_forward, m)  # pyrefly: ignore[bad-assignment]
        n += 1
    return n


class Qwen35TextModel(RoutedDecoder, Qwen35Model):  # pyrefly: ignore[inconsistent-inheritance]
    """torchtitan's ``Qwen35Model`` (text path) taking this recipe's ``SequenceContext``.

    ``forward(tokens [B, L_local], positions [B, L_local] | None, seq_ctx)`` returns logits
    ``[B, L_local, vocab]`` (hidden states when the trainer's chunked loss applies the head).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(RoutedDecoderConfig, Qwen35Model.Config):
        vision_encoder: Qwen35VisionEncoder.Config | None = None  # pyrefly: ignore[bad-override]

        @property
        def conv_width(self) -> int:
            """Short-convolution width of the GatedDeltaNet layers (the CP halo is width - 1)."""
            dn = next((lay.delta_net for lay in self.layers if lay.delta_net is not None), None)
            return dn.conv_kernel_size if dn is not None else 1

        def shard_moe(self, ep: int, tp: int) -> None:
            """torchtitan's own MoE sharding configs (``set_moe_sharding``) and, as upstream's
            Qwen3.5 adds, its shared-expert gate's."""
            RoutedDecoderConfig.shard_moe(self, ep, tp)
            if ep > 1 or tp > 1:
                for layer in self.layers:
                    if layer.moe is not None:
                        _set_shared_expert_gate_sharding(layer.moe.shared_experts)

    def __init__(self, config: Config):
        Decoder.__init__(self, config)  # Qwen35Model.__init__ minus the mandatory vision encoder
        self.vision_encoder = None
        self.spatial_merge_size = 1
        if config.vision_encoder is not None:
            self.vision_encoder = config.vision_encoder.build()
            self.spatial_merge_size = config.vision_encoder.spatial_merge_size
        from torchtitan_cp.ops.common.fla_refusals import fla_backend
        from torchtitan_cp.ops.cp.recurrence import recurrence

        # fla refuses the gated delta rule's backward on some GPU + Triton pairs: auto runs
        # torch there.
        refusal = recurrence("gdn").fla_refusal()
        backend = fla_backend(config.linear_attention_backend, refusal, "GatedDeltaNet layers")
        route_delta_nets(self, backend)  # type: ignore[arg-type]

    def routed_forward(
        self, tokens: torch.Tensor, positions: torch.Tensor | None, seq_ctx: SequenceContext
    ) -> torch.Tensor:
        if positions is None:  # each row is one document (tokens: hidden states after stage 1)
            positions = torch.arange(tokens.shape[1], device=tokens.device).expand(
                tokens.shape[0], -1
            )
        if get_spmd_backend() == "spmd_types":
            raise ValueError(
                "qwen3_5 under torchtitan_cp runs with parallelism.spmd_backend = "
                "'partial_dtensor' (the recipe default), not 'spmd_types'"
            )
        meta = routed_varlen_metadata(seq_ctx)
        masks = {"deltanet": meta, "quadratic_attention": meta}
        return Qwen35Model.forward(
            self,
            tokens,
            attention_masks=masks,  # pyrefly: ignore[bad-argument-type]
            positions=positions,
            special_tokens=_TEXT_ONLY_TOKENS,  # text batches: no image/video placeholders
        )


def qwen35_config(
    flavor: str,
    *,
    vision: bool = False,
    enable_weight_tying: bool | None = None,
    **options: Any,
) -> Qwen35TextModel.Config:
    """torchtitan's Qwen3.5 ``flavor`` as a ``Qwen35TextModel.Config``, with ``options`` (the
    ``RoutedOptions`` of every torchtitan decoder here: ``n_layers`` keeps the first layers, the
    3:1 GatedDeltaNet/attention pattern being positional; ``vocab_size`` resizes embedding and
    head, e.g. to a smaller tokenizer; the attention and linear-attention backends).

    ``vision`` keeps the vision encoder (no context parallelism then); ``enable_weight_tying``
    shares embedding and head as HF's ``tie_word_embeddings`` does (Qwen3.5 0.8B/2B/4B), so the
    HF folder's missing ``lm_head.weight`` is neither read nor written.
    """
    if flavor not in qwen3_5_configs:
        raise ValueError(
            f"unknown model.flavor {flavor!r} for model.name 'qwen3_5'; choose one of "
            f"{list(QWEN35_FLAVORS)}"
        )
    opts = RoutedOptions(**options)
    base = qwen3_5_configs[flavor](attn_backend="flex")
    layers = list(base.layers)[: opts.layers(len(base.layers), f"qwen3_5 {flavor}")]
    inner = opts.inner_attention()
    layers = [
        dataclasses.replace(
            lay, attention=dataclasses.replace(lay.attention, inner_attention=inner)
        )
        if lay.attention is not None
        else lay
        for lay in layers
    ]
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
    fields.update(layers=layers, vision_encoder=base.vision_encoder if vision else None)
    vocab_size = opts.vocab(base.vocab_size)
    if vocab_size != base.vocab_size:
        fields["vocab_size"] = vocab_size
        fields["tok_embeddings"] = dataclasses.replace(
            base.tok_embeddings, num_embeddings=vocab_size
        )
        fields["lm_head"] = dataclasses.replace(base.lm_head, out_features=vocab_size)
    if enable_weight_tying is not None:
        fields["enable_weight_tying"] = enable_weight_tying
    return Qwen35TextModel.Config(**fields, **opts.config_fields())


def layer_types(cfg: Qwen35Model.Config) -> list[str]:
    """HF's ``layer_types``: "linear_attention" (GatedDeltaNet) or "full_attention" per layer."""
    return [
        "full_attention" if lay.attention is not None else "linear_attention" for lay in cfg.layers
    ]


def qwen35_layers_summary(cfg: Qwen35Model.Config) -> str:
    """``"GGGA"``-style letters of the layer stack, for logs."""
    return "".join("A" if t == "full_attention" else "G" for t in layer_types(cfg))


def check_qwen35_parallelism(cfg: Any, parallelism: Any) -> None:
    """A ValueError naming the key where Qwen3.5 cannot run with ``parallelism``."""
    cp = parallelism.context_parallel_degree
    pp = getattr(parallelism, "pipeline_parallel_degree", 1)
    for kind, degree, why in (
        ("context", cp, "Qwen3.5 scatters image embeddings into the unsharded sequence"),
        ("pipeline", pp, "the vision encoder is not split into stages by this recipe"),
    ):
        if cfg.vision_encoder is not None and degree > 1:
            raise ValueError(
                f"model.vision = true cannot run under {kind} parallelism "
                f"(parallelism.{kind}_parallel_degree = {degree}): {why}; train text-only "
                "(model.vision = false)"
            )
    tp = getattr(parallelism, "tensor_parallel_degree", 1)
    ep = getattr(parallelism, "expert_parallel_degree", 1)
    if tp > 1:
        check_qwen35_tensor_parallel(cfg, tp, ep)
    if ep > 1:  # under EP x TP torchtitan's EP borrows the TP ranks (trainer/validate.py)
        check_expert_parallel(cfg, ep, "qwen3_5")


def qwen35_head_counts(cfg: Any) -> list[tuple[str, int]]:
    """(what, count) of every head count of ``cfg``'s layers that TP splits whole."""
    counts: dict[str, int] = {}
    for layer in cfg.layers:
        if layer.attention is not None:
            counts["attention heads"] = layer.attention.n_heads
            counts["attention K/V heads"] = layer.attention.n_kv_heads
        if layer.delta_net is not None:
            dn = layer.delta_net
            counts["GatedDeltaNet key heads"] = dn.in_proj_k.out_features // dn.key_head_dim
            counts["GatedDeltaNet value heads"] = dn.in_proj_a.out_features
    return list(counts.items())


def qwen35_moe_widths(cfg: Any, ep: int) -> list[tuple[str, int]]:
    """(what, width) of the MoE layers' hidden widths that TP splits: each routed expert's
    when EP is off (``ep`` 1; under EP the experts stay whole), the shared expert's; empty
    for the dense flavors."""
    moe = next((layer.moe for layer in cfg.layers if layer.moe is not None), None)
    if moe is None:
        return []
    widths = []
    if ep == 1:
        widths.append(("routed expert hidden units", moe.routed_experts.inner_experts.hidden_dim))
    if moe.shared_experts is not None:
        widths.append(("shared expert hidden units", moe.shared_experts.w1.out_features))
    return widths


def check_qwen35_tensor_parallel(cfg: Any, tp: int, ep: int = 1) -> None:
    """A ValueError naming the key where Qwen3.5 cannot shard its heads (and its MoE layers'
    hidden units; ``ep``: the EP degree) over ``tp`` ranks."""
    key = f"parallelism.tensor_parallel_degree = {tp}"
    if cfg.vision_encoder is not None:
        raise ValueError(f"{key}: train text-only (model.vision = false) under TP")
    if cfg.enable_weight_tying:
        raise ValueError(
            f"{key} cannot be combined with model.enable_weight_tying (the embedding is "
            "row-sharded, the LM head column-sharded); set one of them off"
        )
    for what, heads in qwen35_head_counts(cfg):
        if heads % tp:
            fits = [d for d in range(1, heads + 1) if heads % d == 0]
            raise ValueError(
                f"{key} does not divide the {heads} {what} of qwen3_5: heads are split whole "
                f"across TP ranks; use a degree in {fits}"
            )
    for what, width in qwen35_moe_widths(cfg, ep):
        if width % tp:
            fits = [d for d in range(1, width + 1) if width % d == 0]
            raise ValueError(
                f"{key} does not divide the {width} {what} of qwen3_5: TP splits each "
                f"expert's hidden units evenly; use a degree in {fits}"
            )
