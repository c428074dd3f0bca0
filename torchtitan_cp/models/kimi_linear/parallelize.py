"""Context parallelism, activation checkpointing and FSDP for ``KimiLinearModel`` (tensor,
expert and pipeline parallelism are refused at config validation:
``check_kimi_linear_parallelism``)."""

from __future__ import annotations

from typing import Any

from torch import nn
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.distributed.fsdp import apply_fsdp_to_decoder

from torchtitan_cp import compat
from torchtitan_cp.models.blocks.flex import apply_flex_context_parallel
from torchtitan_cp.models.blocks.routed_attention import RoutedInnerAttention

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
    """Context parallelism, activation checkpointing, then FSDP over the data-parallel mesh
    (dp_shard x cp, torchtitan's ``apply_fsdp_to_decoder``: one unit per layer, embeddings and
    head). The config check
    refuses the rest before any process group starts; this guards direct callers."""
    for on, key in (
        (parallel_dims.tp_enabled, "tensor_parallel_degree"),
        (parallel_dims.ep_enabled, "expert_parallel_degree"),
        (parallel_dims.pp_enabled, "pipeline_parallel_degree"),
    ):
        if on:
            raise NotImplementedError(f"parallelism.{key} > 1 is not built for kimi_linear yet")
    if compile_config.enable and "model" in compile_config.components:
        raise NotImplementedError("compile.enable is not built for kimi_linear yet")
    if parallel_dims.cp_enabled:
        # KDA layers read the routing (CP driver, conv halo) by construction; MLA layers on
        # flex get torchtitan's K/V all-gather (sdpa and pass-KV gather or pass K/V themselves).
        apply_flex_context_parallel(model, parallel_dims.get_mesh("cp"), RoutedInnerAttention)
    if ac_config is not None:
        ac_config.build(dump_folder=dump_folder).apply(model)
    if parallel_dims.fsdp_enabled:
        names = ["dp_replicate", "fsdp"] if parallel_dims.dp_replicate_enabled else ["fsdp"]
        apply_fsdp_to_decoder(
            model,  # pyrefly: ignore[bad-argument-type]
            parallel_dims.get_mesh(names),
            param_dtype=TORCH_DTYPE_MAP[training.mixed_precision_param],
            reduce_dtype=TORCH_DTYPE_MAP[training.mixed_precision_reduce],
            pp_enabled=False,
            cpu_offload=training.enable_cpu_offload,
            reshard_after_forward_policy=parallelism.fsdp_reshard_after_forward,
            ep_degree=1,
            edp_mesh=None,
        )
        compat.force_sum_reduction_on_gloo(model)
    return model
