"""Tensor, expert and context parallelism, activation checkpointing, compile and FSDP for
``Qwen35TextModel``."""

from __future__ import annotations

from typing import Any, cast

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleOutput,
    RowwiseParallel,
    parallelize_module,
)
from torchtitan.distributed.compile import apply_compile
from torchtitan.models.qwen3_5.model import Qwen35TransformerBlock

from torchtitan_cp.models.blocks.experts import apply_fsdp_with_experts, parallelize_moe
from torchtitan_cp.models.blocks.flex import apply_flex_context_parallel
from torchtitan_cp.models.blocks.pipeline import StagePlan, pipeline_decoder
from torchtitan_cp.models.blocks.tensor_parallel import (
    check_all_on_tp_mesh,
    distribute_parameter,
    parallelize_decoder_ends,
    read_locally,
    sequence_parallel_block,
)
from torchtitan_cp.models.qwen35.model import Qwen35TextModel, check_qwen35_tensor_parallel
from torchtitan_cp.models.qwen35.stages import stage_plan

__all__ = ["apply_tensor_parallel_qwen35", "parallelize_qwen35", "pipeline_qwen35"]


def apply_tensor_parallel_qwen35(model: nn.Module, tp_mesh: DeviceMesh, ep: int = 1) -> None:
    """Tensor parallelism over heads with sequence parallelism, on torch's plans as for the
    hybrid decoder (``blocks/tensor_parallel.py``), not upstream's ``model.parallelize``:
    upstream's sharding configs are written for its spmd_types backend and its own kernel,
    conv and attention, which this recipe swaps. ``ep``: the EP degree (for the config check).

    GatedDeltaNet: the six input projections column-wise (GQA: a rank's key heads serve its
    value heads, both counts dividing by TP), each short conv with its channels (``Shard(0)``,
    read by the swapped conv), ``A_log`` / ``dt_bias`` with their heads, the gated norm's
    weight replicated, ``out_proj`` row-wise. Gated attention: wq (query + gate) / wk / wv
    column-wise, the q/k norms' weights replicated, wo row-wise. Upstream's forwards read those
    parameters directly on local tensors, so ``read_locally`` hands them the local values.

    MoE layers are upstream's own (torchtitan's sharding configs, set by the model config and
    applied by ``parallelize_moe`` after this): here only their boundary with the block, whose
    residual stream is local tensors ``[B, L / TP, D]``; the caller then runs
    ``check_all_on_tp_mesh``."""
    check_qwen35_tensor_parallel(model.config, tp_mesh.size(), ep)  # pyrefly: ignore [bad-argument-type]
    parallelize_decoder_ends(model, tp_mesh)
    layers = model.get_submodule("layers")
    for block in layers.children():
        assert isinstance(block, Qwen35TransformerBlock)
        attn: Any = block.attn
        # GatedDeltaNet is called with (x, masks), the gated attention with (x, masks, positions)
        ffn = None if block.moe_enabled else "feed_forward"
        sequence_parallel_block(block, tp_mesh, "attn", 3 if block.full_attn else 2, ffn)
        if block.moe_enabled:
            # torchtitan's MoE takes ffn_norm's sequence-parallel DTensor as it is and returns
            # one (its config's out_dst, Shard(1)); the residual add needs the local shard.
            parallelize_module(
                block,
                tp_mesh,
                {
                    "moe": PrepareModuleOutput(
                        output_layouts=Shard(1),
                        desired_output_layouts=Shard(1),
                        use_local_output=True,
                    )
                },
            )
        if block.full_attn:
            columns, row = ("wq", "wk", "wv"), "wo"
            read_locally(attn.q_norm, ["weight"], tp_mesh, shard=False)
            read_locally(attn.k_norm, ["weight"], tp_mesh, shard=False)
        else:
            columns = tuple(f"in_proj_{x}" for x in "qkvzab")
            row = "out_proj"
            for conv in (attn.conv_q, attn.conv_k, attn.conv_v):
                distribute_parameter(conv, "weight", tp_mesh, shard=True)
            read_locally(attn, ["A_log", "dt_bias"], tp_mesh, shard=True)
            read_locally(attn.norm, ["weight"], tp_mesh, shard=False)
        plan: dict = {name: ColwiseParallel() for name in columns}
        plan[row] = RowwiseParallel(output_layouts=Shard(1))
        parallelize_module(attn, tp_mesh, plan)


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
    """Tensor, expert and context parallelism, activation checkpointing, compile and FSDP for
    ``Qwen35TextModel``.

    The GatedDeltaNet kernels and convs already read the microbatch's routing (swapped at
    construction), so CP only adds torchtitan's K/V all-gather to flex attention layers (before
    FSDP, as torchtitan requires). CP ranks hold the same parameters: FSDP shards and reduces
    gradients over the flattened dp_shard x cp mesh, as for the hybrid decoder."""
    if parallel_dims.tp_enabled:
        apply_tensor_parallel_qwen35(model, parallel_dims.get_mesh("tp"), parallel_dims.ep)
    if parallel_dims.tp_enabled or parallel_dims.ep_enabled:
        parallelize_moe(model, parallel_dims)  # torchtitan's MoE sharding: TP, EP, EP x TP
    if parallel_dims.tp_enabled:
        check_all_on_tp_mesh(model)
    vision = getattr(model, "vision_encoder", None)
    if parallel_dims.cp_enabled:
        if vision is not None:
            raise NotImplementedError("Qwen3.5's vision encoder cannot run under CP")
        apply_flex_context_parallel(model, parallel_dims.get_mesh("cp"))
    if ac_config is not None:
        ac_config.build(dump_folder=dump_folder).apply(model)
    if compile_config.enable and "model" in compile_config.components:
        apply_compile(model, compile_config=compile_config, parallel_dims=parallel_dims)
    if parallel_dims.fsdp_enabled:
        apply_fsdp_with_experts(
            model,
            parallel_dims=parallel_dims,
            training=training,
            parallelism=parallelism,
            encoder=vision,
        )
    return model


def pipeline_qwen35(model: nn.Module, **kwargs: Any) -> tuple[Any, list[nn.Module], bool, bool]:
    """torchtitan's ``pipelining_fn`` for ``Qwen35TextModel`` (``blocks.pipeline``): stages
    placed by ``parallelism.pipeline_parallel_split`` over its layer letters (``GGGA``) or by the
    cost model (``qwen35.stages``), each parallelized by ``parallelize_qwen35``. Upstream's
    forward already skips what a stage lacks (embedding, norm, head)."""

    def plan(whole: nn.Module, n_stages: int, seq_len: int, split: str) -> StagePlan:
        cfg = cast(Qwen35TextModel, whole).config
        return stage_plan(cfg, n_stages, seq_len, split, model=whole)

    return pipeline_decoder(model, plan_fn=plan, **kwargs)
