"""The differentiable all-gather and the process-spawning helper (gloo, 3 ranks)."""

from __future__ import annotations

import pytest
import torch

from tests.dist_utils import ChildFailure, run_distributed
from torchtitan_cp.ops.cp.collectives import all_gather_autograd, all_gather_plain

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
