"""Context-parallel short convolution (local causal_conv1d + gathered history) equals the
unsharded varlen conv, forward and gradients (x, weight, bias), on 2, 3 and 4 gloo ranks,
including fragments shorter than the conv width (multi-hop history), capped routing and a rank
without tokens.

Tolerances (max abs vs the unsharded run of the same local kernel): float64 <= 1e-10,
float32 <= 2e-5.
"""

from __future__ import annotations

import pytest
import torch

from tests import dist_utils as du

pytestmark = pytest.mark.slow

TOL = {torch.float64: 1e-10, torch.float32: 2e-5}
D = 8


def _layouts(world: int):
    gen = torch.Generator().manual_seed(7 + world)
    rows, row_len = 2, 24
    total = rows * row_len
    cases = [
        *du.balanced_layouts(gen, rows, row_len, world, max_doc=30),
        # Mostly 1-3 token fragments: histories of width 5 cross several fragments and ranks.
        du.random_case(gen, rows, row_len, world, name="tiny", tiny=0.9),
        ("one-doc", [0, total], du.random_layout(gen, total, world, tiny=0.9)),
    ]
    cases = [(*c, False) for c in cases]
    cases.append(("tiny-capped", cases[2][1], du.random_layout(gen, total, world, tiny=0.9), True))
    if world == 3:
        cases.append(("empty-rank", cases[0][1], du.empty_rank_layout(total), True))
    if world == 4:
        cases.append(("explicit", *du.explicit_layout_4(), False))
    return cases


def _check(rank, group, case, dtype, seed) -> float:
    return max(_check_width(rank, group, case, width, dtype, seed) for width in (4, 6))


def _check_width(rank, group, case, width, dtype, seed) -> float:
    import torch.distributed as dist

    from torchtitan_cp.ops import causal_conv1d, context_parallel_conv_history

    name, cu, table, capped = case
    total = cu[-1]
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, total, D, generator=gen, dtype=torch.float64).to(dtype)
    w = torch.randn(D, width, generator=gen, dtype=torch.float64).to(dtype)
    b = torch.randn(D, generator=gen, dtype=torch.float64).to(dtype)
    dy = torch.randn(1, total, D, generator=gen, dtype=torch.float64).to(dtype)
    cu_t = torch.tensor(cu, dtype=torch.int32)

    ref = [t.clone().requires_grad_(True) for t in (x, w, b)]
    y_ref = causal_conv1d(*ref, cu_seqlens=cu_t, cu_seqlens_cpu=cu_t, backend="torch")
    (y_ref * dy).sum().backward()

    caps = du.loose_caps(cu, table) if capped else None
    routing = du.device_routing(cu, table, rank, conv_history=width - 1, caps=caps)
    span = torch.tensor(du.span_index(table[rank]), dtype=torch.int64)
    xl = x.index_select(1, span).clone().requires_grad_(True)
    wl, bl = w.clone().requires_grad_(True), b.clone().requires_grad_(True)
    hist = context_parallel_conv_history(xl, routing=routing, group=group)
    y = causal_conv1d(
        xl,
        wl,
        bl,
        cu_seqlens=routing.cu_seqlens,
        cu_seqlens_cpu=routing.cu_seqlens_cpu,
        initial_state=hist,
        backend="torch",
    )
    (y * dy.index_select(1, span)).sum().backward()
    # weight and bias are replicated: their full gradient is the sum over ranks.
    dw, db = wl.grad.clone(), bl.grad.clone()
    dist.all_reduce(dw, group=group)
    dist.all_reduce(db, group=group)
    errs = {
        "y": du.max_abs(y, y_ref.index_select(1, span)),
        "dx": du.max_abs(xl.grad, ref[0].grad.index_select(1, span)),
        "dw": du.max_abs(dw, ref[1].grad),
        "db": du.max_abs(db, ref[2].grad),
    }
    worst = max(errs.values())
    assert worst <= TOL[dtype], f"{name} W={width} {dtype} rank {rank}: {errs}"
    return worst


def test_cp_conv_matches_unsharded() -> None:
    du.run_sweep(TOL, _layouts, _check, timeout=240)
