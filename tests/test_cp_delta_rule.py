"""Context-parallel KDA / GDN equals the unsharded local kernel: outputs, final states and the
gradients of q, k, v, g, beta, on 2, 3 and 4 gloo ranks over many fragment layouts.

Tolerances (max abs difference against the unsharded run of the same local kernel):
float64 <= 1e-10, float32 <= 2e-5.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from dist_utils import (
    device_routing,
    explicit_layout_4,
    local_subsequences,
    random_cu_seqlens,
    random_layout,
    run_distributed,
    span_index,
)

from torchtitan_cp.routing import contiguous_fragments, headtail_fragments

pytestmark = pytest.mark.slow

TOL = {torch.float64: 1e-10, torch.float32: 2e-5}
H, HV, K, V = 1, 2, 8, 6  # HV = 2 H exercises grouped value heads


def _layouts(world: int, seed: int) -> list[tuple[str, list[int], list[list[tuple[int, int]]]]]:
    gen = torch.Generator().manual_seed(1000 * world + seed)
    rows, row_len = 2, 48  # B > 1: two rows flattened into one stream
    total = rows * row_len
    cases = []
    cu = random_cu_seqlens(gen, rows, row_len, max_doc=40)
    cases.append(("contiguous", cu, contiguous_fragments(row_len, rows, world)))
    cu = random_cu_seqlens(gen, rows, row_len, max_doc=40)
    cases.append(("head-tail", cu, headtail_fragments(row_len, rows, world)))
    for i in range(2):
        cu = random_cu_seqlens(gen, rows, row_len, max_doc=40)
        cases.append((f"random{i}", cu, random_layout(gen, total, world)))
    # One document covering everything (every fragment continues and is continued).
    cases.append(("one-doc", [0, total // 2], random_layout(gen, total // 2, world)))
    if world == 4:
        cases.append(("explicit", *explicit_layout_4()))
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


def _check_case(rank, group, name, cu, table, kind, dtype, seed) -> float:
    from torchtitan_cp.ops.distributed import context_parallel_delta_rule
    from torchtitan_cp.ops.local import chunk_delta_rule

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
        initial_state=None,
        output_final_state=True,
        cu_seqlens=cu_t,
        cu_seqlens_cpu=cu_t,
        backend="torch",
    )
    ((o_ref * d_o).sum() + (f_ref * d_f).sum()).backward()
    ref_grads = [x.grad for x in leaves]

    # This rank's span, through the CP op.
    routing = device_routing(cu, table, rank)
    span = torch.tensor(span_index(table[rank]))
    subs = local_subsequences(cu, table[rank])
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
    live = torch.tensor([j >= 0 for j in term]).view(-1, 1, 1, 1)
    loss = (o * d_o.index_select(1, span)).sum() + (fin * d_f[docs] * live).sum()
    loss.backward()

    errs = {"o": (o - o_ref.index_select(1, span)).abs().max().item()}
    errs["final"] = ((fin - f_ref[docs]) * live).abs().max().item() if term else 0.0
    for nm, x, gr in zip("q k v g beta".split(), loc, ref_grads):
        errs["d" + nm] = (x.grad - gr.index_select(1, span)).abs().max().item()
    worst = max(errs.values())
    assert worst <= TOL[dtype], f"{name} {kind} {dtype} rank {rank}: {errs}"
    # Every rank must own the terminal subsequence of each document exactly once overall.
    return worst


def _worker(rank: int, world: int, kinds: tuple[str, ...]) -> float:
    import torch.distributed as dist

    # One spawn of 4 ranks serves worlds 2, 3 and 4 through subgroups (start-up is the cost).
    groups = {w: dist.new_group(list(range(w))) for w in (2, 3)}
    groups[world] = dist.group.WORLD
    worst = 0.0
    for w in (2, 3, 4):
        if rank >= w:
            continue
        for ci, (name, cu, table) in enumerate(_layouts(w, seed=0)):
            for kind in kinds:
                for dtype in (torch.float64, torch.float32):
                    err = _check_case(rank, groups[w], f"W{w}/{name}", cu, table, kind, dtype, ci)
                    worst = max(worst, err / TOL[dtype])
    return worst


@pytest.mark.parametrize("kind", ["kda", "gdn"])
def test_cp_delta_rule_matches_unsharded(kind: str) -> None:
    worst = run_distributed(_worker, 4, (kind,), timeout=240)
    assert max(worst) <= 1.0
