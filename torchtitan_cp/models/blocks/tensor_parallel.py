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
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

__all__ = ["distribute_parameter", "head_rows", "local", "tp_heads"]


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
