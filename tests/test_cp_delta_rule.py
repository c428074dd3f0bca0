"""Context-parallel KDA / GDN equals the unsharded local kernel: outputs, final states and the
gradients of q, k, v, g, beta, on 2, 3 and 4 gloo ranks over many fragment layouts (contiguous,
head-tail, random tables with 1-3 token fragments, one document over every rank, a hand-made
table whose document spans six fragments on non-adjacent ranks and whose rank 1 holds only
document interiors, a rank without tokens, capped/padded routing), B = 2 rows per stream.

Tolerances (max abs difference against the unsharded run of the same local kernel):
float64 <= 1e-10, float32 <= 2e-5. One float64 case is also checked against the token-by-token
oracle (tests/reference.py) to the same 1e-10.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from tests import dist_utils as du
from torchtitan_cp.routing import contiguous_fragments, headtail_fragments

TOL = {torch.float64: 1e-10, torch.float32: 2e-5}
H, HV, K, V = 1, 2, 8, 6  # HV = 2 H exercises grouped value heads

Case = tuple[str, list[int], list[list[tuple[int, int]]], bool]  # name, cu, table, capped


def _layouts(world: int) -> list[Case]:
    gen = torch.Generator().manual_seed(1000 * world)
    rows, row_len = 2, 48  # B > 1: two rows flattened into one stream
    total = rows * row_len
    cu = [du.random_cu_seqlens(gen, rows, row_len, max_doc=40) for _ in range(4)]
    cases: list[Case] = [
        ("contiguous", cu[0], contiguous_fragments(row_len, rows, world), False),
        ("head-tail", cu[1], headtail_fragments(row_len, rows, world), False),
        ("random", cu[2], du.random_layout(gen, total, world), False),
        ("random-capped", cu[3], du.random_layout(gen, total, world), True),
        # One document over everything: every fragment continues and is continued.
        ("one-doc", [0, total // 2], du.random_layout(gen, total // 2, world), False),
    ]
    if world == 3:
        cases.append(("empty-rank", cu[0], du.empty_rank_layout(total), True))
    if world == 4:
        cases.append(("explicit", *du.explicit_layout_4(), False))
        cases.append(("explicit-capped", *du.explicit_layout_4(), True))
    return cases


def _inputs(kind: str, total: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q = rnd(1, total, H, K)
    k = F.normalize(rnd(1, total, H, K), dim=-1)  # models L2-normalise keys; keeps M bounded
    v = rnd(1, total, HV, V)
    g = -F.softplus(rnd(1, total, HV, K) if kind == "kda" else rnd(1, total, HV)) * 0.3
    beta = torch.sigmoid(rnd(1, total, HV))
    return [x.to(dtype) for x in (q, k, v, g, beta)]


def _check_case(rank, group, case: Case, dtype, seed, *, kind: str) -> float:
    import torch.distributed as dist

    from tests.reference import delta_rule_reference
    from torchtitan_cp.ops import chunk_delta_rule, context_parallel_delta_rule

    name, cu, table, capped = case
    total = cu[-1]
    cu_t = torch.tensor(cu, dtype=torch.int32)
    full = _inputs(kind, total, dtype, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    d_o = torch.randn(1, total, HV, V, generator=gen, dtype=torch.float64).to(dtype)
    d_f = torch.randn(len(cu) - 1, HV, K, V, generator=gen, dtype=torch.float64).to(dtype)

    # Unsharded reference: the same local kernel over the whole stream, global cu_seqlens.
    leaves = [x.clone().requires_grad_(True) for x in full]
    o_ref, f_ref = chunk_delta_rule(
        *leaves,
        kind=kind,
        output_final_state=True,
        cu_seqlens=cu_t,
        cu_seqlens_cpu=cu_t,
        backend="torch",
    )
    ((o_ref * d_o).sum() + (f_ref * d_f).sum()).backward()
    ref_grads = [x.grad for x in leaves]

    # This rank's span, through the CP op.
    caps = du.loose_caps(cu, table) if capped else None
    routing = du.device_routing(cu, table, rank, caps=caps)
    span = torch.tensor(du.span_index(table[rank]), dtype=torch.int64)
    subs = du.local_subsequences(cu, table[rank])
    offsets = [0]
    for a, b, _ in subs:
        offsets.append(offsets[-1] + b - a)
    assert routing.cu_seqlens_cpu.tolist()[: len(offsets)] == offsets, name
    loc = [x.index_select(1, span).clone().requires_grad_(True) for x in full]
    o, fin = context_parallel_delta_rule(
        *loc, kind=kind, routing=routing, group=group, output_final_state=True, backend="torch"
    )
    term = routing.terminal.tolist()
    docs = torch.tensor([subs[j][2] if j >= 0 else 0 for j in term], dtype=torch.int64)
    live = torch.tensor([j >= 0 for j in term], dtype=torch.bool).view(-1, 1, 1, 1)
    loss = (o * d_o.index_select(1, span)).sum() + (fin * d_f[docs] * live).sum()
    loss.backward()

    errs = {"o": du.max_abs(o, o_ref.index_select(1, span))}
    errs["final"] = du.max_abs(fin * live, f_ref[docs] * live)
    errs["pad-final"] = du.max_abs(fin * ~live, 0 * fin)  # -1 terminal padding returns zeros
    for nm, x, gr in zip("q k v g beta".split(), loc, ref_grads):
        errs["d" + nm] = du.max_abs(x.grad, gr.index_select(1, span))
    if name == "explicit" and dtype == torch.float64:
        o_orc, _ = delta_rule_reference(*full, kind=kind, cu_seqlens=cu)
        errs["oracle"] = du.max_abs(o, o_orc.index_select(1, span))
    worst = max(errs.values())
    assert worst <= TOL[dtype], f"{name} {kind} {dtype} rank {rank}: {errs}"

    # Each document's final state comes from exactly one rank.
    owned: list[list[int]] = [[] for _ in range(dist.get_world_size(group))]
    dist.all_gather_object(owned, [subs[j][2] for j in term if j >= 0], group=group)
    assert sorted(d for ds in owned for d in ds) == list(range(len(cu) - 1)), name
    return worst


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["kda", "gdn"])
def test_cp_delta_rule_matches_unsharded(kind: str) -> None:
    du.run_sweep(TOL, _layouts, functools.partial(_check_case, kind=kind), timeout=240)


@pytest.mark.parametrize("kind", ["kda", "gdn"])
def test_single_rank_out_of_order_span(kind: str) -> None:
    # World 1 (group=None) but the span lists its fragments out of token order: the fold
    # still has to carry document [3, 17) from fragment (0, 6) into (6, 11) and (11, 20).
    cu, table = [0, 3, 17, 20], [[(11, 20), (0, 6), (6, 11)]]
    routing = du.device_routing(cu, table, 0)
    full = _inputs(kind, 20, torch.float64, 5)
    from torchtitan_cp.ops import chunk_delta_rule, context_parallel_delta_rule

    cu_t = torch.tensor(cu, dtype=torch.int32)
    o_ref, _ = chunk_delta_rule(*full, kind=kind, cu_seqlens=cu_t, cu_seqlens_cpu=cu_t)
    span = torch.tensor(du.span_index(table[0]))
    loc = [x.index_select(1, span) for x in full]
    o, fin = context_parallel_delta_rule(*loc, kind=kind, routing=routing, group=None)
    assert fin is None
    assert du.max_abs(o, o_ref.index_select(1, span)) <= TOL[torch.float64]


def test_bfloat16_inputs_fold_in_float32() -> None:
    # Smoke test of the mixed-precision path: bf16 activations, float32 summaries and states.
    cu, table = [0, 3, 17, 20], [[(11, 20), (0, 6), (6, 11)]]
    routing = du.device_routing(cu, table, 0)
    full = _inputs("kda", 20, torch.float64, 6)
    from torchtitan_cp.ops import chunk_delta_rule, context_parallel_delta_rule

    cu_t = torch.tensor(cu, dtype=torch.int32)
    o_ref, f_ref = chunk_delta_rule(*full, kind="kda", cu_seqlens=cu_t, output_final_state=True)
    span = torch.tensor(du.span_index(table[0]))
    loc = [x.index_select(1, span).to(torch.bfloat16).requires_grad_(True) for x in full]
    o, fin = context_parallel_delta_rule(
        *loc, kind="kda", routing=routing, group=None, output_final_state=True
    )
    assert o.dtype == torch.bfloat16 and fin.dtype == torch.float32
    assert du.max_abs(o.double(), o_ref.index_select(1, span)) <= 0.05  # bf16 inputs
    o.float().sum().backward()
    assert all(x.grad is not None and torch.isfinite(x.grad).all() for x in loc)


def test_routing_for_another_rank_is_rejected() -> None:
    from torchtitan_cp.ops import context_parallel_delta_rule

    routing = du.device_routing([0, 8], [[(0, 4)], [(4, 8)]], 1)
    x = _inputs("gdn", 4, torch.float64, 0)
    with pytest.raises(ValueError, match="routing is for rank 1 of 2"):
        context_parallel_delta_rule(*x, kind="gdn", routing=routing, group=None)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="fla-core needs CUDA")
@pytest.mark.parametrize("kind", ["kda", "gdn"])
def test_fla_backend_out_of_order_span(kind: str) -> None:
    # World 1 on CUDA through fla-core: the summary pass runs FLA with value width V+K and a
    # float32 [0 | I] initial state. Tolerance as tests/test_kernels_fla.py (TF32 matmuls):
    # 5e-3 of max(1, max |oracle|). Not run where the CP ops were developed (no GPU there).
    from tests.reference import delta_rule_reference
    from torchtitan_cp.ops import context_parallel_delta_rule
    from torchtitan_cp.routing import RoutingPlan

    cu = [0, 1, 70, 200, 333]
    table = [[(150, 333), (0, 40), (40, 41), (41, 150)]]  # doc [70, 200) in 2 pieces, [1, 70) in 3
    Hk, Kd = 2, 64
    gen = torch.Generator().manual_seed(0)
    T = cu[-1]
    q = F.normalize(torch.randn(1, T, Hk, Kd, generator=gen, dtype=torch.float64), dim=-1)
    k = F.normalize(torch.randn(1, T, Hk, Kd, generator=gen, dtype=torch.float64), dim=-1)
    v = torch.randn(1, T, Hk, Kd, generator=gen, dtype=torch.float64)
    gshape = (1, T, Hk, Kd) if kind == "kda" else (1, T, Hk)
    g = -torch.rand(*gshape, generator=gen, dtype=torch.float64)
    beta = torch.rand(1, T, Hk, generator=gen, dtype=torch.float64)
    full = [q, k, v, g, beta]
    o_ref, _ = delta_rule_reference(*full, kind=kind, cu_seqlens=cu)
    routing = RoutingPlan.build(cu, table, 0).to_device(torch.device("cuda"))
    span = torch.tensor(du.span_index(table[0]))
    loc = [x.index_select(1, span).float().cuda() for x in full]
    o, _ = context_parallel_delta_rule(*loc, kind=kind, routing=routing, group=None, backend="fla")
    ref = o_ref.index_select(1, span)
    err = ((o.double().cpu() - ref).abs().max() / ref.abs().max().clamp(min=1.0)).item()
    assert err < 5e-3
