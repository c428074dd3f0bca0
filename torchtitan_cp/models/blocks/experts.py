"""Expert and tensor parallelism and FSDP for decoders built on torchtitan's MoE layers
(Qwen3.5's MoE flavors, Kimi Linear): the config check, torchtitan's MoE sharding configs, the
modules' own EP / TP sharding and FSDP with the experts over what EP leaves of
dp_shard x cp x tp."""

from __future__ import annotations

from typing import Any

from torch import nn
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.distributed.fsdp import apply_fsdp_to_decoder
from torchtitan.models.common.moe import MoE
from torchtitan.models.common.moe_sharding import set_moe_sharding_config
from torchtitan.models.deepseek_v3.sharding import _GROUPED_EXPERTS_PARAM_LAYOUT

from torchtitan_cp import compat

__all__ = [
    "apply_fsdp_with_experts",
    "check_expert_parallel",
    "parallelize_moe",
    "set_moe_sharding",
]


def check_expert_parallel(cfg: Any, ep: int, model_name: str) -> None:
    """A ValueError naming the key where ``cfg``'s experts cannot split over ``ep`` ranks:
    a flavor without MoE layers, or ``ep`` not dividing the experts (each EP rank holds a
    whole share of them)."""
    key = f"parallelism.expert_parallel_degree = {ep}"
    moes = [layer.moe for layer in cfg.layers if layer.moe is not None]
    if not moes:
        raise ValueError(
            f"{key}: this {model_name} flavor has no experts (a dense flavor); set it to 1"
        )
    experts = moes[0].num_experts
    if experts % ep:
        fits = [d for d in range(1, experts + 1) if experts % d == 0]
        raise ValueError(
            f"{key} does not divide the {experts} experts of {model_name}: each EP rank holds "
            f"a whole share of them; use a degree in {fits}"
        )


def set_moe_sharding(layers: list[Any], *, ep: int, tp: int) -> None:
    """torchtitan's own MoE sharding configs on every MoE layer config of ``layers`` (called
    from the model config's ``update_from_config`` when EP or TP > 1; ``ep``, ``tp``: the
    degrees), as upstream's Qwen3.5 sets them (``set_moe_sharding_config``):

    * EP: the routed experts' w1/w2/w3 (torchtitan's ``GroupedExperts`` names) split on their
      expert dimension over the EP mesh, its all-to-all token dispatcher; router replicated.
    * TP without EP: the MoE gathers its sequence-parallel input, the router runs replicated,
      each expert's hidden dimension is split (w1/w3 ``Shard(1)``, w2 ``Shard(2)``) and the
      routed output (partial sums) is reduce-scattered back to the sequence shards.
    * EP x TP: torchtitan's EP borrows the TP ranks (its ``efsdp x ep`` mesh spans
      dp_shard x cp x tp): the tokens stay sequence-sharded over TP through the router and
      the dispatch, whole experts per EP rank.

    The shared experts are split over TP like a dense feed-forward (w1/w3 column-, w2
    row-wise, reduce-scattered)."""
    for layer in layers:
        if layer.moe is not None:
            set_moe_sharding_config(
                layer.moe,
                enable_ep=ep > 1,
                enable_sp=tp > 1,
                expert_param_layout=_GROUPED_EXPERTS_PARAM_LAYOUT,
            )


def parallelize_moe(model: nn.Module, parallel_dims: Any) -> None:
    """Shard every torchtitan ``MoE`` of ``model`` by its sharding config (set by
    ``set_moe_sharding``): its parameters become DTensors on the TP or EP mesh and its forward
    redistributes on entry and exit (torchtitan's ``Module.parallelize``, which also wires the
    all-to-all dispatcher to the EP mesh). The CP ranks' tokens are routed like any other
    data-parallel tokens: EP borrows its ranks from dp_shard x cp (x tp)."""
    for moe in (m for m in model.modules() if isinstance(m, MoE)):
        moe.parallelize(parallel_dims)


def apply_fsdp_with_experts(
    model: nn.Module,
    *,
    parallel_dims: Any,
    training: Any,
    parallelism: Any,
    encoder: Any = None,
) -> None:
    """FSDP over the data-parallel mesh (dp_shard x cp, with dp_replicate when set):
    torchtitan's ``apply_fsdp_to_decoder`` (one unit per layer, embeddings and head); under EP
    the experts shard over what EP leaves of dp_shard x cp x tp (``efsdp``). ``encoder`` (Qwen3.5's
    vision encoder) is wrapped first on the same mesh. Gloo has no average reduction: the
    gradients are summed and torchtitan's loss scaling divides (``compat``)."""
    names = ["dp_replicate", "fsdp"] if parallel_dims.dp_replicate_enabled else ["fsdp"]
    mesh = parallel_dims.get_mesh(names)
    common = dict(
        param_dtype=TORCH_DTYPE_MAP[training.mixed_precision_param],
        reduce_dtype=TORCH_DTYPE_MAP[training.mixed_precision_reduce],
        reshard_after_forward_policy=parallelism.fsdp_reshard_after_forward,
        pp_enabled=parallel_dims.pp_enabled,  # under PP each stage keeps its parameters
    )
    if encoder is not None:
        from torchtitan.distributed.fsdp import apply_fsdp_to_vision_encoder

        apply_fsdp_to_vision_encoder(encoder, mesh, **common)  # pyrefly: ignore[bad-argument-type]
    edp_mesh = None
    if parallel_dims.ep_enabled:
        edp_names = ["dp_replicate", "efsdp"] if parallel_dims.dp_replicate_enabled else ["efsdp"]
        edp_mesh = parallel_dims.get_optional_mesh(edp_names)
    apply_fsdp_to_decoder(
        model,  # pyrefly: ignore[bad-argument-type]
        mesh,
        cpu_offload=training.enable_cpu_offload,
        ep_degree=parallel_dims.ep,
        edp_mesh=edp_mesh,
        **common,  # pyrefly: ignore[bad-argument-type]
    )
    compat.force_sum_reduction_on_gloo(model)
