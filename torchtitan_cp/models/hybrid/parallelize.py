"""Apply tensor parallelism (heads, sequence parallel), context parallelism (flex K/V
all-gather), activation checkpointing, compile and FSDP (over dp_shard × cp) to the hybrid
decoder."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torchtitan.config import TORCH_DTYPE_MAP, CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.activation_checkpoint import ActivationCheckpointingConfig
from torchtitan.distributed.compile import apply_compile
from torchtitan.distributed.fsdp import apply_fsdp_to_decoder

from torchtitan_cp import compat
from torchtitan_cp.models.blocks.flex import apply_flex_context_parallel
from torchtitan_cp.models.blocks.pipeline import StagePlan, pipeline_decoder
from torchtitan_cp.models.blocks.tensor_parallel import (
    check_all_on_tp_mesh,
    parallelize_decoder_ends,
    sequence_parallel_block,
)
from torchtitan_cp.models.hybrid.decoder import HybridBlock, HybridDecoder
from torchtitan_cp.models.hybrid.layers import check_tensor_parallel
from torchtitan_cp.models.hybrid.stages import stage_plan

__all__ = ["apply_tensor_parallel", "parallelize_hybrid", "pipeline_hybrid"]


def apply_tensor_parallel(model: HybridDecoder, tp_mesh: DeviceMesh) -> None:
    """Tensor parallelism over heads with sequence parallelism, torchtitan's Llama plan
    (``blocks/tensor_parallel.py``): the ends of the decoder (``parallelize_decoder_ends``), each
    block's norms sequence-parallel, its mixer and feed-forward gathering their input
    (``Shard(1)`` -> ``Replicate``) and reduce-scattering their output projection. Each mixer
    shards its own heads (``parallelize_heads``, one per kind). A mixer's input arrives as a
    local tensor, so the CP collectives inside it run on plain tensors of the rank's heads,
    over the CP group of its TP rank."""
    cfg = model.config
    if cfg.enable_weight_tying:
        raise ValueError(
            "model.enable_weight_tying cannot be combined with parallelism."
            "tensor_parallel_degree > 1 (the embedding is row-sharded, the LM head column-sharded)"
        )
    check_tensor_parallel(cfg, tp_mesh.size())
    parallelize_decoder_ends(model, tp_mesh)
    for block in model.layers.values():
        assert isinstance(block, HybridBlock)
        # the mixer is called with (x, ctx, positions): only x is sharded
        sequence_parallel_block(block, tp_mesh, "mixer", 3, "feed_forward")
        block.mixer.parallelize_heads(tp_mesh)
    check_all_on_tp_mesh(model)


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
    dp_shard × cp mesh. Tensor parallelism (``apply_tensor_parallel``) comes first, as in
    torchtitan: FSDP then shards the TP-sharded parameters over its own mesh."""
    if parallel_dims.tp_enabled:
        assert isinstance(model, HybridDecoder)
        apply_tensor_parallel(model, parallel_dims.get_mesh("tp"))
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
        compat.force_sum_reduction_on_gloo(model)
    return model


def pipeline_hybrid(model: nn.Module, **kwargs: Any) -> tuple[Any, list[nn.Module], bool, bool]:
    """torchtitan's ``pipelining_fn`` for the hybrid decoder (``blocks.pipeline``): stages
    placed by ``parallelism.pipeline_parallel_split`` or the cost model (``stage_plan``), each
    parallelized by ``parallelize_hybrid``."""

    def plan(whole: nn.Module, n_stages: int, seq_len: int, split: str) -> StagePlan:
        assert isinstance(whole, HybridDecoder)
        return stage_plan(whole.config, n_stages, seq_len, split, model=whole)

    return pipeline_decoder(model, plan_fn=plan, **kwargs)
