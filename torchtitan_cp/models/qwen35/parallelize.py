"""Context parallelism, activation checkpointing, compile and FSDP for ``Qwen35TextModel``."""

from __future__ import annotations

from typing import Any

from torch import nn
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.distributed.compile import apply_compile
from torchtitan.distributed.fsdp import apply_fsdp_to_decoder, apply_fsdp_to_vision_encoder

from torchtitan_cp import compat
from torchtitan_cp.models.blocks.flex import apply_flex_context_parallel
from torchtitan_cp.models.qwen35.model import RoutedInnerAttention

__all__ = ["parallelize_qwen35"]


def parallelize_qwen35(
    model: nn.Module,
    *,
    parallel_dims: Any,
    training: Any,
    parallelism: Any,
    compile_config: Any,
    ac_config: Any,
    dump_folder: str,
) -> nn.Module:
    """Context parallelism, activation checkpointing, compile and FSDP for ``Qwen35TextModel``.

    The GatedDeltaNet kernels and convs already read the microbatch's routing (swapped at
    construction), so CP only adds torchtitan's K/V all-gather to flex attention layers (before
    FSDP, as torchtitan requires). CP ranks hold the same parameters: FSDP shards and reduces
    gradients over the flattened dp_shard x cp mesh, as for the hybrid decoder."""
    for key, on in (("tensor_parallel_degree", parallel_dims.tp_enabled),
                    ("expert_parallel_degree", parallel_dims.ep_enabled),
                    ("pipeline_parallel_degree", parallel_dims.pp_enabled)):  # fmt: skip
        if on:
            raise NotImplementedError(f"parallelism.{key} > 1 is not supported for qwen3_5")
    vision = getattr(model, "vision_encoder", None)
    if parallel_dims.cp_enabled:
        if vision is not None:
            raise NotImplementedError("Qwen3.5's vision encoder cannot run under CP")
        apply_flex_context_parallel(model, parallel_dims.get_mesh("cp"), RoutedInnerAttention)
    if ac_config is not None:
        ac_config.build(dump_folder=dump_folder).apply(model)
    if compile_config.enable and "model" in compile_config.components:
        apply_compile(model, compile_config=compile_config, parallel_dims=parallel_dims)
    if parallel_dims.fsdp_enabled:
        names = ["dp_replicate", "fsdp"] if parallel_dims.dp_replicate_enabled else ["fsdp"]
        mesh = parallel_dims.get_mesh(names)
        common = dict(
            param_dtype=TORCH_DTYPE_MAP[training.mixed_precision_param],
            reduce_dtype=TORCH_DTYPE_MAP[training.mixed_precision_reduce],
            reshard_after_forward_policy=parallelism.fsdp_reshard_after_forward,
            pp_enabled=False,
        )
        if vision is not None:
            apply_fsdp_to_vision_encoder(vision, mesh, **common)  # pyrefly: ignore[bad-argument-type]
        apply_fsdp_to_decoder(
            model,  # pyrefly: ignore[bad-argument-type]
            mesh,
            cpu_offload=training.enable_cpu_offload,
            **common,  # pyrefly: ignore[bad-argument-type]
        )
        compat.force_sum_reduction_on_gloo(model)
    return model
