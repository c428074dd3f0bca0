"""Context-parallel SSD (Mamba2's recurrence, through the generic recurrence driver) equals the
unsharded local kernel: outputs, final states and the gradients of every input, on 2, 3 and 4
gloo ranks over contiguous, head-tail, PTRR and random fragment tables (plus one document over
every rank), B = 2 rows per stream, float64 and float32, for every SSD case of
tests/recurrences.py: the data-dependent gate (Mamba2) and a fixed decay per head (what
retention runs).

Tolerances (max abs difference against the unsharded run): float64 <= 1e-10, float32 <= 2e-5,
as for the delta rule (tests/test_cp_delta_rule.py). One float64 case per world is also checked
against the token-by-token oracle (tests/reference.py).
"""

from __future__ import annotations

import functools

import pytest
import torch

from tests import dist_utils as du
from tests.recurrences import CASES, HV, K, V, ssd_inputs
from torchtitan_cp.routing import (
    contiguous_fragments,
    headtail_fragments,
    ptrr_fragments_from_indices,
)

TOL = {torch.float64: 1e-10, torch.float32: 2e-5}
# The SSD family's cases (tests/recurrences.py): one spawn each covers every world and layout.
SSD_CASES = {c.id: c for c in CASES if c.name == "ssd"}


def ptrr_layout(cu: list[int], rows: int, row_len: int, world: int, block: int = 4):
    """The table torch's PTRR balancer makes for these documents (``block``-token mask blocks)."""
    from torch.distributed.tensor.experimental._context_parallel._load_balancer import (
        _PTRRLoadBalancer,
    )
    from torch.nn.attention.flex_attention import create_block_mask

    doc = torch.zeros(rows * row_len, dtype=torch.int64)
    for i, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
        doc[a:b] = i
    doc = doc.view(rows, row_len)

    def mask_mod(b, h, q, kv):
        return (doc[b, q] == doc[b, kv]) & (q >= kv)

    mask = create_block_mask(mask_mod, rows, 1, row_len, row_len, device="cpu", BLOCK_SIZE=block)
    indices = _PTRRLoadBalancer(mask, world)._generate_indices()
    return ptrr_fragments_from_indices(indices, world, rows, row_len)


def _layouts(world: int):
    gen = torch.Generator().manual_seed(2000 * world)
    rows, row_len = 2, 48
    total = rows * row_len
    cu = [du.random_cu_seqlens(gen, rows, row_len, max_doc=40) for _ in range(4)]
    return [
        ("contiguous", cu[0], contiguous_fragments(row_len, rows, world)),
        ("head-tail", cu[1], headtail_fragments(row_len, rows, world)),
        ("ptrr", cu[2], ptrr_layout(cu[2], rows, row_len, world)),
        ("random", cu[3], du.random_layout(gen, total, world)),
        ("one-doc", [0, total // 2], du.random_layout(gen, total // 2, world)),
    ]


def _check_case(rank, group, case, dtype, seed, *, case_id: str) -> float:
    from torchtitan_cp.ops.cp.driver import context_parallel_recurrence
    from torchtitan_cp.ops.cp.recurrence import SequenceTables, recurrence, run_local

    rc = SSD_CASES[case_id]
    name, cu, table = case
    total = cu[-1]
    cu_t = torch.tensor(cu, dtype=torch.int32)
    rec = recurrence(rc.name, backend="torch", **rc.options)
    full = rc.inputs(total, seed, dtype)
    gen = torch.Generator().manual_seed(seed + 1)
    d_o = torch.randn(1, total, HV, V, generator=gen, dtype=torch.float64).to(dtype)
    d_f = torch.randn(len(cu) - 1, HV, K, V, generator=gen, dtype=torch.float64).to(dtype)

    leaves = [x.clone().requires_grad_(True) for x in full]
    tables = SequenceTables(cu_t, cu_t, None, None)
    o_ref, f_ref = run_local(rec, tuple(leaves), tables, None, True)
    ((o_ref * d_o).sum() + (f_ref * d_f).sum()).backward()

    routing = du.device_routing(cu, table, rank)
    span = torch.tensor(du.span_index(table[rank]), dtype=torch.int64)
    subs = du.local_subsequences(cu, table[rank])
    loc = [x.index_select(1, span).clone().requires_grad_(True) for x in full]
    o, fin = context_parallel_recurrence(
        rec, tuple(loc), routing=routing, group=group, output_final_state=True
    )
    term = routing.terminal.tolist()
    docs = torch.tensor([subs[j][2] if j >= 0 else 0 for j in term], dtype=torch.int64)
    live = torch.tensor([j >= 0 for j in term], dtype=torch.bool).view(-1, 1, 1, 1)
    ((o * d_o.index_select(1, span)).sum() + (fin * d_f[docs] * live).sum()).backward()

    errs = {"o": du.max_abs(o, o_ref.index_select(1, span))}
    errs["final"] = du.max_abs(fin * live, f_ref[docs] * live)
    for i, (x, ref) in enumerate(zip(loc, leaves)):
        errs[f"d{i}"] = du.max_abs(x.grad, ref.grad.index_select(1, span))
    if name.endswith("ptrr") and dtype == torch.float64:
        o_orc, _ = rc.oracle(*full, cu_seqlens=cu)
        errs["oracle"] = du.max_abs(o, o_orc.index_select(1, span))
    worst = max(errs.values())
    assert worst <= TOL[dtype], f"{rc.id} {name} {dtype} rank {rank}: {errs}"
    return worst


@pytest.mark.slow
@pytest.mark.parametrize("case_id", sorted(SSD_CASES))
def test_cp_ssd_matches_unsharded(case_id: str) -> None:
    du.run_sweep(TOL, _layouts, functools.partial(_check_case, case_id=case_id), timeout=240)


def test_single_rank_out_of_order_span() -> None:
    # World 1, fragments out of token order: the fold carries [3, 17) across three fragments.
    from torchtitan_cp.ops.ssd.local import chunk_ssd
    from torchtitan_cp.ops.ssd.recurrence import context_parallel_ssd

    cu, table = [0, 3, 17, 20], [[(11, 20), (0, 6), (6, 11)]]
    routing = du.device_routing(cu, table, 0)
    full = ssd_inputs(20, 5)
    cu_t = torch.tensor(cu, dtype=torch.int32)
    o_ref, _ = chunk_ssd(*full, cu_seqlens=cu_t)
    span = torch.tensor(du.span_index(table[0]))
    o, fin = context_parallel_ssd(
        *[x.index_select(1, span) for x in full], routing=routing, group=None
    )
    assert fin is None
    assert du.max_abs(o, o_ref.index_select(1, span)) <= TOL[torch.float64]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="fla-core needs CUDA")
def test_fla_backend_matches_oracle() -> None:
    # fla-core's chunk_simple_gla as the SSD backend, local and through the CP driver (world 1,
    # out-of-order span). Tolerance as tests/test_kernels_fla.py (TF32): 5e-3 relative.
    from tests.reference import ssd_reference
    from torchtitan_cp.ops.ssd.local import chunk_ssd
    from torchtitan_cp.ops.ssd.recurrence import context_parallel_ssd
    from torchtitan_cp.routing import RoutingPlan

    cu = [0, 1, 70, 200, 333]
    table = [[(150, 333), (0, 40), (40, 41), (41, 150)]]
    gen = torch.Generator().manual_seed(0)
    T, Hq, Hv, Kd = cu[-1], 1, 2, 64
    q = torch.randn(1, T, Hq, Kd, generator=gen, dtype=torch.float64) * 0.2
    k = torch.randn(1, T, Hq, Kd, generator=gen, dtype=torch.float64) * 0.2
    v = torch.randn(1, T, Hv, Kd, generator=gen, dtype=torch.float64)
    g = -torch.rand(1, T, Hv, generator=gen, dtype=torch.float64) * 0.2
    o_ref, f_ref = ssd_reference(q, k, v, g, cu_seqlens=cu)
    dev = [x.float().cuda() for x in (q, k, v, g)]
    cu_t = torch.tensor(cu, dtype=torch.int32)
    o, f = chunk_ssd(*dev, cu_seqlens=cu_t.cuda(), cu_seqlens_cpu=cu_t, output_final_state=True,
                     backend="fla")  # fmt: skip

    def rel(a, b):
        return ((a.double().cpu() - b).abs().max() / b.abs().max().clamp(min=1.0)).item()

    assert rel(o, o_ref) < 5e-3 and rel(f, f_ref) < 5e-3
    routing = RoutingPlan.build(cu, table, 0).to_device(torch.device("cuda"))
    span = torch.tensor(du.span_index(table[0]))
    loc = [x.index_select(1, span.cuda()) for x in dev]
    o_cp, _ = context_parallel_ssd(*loc, routing=routing, group=None, backend="fla")
    assert rel(o_cp, o_ref.index_select(1, span)) < 5e-3
