"""SSD's context-parallel entry point ``context_parallel_ssd`` (a thin wrapper of the generic
driver): world 1 with fragments out of token order, and fla-core's ``chunk_simple_gla`` as its
backend on CUDA. The sweep over worlds, layouts and dtypes for every SSD case (the data-dependent
gate and a fixed decay per head) is tests/test_cp_recurrences.py, shared by every recurrence.
"""

from __future__ import annotations

import pytest
import torch

from tests import dist_utils as du
from tests.recurrences import ssd_inputs

TOL = {torch.float64: 1e-10, torch.float32: 2e-5}


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
    o, f = chunk_ssd(
        *dev, cu_seqlens=cu_t.cuda(), cu_seqlens_cpu=cu_t, output_final_state=True, backend="fla"
    )

    def rel(a, b):
        return ((a.double().cpu() - b).abs().max() / b.abs().max().clamp(min=1.0)).item()

    assert rel(o, o_ref) < 5e-3 and rel(f, f_ref) < 5e-3
    routing = RoutingPlan.build(cu, table, 0).to_device(torch.device("cuda"))
    span = torch.tensor(du.span_index(table[0]))
    loc = [x.index_select(1, span.cuda()) for x in dev]
    o_cp, _ = context_parallel_ssd(*loc, routing=routing, group=None, backend="fla")
    assert rel(o_cp, o_ref.index_select(1, span)) < 5e-3
