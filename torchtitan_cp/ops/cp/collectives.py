"""Differentiable collectives used by the context-parallel ops.

Only one primitive is needed: an all-gather along dim 0 whose backward is a sum
reduce-scatter, so every rank's contribution to a gathered tensor's gradient
reaches the rank that owns those rows. Works on gloo (CPU) and NCCL (CUDA).

Under ``torch.compile`` the same collectives are torch's functional ones
(``_functional_collectives``), which dynamo traces into the graph without a break; eager runs
keep the in-place c10d calls.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import Tensor

if TYPE_CHECKING:
    from torchtitan_cp.routing import DeviceRouting

__all__ = [
    "Pending",
    "all_gather_autograd",
    "all_gather_start",
    "all_gather_plain",
    "check_routing_group",
    "group_rank",
    "group_size",
]


def group_size(group: dist.ProcessGroup | None) -> int:
    """World size of ``group``; 1 when ``group`` is None or distributed is not initialised."""
    if group is None or not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup | None) -> int:
    """This process's rank inside ``group``; 0 when running unsharded."""
    if group is None or not dist.is_available() or not dist.is_initialized():
        return 0
    return dist.get_rank(group)


# torch 2.14 renamed the single-tensor collectives (the old names warn); older torch has only
# the old names. Same semantics either way.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
# The functional all-gathers (the autograd one's backward is a reduce-scatter sum): renamed in
# torch 2.14 as well.
_funcol_all_gather_autograd = (
    getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd
)
_funcol_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor


def check_routing_group(
    routing: DeviceRouting, group: dist.ProcessGroup | None, num_tokens: int
) -> None:
    """Fail early (host ints only) if ``routing`` was built for another rank, world or span:
    slot ids would silently index the wrong rows of the gathered buffers."""
    world, rank = group_size(group), group_rank(group)
    if (routing.world_size, routing.rank) != (world, rank):
        raise ValueError(
            f"routing is for rank {routing.rank} of {routing.world_size}, but this process is "
            f"rank {rank} of {world} in the given group"
        )
    if routing.num_tokens != num_tokens:
        raise ValueError(
            f"inputs have {num_tokens} tokens but routing.num_tokens is {routing.num_tokens}"
        )


def _gather_flat(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    # gloo rejects a stacked [world, n, ...] output for the single-tensor gather, so the
    # output is always the flat [world * n, ...] layout (the same bytes either way).
    x = x.contiguous()
    out = x.new_empty((group_size(group) * x.shape[0], *x.shape[1:]))
    _all_gather_single(out, x, group=group)
    return out


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:  # type: ignore[override]
        ctx.group = group
        ctx.rows = x.shape[0]
        return _gather_flat(x, group)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        # Rows of the gathered tensor belong to their source rank: summing every rank's
        # cotangent for those rows and handing the sum to the owner is a reduce-scatter.
        grad = grad.contiguous()
        out = grad.new_empty((ctx.rows, *grad.shape[1:]))
        _reduce_scatter_single(out, grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return out, None


class _AllGatherStart(torch.autograd.Function):
    """The all-gather posted asynchronously (``async_op=True``); the returned buffer is filled
    when ``Pending.wait`` returns. The backward is ``_AllGather``'s reduce-scatter."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup, pending: Pending) -> Tensor:  # type: ignore[override]
        ctx.group = group
        ctx.rows = x.shape[0]
        x = x.contiguous()
        out = x.new_empty((group_size(group) * x.shape[0], *x.shape[1:]))
        pending._work = _all_gather_single(out, x, group=group, async_op=True)
        pending._keep = x  # the send buffer must outlive the collective
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:  # type: ignore[override]
        return _AllGather.backward(ctx, grad)[0], None, None


class Pending:
    """An all-gather in flight (``all_gather_start``). ``wait()`` returns the gathered tensor
    (differentiable as ``all_gather_autograd``'s), blocking only if the collective has not
    finished; call it once every state-independent computation has been issued."""

    def __init__(self) -> None:
        self._work = None
        self._keep: Tensor | None = None
        self._out: Tensor | None = None

    def wait(self) -> Tensor:
        if self._work is not None:
            self._work.wait()
            self._work = self._keep = None
        assert self._out is not None
        return self._out


def all_gather_start(x: Tensor, group: dist.ProcessGroup | None) -> Pending:
    """Post the all-gather of ``x [n, ...]`` into ``[world * n, ...]`` and return at once.

    Eager runs use c10d's asynchronous collective (gloo and NCCL run it beside the caller:
    gloo on its own threads, NCCL on its own stream), so the caller computes while it is in
    flight. Under ``torch.compile`` (and in world 1) it is ``all_gather_autograd`` itself,
    already finished: the compiler schedules the functional collective.
    """
    pending = Pending()
    if group_size(group) == 1 or torch.compiler.is_compiling():
        pending._out = all_gather_autograd(x, group)
        return pending
    assert group is not None
    pending._out = _AllGatherStart.apply(x, group, pending)
    return pending


def all_gather_autograd(x: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """All-gather ``x [n, ...]`` into ``[world * n, ...]`` (rank r's rows at ``r*n:(r+1)*n``).

    Differentiable: the backward reduce-scatters (sums) the cotangent to the owning ranks.
    Every rank must call it with the same shape and dtype; with ``group=None`` (or world 1)
    it returns ``x`` unchanged. If ``x`` requires grad on one rank it must on all of them,
    and every rank must then run the backward, or the reduce-scatter waits forever.
    """
    if group_size(group) == 1:
        return x
    assert group is not None
    if torch.compiler.is_compiling():
        return _funcol_all_gather_autograd(x.contiguous(), 0, group)
    return _AllGather.apply(x, group)


def all_gather_plain(x: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """Non-differentiable all-gather of ``x [n, ...]`` into ``[world * n, ...]`` (for ids)."""
    if group is None or group_size(group) == 1:
        return x
    if torch.compiler.is_compiling():
        return _funcol_all_gather(x.detach().contiguous(), 0, group)
    with torch.no_grad():
        return _gather_flat(x, group)
