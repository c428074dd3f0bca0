"""Apply tensor parallelism (heads, sequence parallel), context parallelism (flex K/V
all-gather), activation checkpointing, compile and FSDP (over dp_shard × cp) to the hybrid
decoder."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torchtitan.config import TORCH_DTYPE_MAP, CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.activation_checkpoint import ActivationCheckpointingConfig
from torchtitan.distributed.compile import apply_compile
from torchtitan.distributed.fsdp import apply_fsdp_to_decoder
from torchtitan.models.common.embedding import Embedding

from torchtitan_cp import compat
from torchtitan_cp.models.blocks.flex import apply_flex_context_parallel
from torchtitan_cp.models.hybrid.decoder import HybridBlock, HybridDecoder
from torchtitan_cp.models.hybrid.layers import check_tensor_parallel
from torchtitan_cp.models.mixers.attention import SoftmaxAttention

__all__ = ["apply_tensor_parallel", "parallelize_hybrid"]


def _vocab_parallel_embedding(embedding: Embedding, tp_mesh: DeviceMesh) -> None:
    """torchtitan's ``Embedding`` runs vocab-parallel itself once it has a TP group (its
    forward reads the weight's local rows and returns this rank's partial sum), so torch's
    ``RowwiseParallel`` (which expects DTensor math) does not apply: shard the rows, give it
    the group, and turn its partial output into the sequence-parallel layout (reduce-scatter
    over the tokens). The residual stream is local tensors ``[B, L / TP, D]``, as in
    torchtitan's plan."""
    embedding.tp_group = tp_mesh.get_group()

    def shard_rows(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for key, p in list(module.named_parameters(recurse=False)):
            dt = distribute_tensor(p.data, mesh, [Shard(0)])
            module.register_parameter(key, nn.Parameter(dt, requires_grad=p.requires_grad))

    def to_sequence_parallel(
        module: nn.Module, out: torch.Tensor, mesh: DeviceMesh
    ) -> torch.Tensor:
        partial = DTensor.from_local(out, mesh, [Partial()], run_check=False)
        return partial.redistribute(placements=[Shard(1)]).to_local()

    # torch types output_fn as returning None; a returned value replaces the output.
    distribute_module(embedding, tp_mesh, shard_rows, output_fn=to_sequence_parallel)  # pyrefly: ignore [bad-argument-type]


def apply_tensor_parallel(model: HybridDecoder, tp_mesh: DeviceMesh) -> None:
    """Tensor parallelism over heads with sequence parallelism, torchtitan's Llama plan: the
    embedding row-wise into ``Shard(1)`` (tokens of the rank's local span split over TP), the
    norms sequence-parallel (the last one gathering for the LM head), each mixer and feed-forward gathering its input
    (``Shard(1)`` -> ``Replicate``) and reduce-scattering its output; the LM head column-wise
    with replicated logits. Each mixer shards its own heads (``parallelize_heads``, one per
    kind). A mixer's input arrives as a local tensor, so the CP collectives inside it run on
    plain tensors of the rank's heads, over the CP group of its TP rank."""
    cfg = model.config
    if cfg.enable_weight_tying:
        raise ValueError(
            "model.enable_weight_tying cannot be combined with parallelism."
            "tensor_parallel_degree > 1 (the embedding is row-sharded, the LM head column-sharded)"
        )
    check_tensor_parallel(cfg, tp_mesh.size())
    _vocab_parallel_embedding(model.tok_embeddings, tp_mesh)
    # The final norm hands the LM head replicated hidden states (torchtitan's chunked loss
    # splits them along the sequence itself, next to the replicated labels).
    parallelize_module(model.norm, tp_mesh, SequenceParallel())
    parallelize_module(model, tp_mesh, {
        "norm": PrepareModuleOutput(
            output_layouts=Shard(1), desired_output_layouts=Replicate(), use_local_output=True
        ),
        "lm_head": ColwiseParallel(output_layouts=Replicate()),
    })  # fmt: skip
    for block in model.layers.values():
        assert isinstance(block, HybridBlock)
        parallelize_module(block, tp_mesh, {
            "attention_norm": SequenceParallel(),
            # (x, ctx, positions): only x is sharded.
            "mixer": PrepareModuleInput(
                input_layouts=(Shard(1), None, None),
                desired_input_layouts=(Replicate(), None, None),
                use_local_output=True,
            ),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
            ),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w3": ColwiseParallel(),
        })  # fmt: skip
        block.mixer.parallelize_heads(tp_mesh)
    # Gradient clipping and the fused optimizer expect every parameter on the TP mesh.
    plain = [n for n, p in model.named_parameters() if not isinstance(p, DTensor)]
    if plain:
        raise RuntimeError(f"tensor parallelism left parameters unsharded: {plain[:5]}")


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
        apply_flex_context_parallel(model, parallel_dims.get_mesh("cp"), SoftmaxAttention)
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
