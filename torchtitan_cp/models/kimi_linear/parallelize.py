"""Expert, context and pipeline parallelism, activation checkpointing and FSDP for
``KimiLinearModel`` (tensor parallelism and compile are refused at config validation:
``check_kimi_linear_parallelism``, ``spec.check_run``)."""

from __future__ import annotations

from typing import Any

from torch import nn

from torchtitan_cp.models.blocks.experts import apply_fsdp_with_experts, parallelize_moe
from torchtitan_cp.models.blocks.pipeline import StagePlan, pipeline_decoder
from torchtitan_cp.models.kimi_linear.stages import stage_plan

__all__ = ["parallelize_kimi_linear", "pipeline_kimi_linear"]


def parallelize_kimi_linear(
    model: nn.Module,
    *,
    parallel_dims: Any,
    training: Any,
    parallelism: Any,
    compile_config: Any,
    ac_config: Any,
    dump_folder: str,
) -> nn.Module:
    """Expert parallelism (torchtitan's MoE modules shard their experts over the EP mesh and
    dispatch tokens all-to-all, as for Qwen3.5's MoE), context parallelism, activation
    checkpointing, then FSDP over the data-parallel mesh (dp_shard x cp; the experts over
    what EP leaves of it). The config check refuses the rest before any process group
    starts; this guards direct callers."""
    if parallel_dims.tp_enabled:
        raise NotImplementedError(
            "parallelism.tensor_parallel_degree > 1 is not built for kimi_linear yet"
        )
    if compile_config.enable and "model" in compile_config.components:
        raise NotImplementedError("compile.enable is not built for kimi_linear yet")
    if parallel_dims.ep_enabled:
        parallelize_moe(model, parallel_dims)
    # Under CP nothing more to wire: KDA layers read the routing (CP driver, conv halo) and
    # MLA layers gather their compressed latent (flex and sdpa) or pass K/V themselves, so
    # torchtitan's flex K/V all-gather wrapper is not applied.
    if ac_config is not None:
        ac_config.build(dump_folder=dump_folder).apply(model)
    if parallel_dims.fsdp_enabled:
        apply_fsdp_with_experts(
            model, parallel_dims=parallel_dims, training=training, parallelism=parallelism
        )
    return model


def pipeline_kimi_linear(
    model: nn.Module, **kwargs: Any
) -> tuple[Any, list[nn.Module], bool, bool]:
    """torchtitan's ``pipelining_fn`` for ``KimiLinearModel`` (``blocks.pipeline``): stages
    placed by ``parallelism.pipeline_parallel_split`` over its layer letters (``KKKA``) or by
    the cost model (``kimi_linear.stages``), each parallelized by ``parallelize_kimi_linear``.
    torchtitan's ``Decoder.forward`` skips what a stage lacks (embedding, norm, head)."""

    def plan(whole: nn.Module, n_stages: int, seq_len: int, split: str) -> StagePlan:
        return stage_plan(whole.config, n_stages, seq_len, split, model=whole)

    return pipeline_decoder(model, plan_fn=plan, **kwargs)
