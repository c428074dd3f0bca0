"""Apply activation checkpointing, compile and FSDP (over dp_shard × cp) to the hybrid decoder."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torchtitan.config import TORCH_DTYPE_MAP, CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.activation_checkpoint import ActivationCheckpointingConfig
from torchtitan.distributed.compile import apply_compile
from torchtitan.distributed.context_parallel import apply_cp_to_forward
from torchtitan.distributed.fsdp import apply_fsdp_to_decoder

from torchtitan_cp import platform
from torchtitan_cp.models.attention import SoftmaxAttention, resolve_attention_backend


def apply_flex_context_parallel(
    model: nn.Module, cp_mesh: DeviceMesh, layer_type: type[nn.Module] = SoftmaxAttention
) -> int:
    """torchtitan's CP path for flex attention: wrap every flex attention layer of
    ``layer_type`` (a module with ``backend``, ``cp_mode``, ``flex`` and ``flex_cp``; the hybrid
    decoder's ``SoftmaxAttention``, Qwen3.5's ``RoutedInnerAttention``) so it all-gathers K/V
    over ``cp_mesh`` (its queries and mask stay this rank's). Returns the number of layers
    wrapped; layers on the sdpa backend gather K/V themselves, pass-KV layers pass them."""
    # Any: the layer types share these attributes, not a base class.
    candidates: list[Any] = [
        m for m in model.modules() if isinstance(m, layer_type) and m.cp_mode == "all_gather"
    ]
    layers = [
        m for m in candidates if resolve_attention_backend(m.backend, cp_mesh.device_type) == "flex"
    ]
    if layers:
        apply_cp_to_forward([m.flex for m in layers], cp_mesh)
        for m in layers:
            m.flex_cp = True
    return len(layers)


def parallelize_hybrid(
    model: nn.Module,
    *,
    parallel_dims: ParallelDims,
    training: TrainingConfig,
    parallelism: ParallelismConfig,
    compile_config: CompileConfig,
    ac_config: ActivationCheckpointingConfig,
    dump_folder: str,
) -> nn.Module:
    """Context parallelism rewrites no module except flex attention (torchtitan's K/V
    all-gather, applied before FSDP as torchtitan requires): the KDA/GDN and sdpa attention
    layers read the per-microbatch ``SequenceContext`` and exchange states themselves. CP ranks
    hold the same parameters, so FSDP shards (and reduces gradients) over the flattened
    dp_shard × cp mesh."""
    if parallel_dims.tp_enabled:
        raise NotImplementedError(
            "parallelism.tensor_parallel_degree > 1 is not supported by the hybrid recipe"
        )
    if parallel_dims.ep_enabled:
        raise NotImplementedError(
            "the hybrid recipe has no experts: expert_parallel_degree must be 1"
        )
    if parallel_dims.cp_enabled:
        apply_flex_context_parallel(model, parallel_dims.get_mesh("cp"))
    if ac_config is not None:
        ac_config.build(dump_folder=dump_folder).apply(model)
    if compile_config.enable and "model" in compile_config.components:
        # Blocks of different kinds (K, G, A) share one forward code object, so dynamo sees
        # each new kind as a recompile; automatic dynamic shapes would then turn the kinds'
        # different parameter sizes into symbols. Keep every shape static: one graph per kind.
        torch._dynamo.config.automatic_dynamic_shapes = False
        apply_compile(model, compile_config=compile_config, parallel_dims=parallel_dims)
    if parallel_dims.fsdp_enabled:
        names = ["dp_replicate", "fsdp"] if parallel_dims.dp_replicate_enabled else ["fsdp"]
        apply_fsdp_to_decoder(
            model,  # pyrefly: ignore [bad-argument-type]
            parallel_dims.get_mesh(names),
            param_dtype=TORCH_DTYPE_MAP[training.mixed_precision_param],
            reduce_dtype=TORCH_DTYPE_MAP[training.mixed_precision_reduce],
            pp_enabled=parallel_dims.pp_enabled,
            cpu_offload=training.enable_cpu_offload,
            reshard_after_forward_policy=parallelism.fsdp_reshard_after_forward,
        )
        platform.force_sum_reduction_on_gloo(model)
    return model
