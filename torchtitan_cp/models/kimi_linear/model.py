"""Kimi Linear (Moonshot, arXiv 2510.26692) on torchtitan's modules and this recipe's KDA.

The text model of ``transformers``' ``KimiLinearForCausalLM``, built from:

* torchtitan's decoder (``Decoder``: embeddings, final RMSNorm, LM head), DeepSeek-V3's
  multi-head latent attention (``deepseek_v3.model.Attention``) and MoE layers
  (``deepseek_v3.build_mla_moe_layers``: sigmoid router with the aux-free expert bias, top-k
  renormalised and scaled, shared experts, the first layers dense);
* this recipe's ``KDAMixer`` in Kimi's parametrization (``qk_norm = "fla"``, no output-gate
  bias): the same layer the hybrid decoder's ``K`` letter runs, so KDA layers go through the
  recipe's CP driver and conv halo by construction.

Two details of the published model that upstream's modules do not cover are parameters here:
Kimi Linear's MLA has no rotary embedding (``NoPE``: the "rope" part of q/k passes through as
is) and its experts compute in the activations' dtype (``ActivationDtypeGroupedExperts``).

``KimiLinearModel.forward(tokens, positions, seq_ctx)`` takes the microbatch's
``SequenceContext`` as ``Qwen35TextModel`` does: KDA layers read it directly, the MLA layers'
``RoutedInnerAttention`` through ``RoutedVarlenMetadata``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torchtitan.models.common import Embedding, Linear, RMSNorm
from torchtitan.models.common.decoder import Decoder, TransformerBlock
from torchtitan.models.common.moe import GroupedExperts
from torchtitan.models.common.rope import RoPE
from torchtitan.models.deepseek_v3 import build_mla_moe_layers
from torchtitan.models.deepseek_v3.model import Attention

from torchtitan_cp.models.blocks.experts import check_expert_parallel, set_moe_sharding
from torchtitan_cp.models.blocks.flex import resolve_attention_backend
from torchtitan_cp.models.blocks.init import BASE_STD
from torchtitan_cp.models.blocks.routed_attention import (
    RoutedInnerAttention,
    RoutedVarlenMetadata,
    routed_varlen_metadata,
)
from torchtitan_cp.models.blocks.routed_decoder import (
    LinearAttentionBackend,
    RoutedDecoder,
    RoutedDecoderConfig,
    RoutedOptions,
)
from torchtitan_cp.models.context import SequenceContext
from torchtitan_cp.models.kimi_linear.stages import layer_flops
from torchtitan_cp.models.mixers.delta_net import KDAMixer
from torchtitan_cp.ops import context_parallel_attention
from torchtitan_cp.ops.cp.collectives import all_gather_autograd

__all__ = [
    "KIMI_LINEAR_FLAVORS",
    "KimiLinearBlock",
    "KimiLinearModel",
    "KimiLinearSizes",
    "LatentGatherMLA",
    "NoPE",
    "check_kimi_linear_parallelism",
    "kimi_linear_config",
    "layer_types",
]


@dataclass(frozen=True, kw_only=True)
class KimiLinearSizes:
    """A Kimi Linear flavor: the fields of transformers' ``KimiLinearConfig`` it fixes."""

    dim: int
    n_layers: int
    vocab_size: int
    # MLA (q_lora_rank 0: a full-rank query projection, as the published model has)
    n_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    mla_layers: tuple[int, ...]  # 0-indexed; every other layer is KDA
    # KDA
    kda_heads: int
    kda_head_dim: int
    conv_width: int
    # feed-forward: the first ``n_dense_layers`` dense, then MoE with shared experts
    n_dense_layers: int
    dense_hidden_dim: int
    moe_hidden_dim: int
    num_experts: int
    top_k: int
    num_shared_experts: int
    num_expert_groups: int
    num_limited_groups: int
    route_scale: float
    route_norm: bool
    norm_eps: float
    max_seq_len: int


KIMI_LINEAR_FLAVORS: dict[str, KimiLinearSizes] = {
    # Small enough for CPU tests: the published pattern's first four layers (KDA, KDA, KDA, MLA;
    # the first layer's feed-forward dense), every size shrunk.
    "debug": KimiLinearSizes(
        dim=64, n_layers=4, vocab_size=1024, n_heads=4, q_lora_rank=0, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, mla_layers=(3,),
        kda_heads=4, kda_head_dim=16, conv_width=4, n_dense_layers=1, dense_hidden_dim=128,
        moe_hidden_dim=32, num_experts=8, top_k=2, num_shared_experts=1, num_expert_groups=1,
        num_limited_groups=1, route_scale=2.446, route_norm=True, norm_eps=1e-5,
        max_seq_len=1 << 20,
    ),
    # moonshotai/Kimi-Linear-48B-A3B-Instruct's config.json (checked 2 December 2026 against
    # a copy of it: hf.898520.xyz/Firworks/Kimi-Linear-48B-A3B-Instruct-nvfp4/.../config.json,
    # a re-quantization that keeps the architecture fields): linear_attn_config.full_attn_layers
    # [4, 8, 12, 16, 20, 24, 27] and kda_layers the other 20 (1-indexed), first_k_dense_replace
    # 1, hidden 2304, intermediate 9216, moe_intermediate 1024, 256 experts top-8, 1 shared,
    # 1 expert group, 32 MLA heads, kv_lora_rank 512, q_lora_rank null, qk_nope/rope/v
    # 128/64/128, 32 KDA heads of 128, conv 4, model_max_length 1048576. Also transformers
    # 5.23's KimiLinearConfig defaults, except its default layer_types (MLA at 0-indexed 4,
    # 8, ...: a folder's linear_attn_config overrides it); routed_scaling_factor 2.446,
    # rms_norm_eps 1e-5 and vocab 163840 from those defaults. The HF folder check compares a
    # folder's config.json field by field.
    "48B-A3B": KimiLinearSizes(
        dim=2304, n_layers=27, vocab_size=163840, n_heads=32, q_lora_rank=0, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        mla_layers=(3, 7, 11, 15, 19, 23, 26), kda_heads=32, kda_head_dim=128, conv_width=4,
        n_dense_layers=1, dense_hidden_dim=9216, moe_hidden_dim=1024, num_experts=256, top_k=8,
        num_shared_experts=1, num_expert_groups=1, num_limited_groups=1, route_scale=2.446,
        route_norm=True, norm_eps=1e-5, max_seq_len=1048576,
    ),
}  # fmt: skip # a table, laid out by hand to read across

# Kimi Linear's kv_a_layernorm (and q_a_layernorm) keep RMSNorm's 1e-6 default, not rms_norm_eps.
LATENT_NORM_EPS = 1e-6


class NoPE(RoPE):
    """No positional rotation: Kimi Linear's MLA layers are NoPE (position comes from the KDA
    layers), but DeepSeek-V3's ``Attention`` always calls its ``rope``. q/k pass through
    unchanged; ``max_seq_len`` is kept only for torchtitan's sequence-length check."""

    @dataclass(kw_only=True, slots=True)
    class Config(RoPE.Config):
        pass

    def _precompute_cache(self) -> torch.Tensor:
        return torch.empty(0)

    def forward(  # pyrefly: ignore[bad-override]
        self, query: torch.Tensor, key: torch.Tensor, positions: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return query, key


class ActivationDtypeGroupedExperts(GroupedExperts):
    """torchtitan's ``GroupedExperts`` (SwiGLU per expert, one grouped matmul per weight) in
    the activations' dtype: upstream casts inputs and weights to bfloat16 for its CUDA grouped
    GEMM, which would make a float32 run (CPU training, the float32 equality test against
    transformers) bfloat16 in every expert. Under FSDP's bfloat16 mixed precision the
    activations are bfloat16 and this is upstream's computation.

    ``x_RD [R, D]`` tokens grouped by expert, ``num_tokens_per_expert_E [E]`` -> ``[R, D]``.
    torch's grouped matmul needs rows of 16-byte multiples (dim and hidden_dim multiples of 4
    in float32), and its fake kernel takes bfloat16/float16 only: float32 experts run eager but
    do not trace under torch.compile (the config check refuses compile.enable for now)."""

    @dataclass(kw_only=True, slots=True)
    class Config(GroupedExperts.Config):
        pass

    def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        dt = x_RD.dtype
        # under EP the weights are DTensors sharded on the expert dimension (FSDP gathers
        # efsdp): this rank's experts, as upstream's forward takes them
        w1, w2, w3 = (
            (w.to_local() if isinstance(w, DTensor) else w).to(dt)
            for w in (self.w1_EFD, self.w2_EDF, self.w3_EFD)
        )
        offs = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
        gate = self._grouped_mm(A=x_RD, B_t=w1.transpose(-2, -1), offs=offs)
        up = self._grouped_mm(A=x_RD, B_t=w3.transpose(-2, -1), offs=offs)
        return self._grouped_mm(A=F.silu(gate) * up, B_t=w2.transpose(-2, -1), offs=offs)


class LatentGatherMLA(Attention):
    """DeepSeek-V3's MLA (torchtitan's ``Attention``) that, under context parallelism on the
    all-gather path, gathers each token's compressed latent instead of its keys and values:
    ``kv_norm(latent)`` and the shared rope key, ``kv_lora_rank + qk_rope_head_dim`` numbers
    per token, where expanded K/V would be ``n_heads x (qk_nope + qk_rope + v)``. Every rank
    expands the gathered latents with ``wkv_b``; the latents' gradients reduce-scatter back to
    their owners (``ops.all_gather_autograd``). sdpa: ``ops.context_parallel_attention`` with
    ``expand`` (padded rows, global token/document ids); flex: the rows gathered in rank
    order, expanded, then flex of the local queries with this rank's document ``BlockMask``
    (``RoutedInnerAttention.flex_gathered``, the layout torchtitan's flex K/V all-gather
    gives). Elsewhere (no CP, pass-KV) it is upstream's forward. In/out ``[B, L_local, D]``."""

    @dataclass(kw_only=True, slots=True)
    class Config(Attention.Config):
        pass

    def forward(
        self,
        x: torch.Tensor,
        attention_masks: Any,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        inner = self.inner_attention
        ctx = getattr(attention_masks, "seq_ctx", None)
        if not (
            ctx is not None
            and ctx.cp_enabled
            and isinstance(inner, RoutedInnerAttention)
            and inner.cp_mode == "all_gather"
        ):
            return super().forward(x, attention_masks, positions)
        bsz, seqlen, _ = x.shape
        c, r = self.kv_lora_rank, self.qk_rope_head_dim
        nope, dv = self.qk_nope_head_dim, self.v_head_dim
        q = self.wq(x) if self.q_lora_rank == 0 else self.wq_b(self.q_norm(self.wq_a(x)))
        q_nope, q_pe = q.view(bsz, seqlen, -1, self.qk_head_dim).split([nope, r], dim=-1)
        latent, k_pe = self.wkv_a(x).split([c, r], dim=-1)
        q_pe, k_pe = self.rope(q_pe, k_pe.unsqueeze(2), positions)
        q = torch.cat([q_nope, q_pe], dim=-1)
        heads = q.shape[2]
        rows = torch.cat([self.kv_norm(latent).unsqueeze(2), k_pe], dim=-1)  # [B, L, 1, c + r]

        def expand(g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            # gathered rows [1, Tk, 1, c + r] -> keys [1, Tk, H, nope + r], values [1, Tk, H, v]
            kv = self.wkv_b(g[:, :, 0, :c]).unflatten(-1, (heads, nope + dv))
            k_nope, v = kv.split([nope, dv], dim=-1)
            k = torch.cat([k_nope, g[:, :, :, c:].expand(-1, -1, heads, -1)], dim=-1)
            return k, v

        if resolve_attention_backend(inner.backend, x.device) == "flex":
            # [B, L, 1, c + r] -> [B, world x L, 1, c + r] in rank order (token dim first)
            gathered = all_gather_autograd(rows.transpose(0, 1), ctx.group).transpose(0, 1)
            k, v = expand(gathered)
            o = inner.flex_gathered(q, k, v, ctx, self.softmax_scale)
            return self.wo(o.reshape(bsz, seqlen, heads * dv))
        o = context_parallel_attention(
            q.reshape(1, bsz * seqlen, heads, self.qk_head_dim),
            rows.reshape(1, bsz * seqlen, 1, c + r),
            None,
            token_ids=ctx.token_ids,
            doc_ids=ctx.doc_ids,
            group=ctx.group,
            scale=self.softmax_scale,
            max_tokens=ctx.routing.num_tokens,
            expand=expand,
        )
        return self.wo(o.reshape(bsz, seqlen, heads * dv))


class KimiLinearBlock(TransformerBlock):
    """One Kimi Linear layer: ``x + mixer(norm(x))``, then ``x + ffn(norm(x))``, where the
    mixer is MLA (``attention``) or KDA (``kda``) and the feed-forward dense
    (``feed_forward``) or MoE (``moe``). In/out ``[B, L, D]``."""

    @dataclass(kw_only=True, slots=True)
    class Config(TransformerBlock.Config):
        attention: LatentGatherMLA.Config | None = None  # pyrefly: ignore[bad-override]
        kda: KDAMixer.Config | None = None

    def __init__(self, config: Config):
        super().__init__()
        if (config.attention is None) == (config.kda is None):
            raise ValueError("a Kimi Linear layer has exactly one of attention (MLA) and kda")
        self.attention = config.attention.build() if config.attention is not None else None
        self.kda = config.kda.build() if config.kda is not None else None
        self.attention_norm = config.attention_norm.build()
        self.ffn_norm = config.ffn_norm.build()
        self.moe_enabled = config.moe is not None
        if config.moe is not None:
            self.moe = config.moe.build()
        else:
            assert config.feed_forward is not None
            self.feed_forward = config.feed_forward.build()

    def forward(
        self,
        x: torch.Tensor,
        attention_masks: RoutedVarlenMetadata,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        h = self.attention_norm(x)
        if self.kda is not None:
            x = x + self.kda(h, attention_masks.seq_ctx, positions)
        else:
            assert self.attention is not None
            x = x + self.attention(h, attention_masks, positions)
        ffn = self.moe if self.moe_enabled else self.feed_forward
        return x + ffn(self.ffn_norm(x))


class KimiLinearModel(RoutedDecoder, Decoder):  # pyrefly: ignore[inconsistent-inheritance]
    """Kimi Linear's text model on torchtitan's ``Decoder``.

    ``forward(tokens [B, L_local], positions [B, L_local] | None, seq_ctx)`` returns logits
    ``[B, L_local, vocab]`` (hidden states when the trainer's chunked loss applies the head).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(RoutedDecoderConfig, Decoder.Config):
        @property
        def conv_width(self) -> int:
            """Short-convolution width of the KDA layers (the CP halo is width - 1)."""
            kda = next((lay.kda for lay in self.layers if lay.kda is not None), None)
            return kda.conv_width if kda is not None else 1

        def set_linear_attention_backend(self, backend: LinearAttentionBackend) -> None:
            """The KDA layers' configs hold their own backend."""
            self.linear_attention_backend = backend
            for lay in self.layers:
                if lay.kda is not None:
                    lay.kda.backend = backend

        def shard_moe(self, ep: int, tp: int) -> None:
            """torchtitan's expert sharding under EP only: TP is refused for kimi_linear."""
            if ep > 1:
                set_moe_sharding(self.layers, ep=ep, tp=1)

        def get_nparams_and_flops(self, model: nn.Module, seq_len: int) -> tuple[int, int]:
            """(parameters, training FLOPs per token): 6 x the parameters a token passes
            through (the routed experts' top-k share, no embedding), plus MLA's attention
            scores and KDA's recurrence per layer (``stages.layer_flops``)."""
            nparams = sum(p.numel() for p in model.parameters())
            # pyrefly: ignore[missing-attribute]  (an nn.Embedding, typed through Module.__getattr__)
            embed = sum(p.numel() for p in model.tok_embeddings.parameters())
            inactive = 0
            for m in model.modules():
                if isinstance(m, GroupedExperts):
                    share = 1 - self.top_k / m.num_experts
                    inactive += int(sum(p.numel() for p in m.parameters()) * share)
            flops = 6 * (nparams - embed - inactive)
            for lay in self.layers:
                flops += layer_flops(lay, seq_len)
            return nparams, flops

        @property
        def top_k(self) -> int:
            moe = next((lay.moe for lay in self.layers if lay.moe is not None), None)
            return moe.router.top_k if moe is not None else 0

    def routed_forward(
        self, tokens: torch.Tensor, positions: torch.Tensor | None, seq_ctx: SequenceContext
    ) -> torch.Tensor:
        # pyrefly: ignore[bad-argument-type]  (the MLA and KDA blocks take the routed metadata)
        return Decoder.forward(self, tokens, positions, routed_varlen_metadata(seq_ctx))


def _kda_config(s: KimiLinearSizes, layer_id: int, backend: Any) -> KDAMixer.Config:
    """The recipe's KDA mixer as Kimi Linear's ``KimiLinearDeltaAttention``: q/k/v of
    ``kda_heads x kda_head_dim``, low-rank gates of rank ``kda_head_dim``, fla's in-kernel L2
    norm, an output gate without bias, the gated norm at ``rms_norm_eps``."""
    return KDAMixer.Config(
        dim=s.dim,
        n_heads=s.kda_heads,
        head_dim=s.kda_head_dim,
        norm_eps=s.norm_eps,
        layer_id=layer_id,
        backend=backend,
        conv_width=s.conv_width,
        qk_norm="fla",
        output_gate_bias=False,
    )


def kimi_linear_config(flavor: str, **options: Any) -> KimiLinearModel.Config:
    """Kimi Linear ``flavor`` (``KIMI_LINEAR_FLAVORS``) as a ``KimiLinearModel.Config``, with
    ``options`` (the ``RoutedOptions`` of every torchtitan decoder here: ``n_layers`` keeps the
    first layers, the KDA/MLA pattern being positional; ``vocab_size`` resizes embedding and
    head, e.g. to a smaller tokenizer; the attention and linear-attention backends).
    """
    if flavor not in KIMI_LINEAR_FLAVORS:
        raise ValueError(
            f"unknown model.flavor {flavor!r} for model.name 'kimi_linear'; choose one of "
            f"{list(KIMI_LINEAR_FLAVORS)}"
        )
    opts = RoutedOptions(**options)
    s = KIMI_LINEAR_FLAVORS[flavor]
    n_layers = opts.layers(s.n_layers, f"kimi_linear {flavor}")
    s = dataclasses.replace(
        s,
        n_layers=n_layers,
        mla_layers=tuple(i for i in s.mla_layers if i < n_layers),
        vocab_size=opts.vocab(s.vocab_size),
    )
    init = {
        "weight": lambda w: nn.init.trunc_normal_(w, std=BASE_STD, a=-3 * BASE_STD, b=3 * BASE_STD)
    }
    norm_init = {"weight": nn.init.ones_}
    blocks = build_mla_moe_layers(
        n_layers=s.n_layers,
        n_dense_layers=s.n_dense_layers,
        dim=s.dim,
        n_heads=s.n_heads,
        q_lora_rank=s.q_lora_rank,
        kv_lora_rank=s.kv_lora_rank,
        qk_nope_head_dim=s.qk_nope_head_dim,
        qk_rope_head_dim=s.qk_rope_head_dim,
        v_head_dim=s.v_head_dim,
        mscale=1.0,
        dense_hidden_dim=s.dense_hidden_dim,
        moe_hidden_dim=s.moe_hidden_dim,
        num_experts=s.num_experts,
        num_shared_experts=s.num_shared_experts,
        router_top_k=s.top_k,
        router_score_func="sigmoid",
        router_num_expert_groups=s.num_expert_groups,
        router_num_limited_groups=s.num_limited_groups,
        router_route_scale=s.route_scale,
        router_route_norm=s.route_norm,
        attn_backend="flex",
        moe_comm_backend="standard",
        non_blocking_capacity_factor=None,
        linear_init=init,
        norm_init=norm_init,
        depth_init=lambda layer_id: init,
        depth_experts_init=lambda layer_id: {
            name: init["weight"] for name in ("w1_EFD", "w2_EDF", "w3_EFD")
        },
        rope=NoPE.Config(dim=s.qk_rope_head_dim, max_seq_len=s.max_seq_len),
    )
    inner = opts.inner_attention()
    layers = []
    for i, b in enumerate(blocks):
        attention = kda = None
        if i in s.mla_layers:
            mla = {f.name: getattr(b.attention, f.name) for f in dataclasses.fields(b.attention)}
            mla.update(
                inner_attention=inner,
                # pyrefly: ignore[missing-attribute]  (MLA's config, typed as its base)
                kv_norm=dataclasses.replace(b.attention.kv_norm, eps=LATENT_NORM_EPS),
                # pyrefly: ignore[missing-attribute]
                q_norm=dataclasses.replace(b.attention.q_norm, eps=LATENT_NORM_EPS),
            )
            attention = LatentGatherMLA.Config(**mla)
        else:
            kda = _kda_config(s, i, opts.linear_attention_backend)
        moe = b.moe
        if moe is not None:
            experts = moe.routed_experts
            inner_experts = ActivationDtypeGroupedExperts.Config(
                **{
                    f.name: getattr(experts.inner_experts, f.name)
                    for f in dataclasses.fields(experts.inner_experts)
                }  # fmt: skip # a table, laid out by hand to read across
            )
            moe = dataclasses.replace(
                moe, routed_experts=dataclasses.replace(experts, inner_experts=inner_experts)
            )
        layers.append(
            KimiLinearBlock.Config(
                attention=attention,
                kda=kda,
                feed_forward=b.feed_forward,
                moe=moe,
                attention_norm=RMSNorm.Config(
                    normalized_shape=s.dim, eps=s.norm_eps, param_init=norm_init
                ),
                ffn_norm=RMSNorm.Config(
                    normalized_shape=s.dim, eps=s.norm_eps, param_init=norm_init
                ),
            )
        )
    return KimiLinearModel.Config(
        dim=s.dim,
        vocab_size=s.vocab_size,
        tok_embeddings=Embedding.Config(
            num_embeddings=s.vocab_size,
            embedding_dim=s.dim,
            param_init={"weight": nn.init.normal_},
        ),
        norm=RMSNorm.Config(normalized_shape=s.dim, eps=s.norm_eps, param_init=norm_init),
        lm_head=Linear.Config(in_features=s.dim, out_features=s.vocab_size, param_init=init),
        layers=layers,
        **opts.config_fields(),
    )


def layer_types(cfg: KimiLinearModel.Config) -> list[str]:
    """HF's ``layer_types``: "linear_attention" (KDA) or "full_attention" (MLA) per layer."""
    return [
        "full_attention" if lay.attention is not None else "linear_attention" for lay in cfg.layers
    ]


def check_kimi_linear_parallelism(cfg: Any, parallelism: Any) -> None:
    """A ValueError naming the key where Kimi Linear cannot run with ``parallelism`` in this
    recipe. Context parallelism runs (KDA layers through the CP driver and conv halo, MLA
    layers through the recipe's attention CP: the compressed latent's all-gather on sdpa and
    flex, expanded K/V on pass-KV with ``model.attention_cp``), and
    expert parallelism (torchtitan's MoE sharding and all-to-all dispatcher, composed with CP
    and FSDP) when its degree divides the experts, and pipeline parallelism (``stages``). Tensor
    parallelism is refused."""
    tp = getattr(parallelism, "tensor_parallel_degree", 1)
    if tp > 1:
        raise ValueError(
            f"parallelism.tensor_parallel_degree = {tp} is not supported for model.name = "
            "'kimi_linear' yet: tensor parallelism of KDA + MLA + MoE is not built; set it to 1"
        )
    ep = getattr(parallelism, "expert_parallel_degree", 1)
    if ep > 1:
        check_expert_parallel(cfg, ep, "kimi_linear")
