"""Softmax attention with a causal document mask: the unsharded call (group=None) equals
F.scaled_dot_product_attention with an explicit block-causal mask, and context-parallel
attention on 2, 3 and 4 gloo ranks equals the unsharded call, forward and q/k/v gradients.

Tolerances (max abs): float64 <= 1e-10, float32 <= 2e-5.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.dist_utils import (
    balanced_layouts,
    device_routing,
    doc_ids_of,
    empty_rank_layout,
    explicit_layout_4,
    max_abs,
    prefix_groups,
    random_cu_seqlens,
    random_layout,
    report_worst,
    run_distributed,
    span_index,
)
from torchtitan_cp.ops import context_parallel_attention

TOL = {torch.float64: 1e-10, torch.float32: 2e-5}
HQ, HKV, DK, DV = 2, 1, 8, 6  # GQA: two query heads share one key/value head


def _tensors(batch: int, total: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(batch, total, HQ, DK), (batch, total, HKV, DK), (batch, total, HKV, DV)]
    qkv = [torch.randn(*s, generator=gen, dtype=torch.float64).to(dtype) for s in shapes]
    d_o = torch.randn(batch, total, HQ, DV, generator=gen, dtype=torch.float64).to(dtype)
    return qkv, d_o


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_unsharded_matches_sdpa_with_document_mask(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    batch, total = 2, 40
    cus = [random_cu_seqlens(gen, 1, total, 12) for _ in range(batch)]  # one layout per row
    (q, k, v), d_o = _tensors(batch, total, dtype, 4)
    tok = torch.arange(total).expand(batch, total)
    doc = torch.stack([doc_ids_of(cu, list(range(total))) for cu in cus])

    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    o = context_parallel_attention(*leaves, token_ids=tok, doc_ids=doc, group=None)
    (o * d_o).sum().backward()

    ref_leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    mask = torch.zeros(batch, 1, total, total, dtype=torch.bool)
    for b, cu in enumerate(cus):
        for s, e in zip(cu[:-1], cu[1:]):
            mask[b, 0, s:e, s:e] = torch.ones(e - s, e - s, dtype=torch.bool).tril()
    rep = HQ // HKV
    qr, kr, vr = (x.transpose(1, 2) for x in ref_leaves)
    o_ref = F.scaled_dot_product_attention(
        qr, kr.repeat_interleave(rep, 1), vr.repeat_interleave(rep, 1), attn_mask=mask
    ).transpose(1, 2)
    (o_ref * d_o).sum().backward()

    assert (o - o_ref).abs().max().item() <= TOL[dtype]
    for a, r in zip(leaves, ref_leaves):
        assert (a.grad - r.grad).abs().max().item() <= TOL[dtype]


def _layouts(world: int):
    gen = torch.Generator().manual_seed(11 + world)
    rows, row_len = 2, 24
    total = rows * row_len
    cases = [
        *balanced_layouts(gen, rows, row_len, world, max_doc=30),
        ("random", random_cu_seqlens(gen, rows, row_len, 40), random_layout(gen, total, world)),
    ]
    if world == 3:
        cases.append(("empty-rank", cases[0][1], empty_rank_layout(total)))
    if world == 4:
        cases.append(("explicit", *explicit_layout_4()))
    return cases


def _check(rank, group, name, cu, table, dtype, seed) -> float:
    total = cu[-1]
    batch = 2  # two independent streams sharing the layout (exercises the B > 1 gather)
    (q, k, v), d_o = _tensors(batch, total, dtype, seed)
    all_ids = list(range(total))
    ref = [x.clone().requires_grad_(True) for x in (q, k, v)]
    o_ref = context_parallel_attention(
        *ref, token_ids=torch.arange(total), doc_ids=doc_ids_of(cu, all_ids), group=None
    )
    (o_ref * d_o).sum().backward()

    mine = span_index(table[rank])
    span = torch.tensor(mine, dtype=torch.int64)
    loc = [x.index_select(1, span).clone().requires_grad_(True) for x in (q, k, v)]
    o = context_parallel_attention(*loc, token_ids=span, doc_ids=doc_ids_of(cu, mine), group=group)
    (o * d_o.index_select(1, span)).sum().backward()
    errs = {"o": max_abs(o, o_ref.index_select(1, span))}
    for nm, a, r in zip(("dq", "dk", "dv"), loc, ref):
        errs[nm] = max_abs(a.grad, r.grad.index_select(1, span))
    worst = max(errs.values())
    assert worst <= TOL[dtype], f"{name} {dtype} rank {rank}: {errs}"
    return worst


def _worker(rank: int, world: int) -> float:
    groups = prefix_groups(world)
    worst = {str(dt): 0.0 for dt in TOL}  # observed max abs error per dtype
    for w in (2, 3, 4):
        if rank >= w:
            continue
        for ci, (name, cu, table) in enumerate(_layouts(w)):
            device_routing(cu, table, rank)  # the routing package accepts the same table
            for dtype in (torch.float64, torch.float32):
                worst[str(dtype)] = max(
                    worst[str(dtype)], _check(rank, groups[w], f"W{w}/{name}", cu, table, dtype, ci)
                )
    return worst


@pytest.mark.slow
def test_cp_attention_matches_unsharded() -> None:
    report_worst(TOL, run_distributed(_worker, 4, timeout=240))


def test_query_blocks_give_the_unblocked_result(monkeypatch: pytest.MonkeyPatch) -> None:
    """Long spans run in query blocks (bounded mask memory); blocks must not change anything."""
    import torchtitan_cp.ops.attention.sdpa as attention

    gen = torch.Generator().manual_seed(3)
    T, Hq, Hkv, D = 50, 4, 2, 8
    q, k, v = (
        torch.randn(1, T, h, D, generator=gen, dtype=torch.float64, requires_grad=True)
        for h in (Hq, Hkv, Hkv)
    )
    token_ids = torch.arange(T)
    doc_ids = torch.tensor([0] * 13 + [1] * 30 + [2] * 7)

    def run():
        o = context_parallel_attention(q, k, v, token_ids=token_ids, doc_ids=doc_ids, group=None)
        grads = torch.autograd.grad(o.square().sum(), (q, k, v))
        return o, grads

    whole, whole_grads = run()
    monkeypatch.setattr(attention, "_MASK_ELEMENTS", 7 * T)  # 7 queries per block, 8 blocks
    blocked, blocked_grads = run()
    assert torch.allclose(whole, blocked, atol=1e-13, rtol=0)
    for a, b in zip(whole_grads, blocked_grads, strict=True):
        assert torch.allclose(a, b, atol=1e-13, rtol=0)
