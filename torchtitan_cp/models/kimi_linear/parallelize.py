"""Expert and context parallelism, activation checkpointing and FSDP for ``KimiLinearModel``
(tensor and pipeline parallelism and compile are refused at config validation:
``check_kimi_linear_parallelism``)."""

from __future__ import annotations

from typing import Any

from torch import nn

from torchtitan_cp.models.blocks.experts import apply_fsdp_with_experts, parallelize_moe

__all__ = ["parallelize_kimi_linear"]


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
    for on, key in (
        (parallel_dims.tp_enabled, "tensor_parallel_degree"),
        (parallel_dims.pp_enabled, "pipeline_parallel_degree"),
    ):
        if on:
            raise NotImplementedError(f"parallelism.{key} > 1 is not built for kimi_linear yet")
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
