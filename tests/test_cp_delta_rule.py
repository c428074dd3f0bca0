"""KDA / GDN through their context-parallel entry point ``context_parallel_delta_rule`` (a thin
wrapper of the generic driver): world 1 with fragments out of token order, bfloat16 inputs,
routing made for another rank, fla-core as the backend on CUDA. The sweep over 2, 3 and 4 gloo
ranks, every fragment layout (contiguous, head-tail, PTRR, random, capped, one document over
every rank, an empty rank, a hand-made table) and float64 / float32 is
tests/test_cp_recurrences.py, shared by every registered recurrence.

Tolerances (max abs difference against the unsharded local kernel): float64 <= 1e-10.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests import dist_utils as du

TOL = {torch.float64: 1e-10}
H, HV, K, V = 1, 2, 8, 6  # HV = 2 H exercises grouped value heads


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
