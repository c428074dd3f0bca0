"""The differentiable all-gather and the process-spawning helper (gloo, 3 ranks)."""

from __future__ import annotations

import pytest
import torch

from tests.dist_utils import ChildFailure, run_distributed
from torchtitan_cp.ops.cp import collectives
from torchtitan_cp.ops.cp.collectives import (
    all_gather_autograd,
    all_gather_plain,
    all_gather_start,
)

pytestmark = pytest.mark.slow


def _gather_worker(rank: int, world: int) -> float:
    import torch.distributed as dist

    group = dist.group.WORLD
    errs = []
    for dtype in (torch.float64, torch.float32):
        # Every rank builds everyone's rows from the same seed, so it can check the gather.
        gen = torch.Generator().manual_seed(0)
        rows = torch.randn(world, 2, 3, 4, generator=gen, dtype=dtype)
        weights = torch.randn(world, world * 2, 3, 4, generator=gen, dtype=dtype)
        x = rows[rank].clone().requires_grad_(True)
        out = all_gather_autograd(x, group)
        errs.append((out - rows.reshape(world * 2, 3, 4)).abs().max().item())
        # loss_r = <weights_r, gathered>; d(sum_r loss_r)/d rows[rank] = sum_r weights_r[rank rows]
        (out * weights[rank]).sum().backward()
        expect = weights.reshape(world, world, 2, 3, 4)[:, rank].sum(0)
        errs.append((x.grad - expect).abs().max().item())
    ids = all_gather_plain(torch.tensor([rank, 10 * rank]), group)
    assert ids.tolist() == [v for r in range(world) for v in (r, 10 * r)]
    return max(errs)


class _RecordReduceScatter:
    """Logs when the reduce-scatter is posted and when it is waited for (c10d's own call and
    its work, wrapped), and every matmul autograd runs in between."""

    def __init__(self, events: list[str]) -> None:
        self.events = events
        self.real = collectives._reduce_scatter_single

    def __enter__(self):
        events, real = self.events, self.real

        class Work:
            def __init__(self, work) -> None:
                self.work = work

            def wait(self, *args):
                events.append("rs wait")
                return self.work.wait(*args)

        def post(*args, async_op: bool = False, **kwargs):
            events.append("rs post")
            work = real(*args, async_op=async_op, **kwargs)
            return Work(work) if async_op else work

        collectives._reduce_scatter_single = post
        return self

    def __exit__(self, *exc) -> None:
        collectives._reduce_scatter_single = self.real


class _Tag(torch.autograd.Function):
    """Identity whose backward logs ``name``: marks where autograd runs a piece of work."""

    @staticmethod
    def forward(ctx, x, events, name):
        ctx.events, ctx.name = events, name
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.events.append(ctx.name)
        return grad, None, None


def _start_worker(rank: int, world: int) -> tuple[float, list[str]]:
    """``all_gather_start``: the same values and gradients as ``all_gather_autograd``; the
    backward of work issued while the all-gather was in flight runs between posting the
    reduce-scatter and waiting for it."""
    import torch.distributed as dist

    group = dist.group.WORLD
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(world, 2, 3, 4, generator=gen, dtype=torch.float64)
    weights = torch.randn(world, world * 2, 3, 4, generator=gen, dtype=torch.float64)
    events: list[str] = []
    x = rows[rank].clone().requires_grad_(True)
    y = torch.randn(5, generator=gen, dtype=torch.float64, requires_grad=True)
    pending = all_gather_start(_Tag.apply(x, events, "before post"), group)
    side = _Tag.apply(y * 3, events, "in flight")  # state-independent work
    out = pending.wait()
    loss = (_Tag.apply(out, events, "after wait") * weights[rank]).sum() + side.sum()
    with _RecordReduceScatter(events):
        loss.backward()
    expect = weights.reshape(world, world, 2, 3, 4)[:, rank].sum(0)
    err = max(
        (out - rows.reshape(world * 2, 3, 4)).abs().max().item(),
        (x.grad - expect).abs().max().item(),
        (y.grad - 3).abs().max().item(),
    )
    return err, events


def test_all_gather_start_overlaps_both_directions() -> None:
    for err, events in run_distributed(_start_worker, 2):
        assert err <= 1e-12
        assert events == ["after wait", "rs post", "in flight", "rs wait", "before post"], events


def _failing_worker(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("boom from rank one")


def _hanging_worker(rank: int, world: int) -> None:
    import time

    import torch.distributed as dist

    if rank == 0:
        dist.all_reduce(torch.ones(1))  # rank 1 never joins: must not hang the suite
    else:
        time.sleep(120)


def test_all_gather_autograd_three_ranks() -> None:
    errs = run_distributed(_gather_worker, 3)
    assert max(errs) <= 1e-6  # pure data movement; float32 sums of 3 terms


def test_child_failure_propagates() -> None:
    with pytest.raises(ChildFailure, match="boom from rank one"):
        run_distributed(_failing_worker, 2, timeout=60)


def test_hang_is_reported_not_waited_out() -> None:
    with pytest.raises(ChildFailure, match="timed out|rank 0 raised"):
        run_distributed(_hanging_worker, 2, timeout=10)
