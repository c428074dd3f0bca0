"""Tensor parallelism over heads: what the mixers need beyond torch's ``parallelize_module``.

torch's plans (``ColwiseParallel``, ``RowwiseParallel``, ``SequenceParallel``,
``PrepareModuleInput``) and torchtitan's ``NoParallel`` shard every projection and norm of a
block (``models/hybrid/parallelize.py``); a mixer then runs on local tensors holding its rank's
heads, so the CP driver, the conv halo and attention's K/V exchange run per TP rank on those
heads with the routing of its CP rank unchanged. Two things the plans cannot express are here:

* ``local(p)``: a parameter read inside the mixer's local computation. A per-head parameter
  (``Shard(0)``) is its shard. A replicated one (a per-channel norm weight shared by the heads,
  the short conv's weight) is read whole, and its gradient on each rank is only the part of its
  own heads: DTensor would leave that gradient ``Partial``, which FSDP's reduce-scatter does
  not reduce over TP, so the gradient is all-reduced over the TP group here (Megatron's
  copy-to-region).
* ``head_rows``: the rows of a channel-concatenated parameter (``[q | k | v]`` of the short
  conv) that hold this rank's heads of every segment; a contiguous ``Shard(0)`` would give a
  rank whole segments instead.
* ``column_input``: the input of a column-parallel matmul written by hand (Mamba2's input
  projections, read as one matrix): its gradient, each rank's part from its own columns, is
  summed over TP, as ``ColwiseParallel``'s input hook does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
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
from torchtitan.models.common.embedding import Embedding

__all__ = [
    "distribute_parameter",
    "check_all_on_tp_mesh",
    "column_input",
    "head_rows",
    "parallelize_decoder_ends",
    "local",
    "read_locally",
    "sequence_parallel_block",
    "tp_heads",
    "vocab_parallel_embedding",
]


class _AllReduceGrad(torch.autograd.Function):
    """Identity forward; backward sums the gradient over ``group`` (each rank's part comes
    from its own heads)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def local(p: torch.Tensor) -> torch.Tensor:
    """``p`` as a plain tensor for a local computation: itself off TP, its shard when it is
    sharded over TP, the whole value (gradient summed over TP) when it is replicated."""
    if not isinstance(p, DTensor):
        return p
    if all(isinstance(pl, Replicate) for pl in p.placements):
        return _AllReduceGrad.apply(p.to_local(), p.device_mesh.get_group())
    return p.to_local()


def column_input(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x`` (a plain tensor, the same on every TP rank) as the input of a matmul with the
    column-sharded ``weight``: itself, but under TP its gradient (each rank's part, from the
    rank's columns) is summed over the TP group (Megatron's copy-to-region); off TP ``x``."""
    if isinstance(weight, DTensor) and any(isinstance(p, Shard) for p in weight.placements):
        return _AllReduceGrad.apply(x, weight.device_mesh.get_group())
    return x


def distribute_parameter(module: nn.Module, name: str, mesh: DeviceMesh, shard: bool) -> None:
    """Replace ``module.<name>`` with a DTensor parameter over the TP ``mesh``: ``Shard(0)``
    (one slice of heads per rank) or ``Replicate()``."""
    p = getattr(module, name)
    placement = Shard(0) if shard else Replicate()
    dt = distribute_tensor(p.data, mesh, [placement])
    module.register_parameter(name, nn.Parameter(dt, requires_grad=p.requires_grad))


def tp_heads(mesh: DeviceMesh, heads: int, what: str) -> int:
    """Heads per rank of ``heads`` over the TP ``mesh``; a ValueError naming ``what``."""
    tp = mesh.size()
    if heads % tp:
        raise ValueError(
            f"{what} ({heads}) is not divisible by parallelism.tensor_parallel_degree ({tp})"
        )
    return heads // tp


def head_rows(segments: Sequence[int], rank: int, world: int) -> list[tuple[int, int]]:
    """Row ranges ``[start, end)`` of a parameter whose rows concatenate ``segments`` (each
    a multiple of ``world``, heads contiguous inside it) that hold rank ``rank``'s part of each
    segment."""
    rows, start = [], 0
    for size in segments:
        part = size // world
        rows.append((start + rank * part, start + (rank + 1) * part))
        start += size
    return rows


def vocab_parallel_embedding(embedding: nn.Module, tp_mesh: DeviceMesh) -> None:
    """torchtitan's ``Embedding`` runs vocab-parallel itself once it has a TP group (its
    forward reads the weight's local rows and returns this rank's partial sum), so torch's
    ``RowwiseParallel`` (which expects DTensor math) does not apply: shard the rows, give it
    the group, and turn its partial output into the sequence-parallel layout (reduce-scatter
    over the tokens). The residual stream is local tensors ``[B, L / TP, D]``, as in
    torchtitan's plan."""
    assert isinstance(embedding, Embedding)
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


def sequence_parallel_block(
    block: nn.Module, tp_mesh: DeviceMesh, mixer: str, mixer_args: int, ffn: str | None
) -> None:
    """torchtitan's plan for one pre-norm block: ``attention_norm`` and ``ffn_norm``
    sequence-parallel; the ``mixer`` submodule (called with ``mixer_args`` positional
    arguments, the first the hidden states) and the feed-forward ``ffn`` (w1/w2/w3; None: the
    caller shards it) gather their input and reduce-scatter their output projection."""
    others = (None,) * (mixer_args - 1)
    plan: dict = {
        "attention_norm": SequenceParallel(),
        mixer: PrepareModuleInput(
            input_layouts=(Shard(1), *others),
            desired_input_layouts=(Replicate(), *others),
            use_local_output=True,
        ),
        "ffn_norm": SequenceParallel(),
    }
    if ffn is not None:
        plan |= {
            ffn: PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
            ),
            f"{ffn}.w1": ColwiseParallel(),
            f"{ffn}.w2": RowwiseParallel(output_layouts=Shard(1)),
            f"{ffn}.w3": ColwiseParallel(),
        }
    parallelize_module(block, tp_mesh, plan)


def read_locally(module: nn.Module, names: Sequence[str], mesh: DeviceMesh, shard: bool) -> None:
    """Distribute ``module``'s parameters ``names`` over the TP ``mesh`` (``Shard(0)``: per
    head; else replicated) for a module whose forward is not ours (torchtitan's Qwen3.5 layers
    read ``self.A_log``, a norm's ``self.weight`` directly on local tensors): for the duration
    of each call the module sees ``local(p)`` in their place, and the DTensor parameters
    (what FSDP, the optimizer and checkpoints see) are put back after it."""
    for name in names:
        distribute_parameter(module, name, mesh, shard)
    saved: list[dict[str, nn.Parameter | None]] = []

    def swap_in(mod: nn.Module, args: object) -> None:
        params = {name: mod._parameters[name] for name in names}
        saved.append(params)
        for name, p in params.items():
            assert p is not None
            # a plain tensor where a Parameter sits: nn.Module reads it like one
            mod._parameters[name] = local(p)  # pyrefly: ignore [unsupported-operation]

    def swap_back(mod: nn.Module, args: object, out: object) -> None:
        for name, p in saved.pop().items():
            mod._parameters[name] = p

    module.register_forward_pre_hook(swap_in)
    module.register_forward_hook(swap_back, always_call=True)


def parallelize_decoder_ends(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """The ends of a decoder (``tok_embeddings``, ``norm``, ``lm_head``) as torchtitan shards
    them with sequence parallelism: the embedding vocab-parallel into ``Shard(1)``, the final
    norm sequence-parallel and gathering its output (torchtitan's chunked loss splits the
    replicated hidden states itself, next to the replicated labels), the LM head column-wise
    with replicated logits. A pipeline stage holds some of them (the others None): it shards
    those it has."""
    if getattr(model, "tok_embeddings", None) is not None:
        vocab_parallel_embedding(model.get_submodule("tok_embeddings"), tp_mesh)
    plan: dict[str, Any] = {}
    if getattr(model, "norm", None) is not None:
        parallelize_module(model.get_submodule("norm"), tp_mesh, SequenceParallel())
        plan["norm"] = PrepareModuleOutput(
            output_layouts=Shard(1), desired_output_layouts=Replicate(), use_local_output=True
        )
    if getattr(model, "lm_head", None) is not None:
        plan["lm_head"] = ColwiseParallel(output_layouts=Replicate())
    if plan:
        parallelize_module(model, tp_mesh, plan)


def check_all_on_tp_mesh(model: nn.Module) -> None:
    """Gradient clipping and the fused optimizer expect every parameter on the TP mesh: a
    RuntimeError naming the ones a plan left out."""
    plain = [n for n, p in model.named_parameters() if not isinstance(p, DTensor)]
    if plain:
        raise RuntimeError(f"tensor parallelism left parameters unsharded: {plain[:5]}")
