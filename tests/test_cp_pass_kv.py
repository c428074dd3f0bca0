"""Pass-KV attention (ops/attention/pass_kv.py) on 2, 3 and 4 gloo ranks against unsharded
attention: outputs and q/k/v gradients, float64 within 1e-10 and float32 within 2e-5, GQA, on
contiguous, head-tail, PTRR and random tables, one document over every rank, many short
documents, one-token documents and an empty rank. In the same spawn: the exchanges and kernel
calls of a layout whose answer is known (skipped rounds post nothing and compute nothing), and
the bytes sent and the visiting buffers held against the schedule's own count.

The unsharded reference is ``context_parallel_attention(group=None)``, which
tests/test_cp_attention.py checks against SDPA with an explicit block-causal mask.
"""

from __future__ import annotations

import pytest
import torch

from tests import dist_utils as du

TOL = {torch.float64: 1e-10, torch.float32: 2e-5}
HQ, HKV, DK, DV = 4, 2, 8, 6  # GQA: two query heads per key/value head
EXAMPLE_CU = [0, 6, 10, 16, 22, 26, 32]  # docs/cp.md's worked example (W = 4, head-tail)


def _layouts(world: int):
    from torchtitan_cp.routing import headtail_fragments

    gen = torch.Generator().manual_seed(21 + world)
    rows, row_len = 2, 8 * world
    total = rows * row_len
    cases = [
        *du.balanced_layouts(gen, rows, row_len, world, max_doc=30),
        ("ptrr", *du.ptrr_layout(gen, rows, row_len, world)),
        du.random_case(gen, rows, row_len, world),
        ("one document", [0, total], headtail_fragments(total, 1, world)),
        ("short documents", du.random_cu_seqlens(gen, rows, row_len, 3),
         headtail_fragments(row_len, rows, world)),
        ("one-token documents", list(range(total + 1)), du.random_layout(gen, total, world)),
    ]  # fmt: skip # a table, laid out by hand to read across
    if world == 3:
        cases.append(("empty rank", [0, 7, 30, total], du.empty_rank_layout(total)))
    if world == 4:
        cases.append(("explicit", *du.explicit_layout_4()))
    return cases


def _tensors(batch: int, total: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    shapes = [
        (batch, total, HQ, DK),
        (batch, total, HKV, DK),
        (batch, total, HKV, DV),
        (batch, total, HQ, DV),
    ]
    return [torch.randn(*s, generator=gen, dtype=torch.float64).to(dtype) for s in shapes]


def _schedule(cu, table, rank):
    from torchtitan_cp.routing import RoutingPlan

    span = torch.tensor(du.span_index(table[rank]), dtype=torch.int64)
    sched = RoutingPlan.build(cu, table, rank).pass_kv
    return span, sched.to_device("cpu", span, du.doc_ids_of(cu, span.tolist()))


def _check(rank, group, case, dtype, seed) -> float:
    from torchtitan_cp.ops import pass_kv_attention

    name, cu, table = case
    batch = 1 + seed % 2  # B = 2 streams sharing the layout on every other case
    q, k, v, d_o = _tensors(batch, cu[-1], dtype, seed)
    span, routing = _schedule(cu, table, rank)

    def attend(*loc):
        return pass_kv_attention(*loc, routing=routing, group=group)

    errs = du.attention_span_errors([q, k, v], d_o, cu, span, attend)
    worst = max(errs.values())
    assert worst <= TOL[dtype], f"{name} {dtype} rank {rank}: {errs}"
    return worst


def _counted_run(rank, group, cu, table, monkeypatch_target):
    """One forward and backward of the worked example, counting every point-to-point op that
    reaches torch.distributed and every kernel call, and tracing the visiting buffers."""
    import torch.distributed as dist

    from torchtitan_cp.ops import pass_kv_attention
    from torchtitan_cp.ops.attention.pass_kv import PassKVTrace, math_pair_attention

    posted: list[tuple[str, int, int]] = []  # (op, global peer, bytes)
    real = dist.batch_isend_irecv

    def counting(ops):
        for op in ops:
            kind = "send" if op.op is dist.isend else "recv"
            posted.append((kind, op.peer, op.tensor.numel() * op.tensor.element_size()))
        return real(ops)

    calls: list[int] = []

    def kernel(q, k, v, mask, scale):
        calls.append(k.shape[2])
        return math_pair_attention(q, k, v, mask, scale)

    monkeypatch_target.batch_isend_irecv = counting
    try:
        span, routing = _schedule(cu, table, rank)
        q, k, v, d_o = _tensors(1, cu[-1], torch.float64, 7)
        loc = [x.index_select(1, span).clone().requires_grad_(True) for x in (q, k, v)]
        trace = PassKVTrace()
        o = pass_kv_attention(*loc, routing=routing, group=group, kernel=kernel, trace=trace)
        n_fwd_msgs, n_fwd_calls = len(posted), len(calls)
        (o * d_o.index_select(1, span)).sum().backward()
    finally:
        monkeypatch_target.batch_isend_irecv = real
    return routing.schedule, posted, n_fwd_msgs, calls, n_fwd_calls, trace


def _count_checks(rank: int, group) -> dict:
    """The worked example (docs/cp.md): rounds 1 and 3 only; rank 0 and 3 send one block and
    receive one, ranks 1 and 2 two each; nothing ever travels between ranks two apart."""
    import torch.distributed as dist

    from torchtitan_cp.routing import headtail_fragments

    table = headtail_fragments(32, 1, 4)
    sched, posted, n_fwd, calls, n_fwd_calls, trace = _counted_run(
        rank, group, EXAMPLE_CU, table, dist
    )
    expect_blocks = {0: 1, 1: 2, 2: 2, 3: 1}[rank]  # blocks received = blocks sent
    assert n_fwd == 2 * expect_blocks, posted
    assert len(posted) == 3 * n_fwd  # backward: the K/V again plus, back, the dK/dV
    assert n_fwd_calls == 1 + expect_blocks and len(calls) == 2 * n_fwd_calls
    assert {peer for _, peer, _ in posted} <= {(rank + 1) % 4, (rank - 1) % 4}
    assert (rank + 2) % 4 not in {peer for _, peer, _ in posted}
    # Bytes and buffers: the schedule's count is what the op did.
    row = HKV * (DK + DV) * 8  # one token's K and V, float64, B = 1
    t = sched.pairs.traffic(rank)
    sent = [b for kind, _, b in posted if kind == "send"]
    assert sum(sent[: n_fwd // 2]) == t["sent"] * row
    assert sum(sent) == (2 * t["sent"] + t["received"]) * row
    assert trace.peak_bytes["kv"] == t["visiting_peak"] * row
    assert trace.peak_bytes["grad"] == t["grad_peak"] * row
    assert trace.peak["kv"] <= 2 and all(n == 0 for n in trace.live.values())
    return {"rounds": [rd.shift for rd in sched.rounds], "messages": len(posted)}


def _full_ring_checks(rank: int, group) -> None:
    """One document over the row: every round is used, byte counts still exact, at most two
    visiting K/V blocks alive."""
    import torch.distributed as dist

    from torchtitan_cp.routing import headtail_fragments

    sched, posted, n_fwd, calls, _, trace = _counted_run(
        rank, group, [0, 64], headtail_fragments(64, 1, 4), dist
    )
    assert [rd.shift for rd in sched.rounds] == [1, 2, 3] and n_fwd == 6
    row = HKV * (DK + DV) * 8
    t = sched.pairs.traffic(rank)
    assert trace.peak["kv"] == 2 and trace.peak_bytes["kv"] == t["visiting_peak"] * row
    assert sum(b for kind, _, b in posted[:n_fwd] if kind == "recv") == t["received"] * row


def _nccl_branch_checks(rank: int, world: int) -> float:
    """NCCL's branches on gloo (``du.NcclLikeP2P``): one work per posted batch, so a round's
    receive completes only with its send, and ``_warm_up``'s all-reduce once per group, then
    never again. Pass-KV still equals unsharded attention on every layout of this world."""
    import torch.distributed as dist

    from torchtitan_cp.ops.attention import pass_kv

    group = dist.new_group(list(range(world)))  # a group no call has warmed up yet
    worst = 0.0
    with du.NcclLikeP2P() as p:
        for seed, (name, *rest) in enumerate(_layouts(world)):
            case = (f"nccl-like W{world}/{name}", *rest)
            worst = max(worst, _check(rank, group, case, torch.float64, seed))
        assert group in pass_kv._warm
    assert p.all_reduces == 1, p.all_reduces  # the warm-up, on the first call only
    assert p.batches > 0 and p.works == p.batches, (p.batches, p.works)
    return worst


def _worker(rank: int, world: int) -> dict:
    import torch.distributed as dist

    worst = du.sweep_worlds(rank, world, TOL, _layouts, _check)
    _count_checks(rank, dist.group.WORLD)
    _full_ring_checks(rank, dist.group.WORLD)
    nccl = _nccl_branch_checks(rank, world)
    worst["torch.float64"] = max(worst["torch.float64"], nccl)
    return worst


@pytest.mark.slow
def test_pass_kv_matches_unsharded_and_skips_empty_rounds() -> None:
    du.report_worst(TOL, du.run_distributed(_worker, 4, timeout=300))
