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


class _Flight:
    """One all-gather and its backward's reduce-scatter, each in flight between two autograd
    nodes (``all_gather_start``). Holds the c10d works and the buffers they must outlive."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.rows = 0
        self.work = None  # the forward's all-gather
        self.send: Tensor | None = None
        self.out: Tensor | None = None
        self.rs_work = None  # the backward's reduce-scatter
        self.rs_send: Tensor | None = None
        self.rs_out: Tensor | None = None


class _Post(torch.autograd.Function):
    """Posts the all-gather of ``x`` (``async_op=True``) and returns a token, an empty tensor
    that ties ``_Land`` to ``x`` in the graph. Backward: waits for the reduce-scatter that
    ``_Land``'s backward posted and hands its rows to ``x``.

    Why two nodes: autograd runs the ready node with the highest sequence number first, so the
    state-independent local work created between this node and ``_Land`` (issued while the
    all-gather is in flight) runs, in the backward, after ``_Land``'s backward has posted the
    reduce-scatter and before this node waits for it. One node posting and waiting (a blocking
    reduce-scatter) would leave nothing to overlap: by then that work has already run."""

    @staticmethod
    def forward(ctx, x: Tensor, flight: _Flight) -> Tensor:  # type: ignore[override]
        ctx.flight = flight
        x = x.contiguous()
        flight.rows = x.shape[0]
        flight.out = x.new_empty((group_size(flight.group) * x.shape[0], *x.shape[1:]))
        flight.work = _all_gather_single(flight.out, x, group=flight.group, async_op=True)
        flight.send = x  # the send buffer must outlive the collective
        return x.new_empty(0)

    @staticmethod
    def backward(ctx, _token_grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        flight = ctx.flight
        if flight.rs_work is None or flight.rs_out is None:
            raise RuntimeError("all_gather_start: the gathered tensor's backward did not run")
        flight.rs_work.wait()
        grad = flight.rs_out
        flight.rs_work = flight.rs_send = flight.rs_out = None
        return grad, None


class _Land(torch.autograd.Function):
    """Waits for ``_Post``'s all-gather and returns the gathered tensor. Backward: posts the
    reduce-scatter (a sum to the rows' owners, as ``_AllGather``'s) and returns at once; the
    ``_Post`` node waits for it."""

    @staticmethod
    def forward(ctx, token: Tensor, flight: _Flight) -> Tensor:  # type: ignore[override]
        ctx.flight = flight
        ctx.token_meta = (token.shape, token.dtype, token.device)
        assert flight.work is not None and flight.out is not None
        flight.work.wait()
        out, flight.work, flight.send, flight.out = flight.out, None, None, None
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        flight = ctx.flight
        grad = grad.contiguous()
        flight.rs_out = grad.new_empty((flight.rows, *grad.shape[1:]))
        flight.rs_send = grad
        flight.rs_work = _reduce_scatter_single(
            flight.rs_out, grad, op=dist.ReduceOp.SUM, group=flight.group, async_op=True
        )
        shape, dtype, device = ctx.token_meta
        return torch.zeros(shape, dtype=dtype, device=device), None


class Pending:
    """An all-gather in flight (``all_gather_start``). ``wait()`` returns the gathered tensor
    (differentiable as ``all_gather_autograd``'s), blocking only if the collective has not
    finished; call it once every state-independent computation has been issued. Its backward
    overlaps in the same way: the reduce-scatter is posted where ``wait()`` was called and
    waited for where ``all_gather_start`` was, so the backward of the work issued in between
    runs while it is in flight."""

    def __init__(self) -> None:
        self._flight: _Flight | None = None
        self._token: Tensor | None = None
        self._out: Tensor | None = None

    def wait(self) -> Tensor:
        if self._out is None:
            assert self._flight is not None and self._token is not None
            self._out = _Land.apply(self._token, self._flight)
            self._token = None
        return self._out


def all_gather_start(x: Tensor, group: dist.ProcessGroup | None) -> Pending:
    """Post the all-gather of ``x [n, ...]`` into ``[world * n, ...]`` and return at once.

    Eager runs use c10d's asynchronous collectives (gloo runs them on its own threads, NCCL on
    its own stream), so the caller computes while the all-gather is in flight, and the
    backward computes the gradients of that work while the reduce-scatter is (``_Post``,
    ``_Land``). Under ``torch.compile`` (and in world 1) it is ``all_gather_autograd`` itself,
    already finished: the compiler schedules the functional collective.
    """
    pending = Pending()
    if group_size(group) == 1 or torch.compiler.is_compiling():
        pending._out = all_gather_autograd(x, group)
        return pending
    assert group is not None
    pending._flight = _Flight(group)
    pending._token = _Post.apply(x, pending._flight)
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
