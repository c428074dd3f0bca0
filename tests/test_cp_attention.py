"""Softmax attention with a causal document mask: the unsharded call (group=None) equals
F.scaled_dot_product_attention with an explicit block-causal mask, and context-parallel
attention on 2, 3 and 4 gloo ranks equals the unsharded call, forward and q/k/v gradients.

Tolerances (max abs): float64 <= 1e-10, float32 <= 2e-5.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests import dist_utils as du
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
    cus = [du.random_cu_seqlens(gen, 1, total, 12) for _ in range(batch)]  # one layout per row
    (q, k, v), d_o = _tensors(batch, total, dtype, 4)
    tok = torch.arange(total).expand(batch, total)
    doc = torch.stack([du.doc_ids_of(cu, list(range(total))) for cu in cus])

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
        *du.balanced_layouts(gen, rows, row_len, world, max_doc=30),
        du.random_case(gen, rows, row_len, world),
    ]
    if world == 3:
        cases.append(("empty-rank", cases[0][1], du.empty_rank_layout(total)))
    if world == 4:
        cases.append(("explicit", *du.explicit_layout_4()))
    return cases


def _check(rank, group, case, dtype, seed) -> float:
    name, cu, table = case
    du.device_routing(cu, table, rank)  # the routing package accepts the same table
    batch = 2  # two independent streams sharing the layout (exercises the B > 1 gather)
    qkv, d_o = _tensors(batch, cu[-1], dtype, seed)
    mine = du.span_index(table[rank])
    span, doc = torch.tensor(mine, dtype=torch.int64), du.doc_ids_of(cu, mine)

    def attend(q, k, v):
        return context_parallel_attention(q, k, v, token_ids=span, doc_ids=doc, group=group)

    errs = du.attention_span_errors(qkv, d_o, cu, span, attend)
    worst = max(errs.values())
    assert worst <= TOL[dtype], f"{name} {dtype} rank {rank}: {errs}"
    return worst


@pytest.mark.slow
def test_cp_attention_matches_unsharded() -> None:
    du.run_sweep(TOL, _layouts, _check, timeout=240)


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
