"""Context parallelism for every registered recurrence (every case of tests/recurrences.py,
through the generic driver ``context_parallel_recurrence``) equals the unsharded local kernel:
outputs, final states of every document (each owned by exactly one rank; padding rows zero) and
the gradients of every input, on 2, 3 and 4 gloo ranks, B = 2 rows per stream, float64 and
float32, over contiguous, head-tail, PTRR and random fragment tables (1-3 token fragments and
single-token documents), random with capped routing, one document over every rank, W = 3 with
an empty rank and W = 4's hand-made table (a document in six pieces on non-adjacent ranks, a
rank holding only document interiors) plain and capped.

Tolerances (max abs difference against the unsharded run of the same local kernel): float64
<= 1e-10, float32 <= 2e-5. The float64 PTRR and hand-made cases are also checked against the
case's token-by-token oracle (tests/reference.py) to the same 1e-10. The family entry points
(``context_parallel_delta_rule``, ``context_parallel_ssd``) are thin wrappers of the driver:
tests/test_cp_delta_rule.py and tests/test_cp_ssd.py call them directly.
"""

from __future__ import annotations

import functools

import pytest
import torch

from tests import dist_utils as du
from tests.recurrences import CASES, HV, K, V
from torchtitan_cp.routing import (
    contiguous_fragments,
    headtail_fragments,
    ptrr_fragments_from_indices,
)

TOL = {torch.float64: 1e-10, torch.float32: 2e-5}
BY_ID = {c.id: c for c in CASES}

Layout = tuple[str, list[int], list[list[tuple[int, int]]], bool]  # name, cu, table, capped


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


def _layouts(world: int) -> list[Layout]:
    gen = torch.Generator().manual_seed(1000 * world)
    rows, row_len = 2, 48  # B > 1: two rows flattened into one stream
    total = rows * row_len
    cu = [du.random_cu_seqlens(gen, rows, row_len, max_doc=40) for _ in range(5)]
    cases: list[Layout] = [
        ("contiguous", cu[0], contiguous_fragments(row_len, rows, world), False),
        ("head-tail", cu[1], headtail_fragments(row_len, rows, world), False),
        ("ptrr", cu[4], ptrr_layout(cu[4], rows, row_len, world), False),
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


def _check_case(rank, group, layout: Layout, dtype, seed, *, case_id: str) -> float:
    import torch.distributed as dist

    from torchtitan_cp.ops.cp.driver import context_parallel_recurrence
    from torchtitan_cp.ops.cp.recurrence import SequenceTables, recurrence, run_local

    rc = BY_ID[case_id]
    name, cu, table, capped = layout
    total = cu[-1]
    cu_t = torch.tensor(cu, dtype=torch.int32)
    rec = recurrence(rc.name, backend="torch", **rc.options)
    full = rc.inputs(total, seed, dtype)
    gen = torch.Generator().manual_seed(seed + 1)
    d_o = torch.randn(1, total, HV, V, generator=gen, dtype=torch.float64).to(dtype)
    d_f = torch.randn(len(cu) - 1, HV, K, V, generator=gen, dtype=torch.float64).to(dtype)

    # Unsharded reference: the same local kernel over the whole stream, global cu_seqlens.
    leaves = [x.clone().requires_grad_(True) for x in full]
    o_ref, f_ref = run_local(rec, tuple(leaves), SequenceTables(cu_t, cu_t, None, None), None, True)
    ((o_ref * d_o).sum() + (f_ref * d_f).sum()).backward()

    # This rank's span, through the CP driver.
    caps = du.loose_caps(cu, table) if capped else None
    routing = du.device_routing(cu, table, rank, caps=caps)
    span = torch.tensor(du.span_index(table[rank]), dtype=torch.int64)
    subs = du.local_subsequences(cu, table[rank])
    offsets = [0]
    for a, b, _ in subs:
        offsets.append(offsets[-1] + b - a)
    assert routing.cu_seqlens_cpu.tolist()[: len(offsets)] == offsets, name
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
    errs["pad-final"] = du.max_abs(fin * ~live, 0 * fin)  # -1 terminal padding returns zeros
    for nm, x, ref in zip(rc.names, loc, leaves, strict=True):
        errs["d" + nm] = du.max_abs(x.grad, ref.grad.index_select(1, span))
    if name in ("ptrr", "explicit") and dtype == torch.float64:
        o_orc, _ = rc.oracle(*full, cu_seqlens=cu)
        errs["oracle"] = du.max_abs(o, o_orc.index_select(1, span))
    worst = max(errs.values())
    assert worst <= TOL[dtype], f"{rc.id} {name} {dtype} rank {rank}: {errs}"

    # Each document's final state comes from exactly one rank.
    owned: list[list[int]] = [[] for _ in range(dist.get_world_size(group))]
    dist.all_gather_object(owned, [subs[j][2] for j in term if j >= 0], group=group)
    assert sorted(d for ds in owned for d in ds) == list(range(len(cu) - 1)), name
    return worst


@pytest.mark.slow
@pytest.mark.parametrize("case_id", sorted(BY_ID))
def test_cp_matches_unsharded(case_id: str) -> None:
    # One spawn per case covers every world and layout.
    du.run_sweep(TOL, _layouts, functools.partial(_check_case, case_id=case_id), timeout=240)


class _FlightCounter:
    """Counts the FLOPs (``torch.utils.flop_counter``'s formulas) autograd and the forward run
    while the driver's all-gather, and then its backward's reduce-scatter, are in flight: from
    the c10d call that posts each to the wait on its work."""

    def __init__(self) -> None:
        self.phase: str | None = None
        self.flops = {"all": 0, "all-gather": 0, "reduce-scatter": 0}

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils.flop_counter import flop_registry

        from torchtitan_cp.ops.cp import collectives

        counter = self
        self.real = collectives._all_gather_single, collectives._reduce_scatter_single

        def wrap(real, phase):
            class Work:
                def __init__(self, work) -> None:
                    self.work = work

                def wait(self, *args):
                    counter.phase = None
                    return self.work.wait(*args)

            def post(*args, async_op: bool = False, **kwargs):
                work = real(*args, async_op=async_op, **kwargs)
                if not async_op:
                    return work
                counter.phase = phase
                return Work(work)

            return post

        collectives._all_gather_single = wrap(self.real[0], "all-gather")
        collectives._reduce_scatter_single = wrap(self.real[1], "reduce-scatter")

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                count = flop_registry.get(func._overloadpacket)
                if count is not None:
                    n = count(*args, **(kwargs or {}), out_val=out)
                    counter.flops["all"] += n
                    if counter.phase is not None:
                        counter.flops[counter.phase] += n
                return out

        self.mode = Mode()
        self.mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        from torchtitan_cp.ops.cp import collectives

        self.mode.__exit__(*exc)
        collectives._all_gather_single, collectives._reduce_scatter_single = self.real


def _overlap_worker(rank: int, world: int) -> dict[str, tuple[float, float]]:
    """Per case: the share of the forward's FLOPs run while the all-gather is in flight, and of
    the backward's while the reduce-scatter is (one document over both ranks, torch kernels)."""
    import torch.distributed as dist

    from torchtitan_cp.ops.cp.driver import context_parallel_recurrence
    from torchtitan_cp.ops.cp.recurrence import recurrence

    cu, table = [0, 512], contiguous_fragments(512, 1, world)
    routing = du.device_routing(cu, table, rank)
    span = torch.tensor(du.span_index(table[rank]), dtype=torch.int64)
    shares = {}
    for rc in CASES:
        rec = recurrence(rc.name, backend="torch", **rc.options)
        loc = [
            x.index_select(1, span).requires_grad_(True)
            for x in rc.inputs(cu[-1], 0, torch.float32, K=32, V=32)
        ]
        with _FlightCounter() as fwd:
            o, _ = context_parallel_recurrence(
                rec, tuple(loc), routing=routing, group=dist.group.WORLD
            )
        with _FlightCounter() as bwd:
            o.sum().backward()
        shares[rc.id] = (
            fwd.flops["all-gather"] / fwd.flops["all"],
            bwd.flops["reduce-scatter"] / bwd.flops["all"],
        )
    return shares


@pytest.mark.slow
def test_cp_driver_overlaps_its_collectives() -> None:
    """The driver computes while its collectives are in flight, every registered recurrence on
    the torch kernels: the forward issues the local kernel's state-independent work (the query
    scores, the intra-chunk outputs) between posting the summaries' all-gather and waiting for
    it, and the backward runs that work's gradients between posting the reduce-scatter and
    waiting for it. Counted FLOPs (load-independent). Measured (rank 0 / rank 1): forward 49-52 %
    and backward 44-45 % of each pass's FLOPs for the delta rule, 71-85 % both ways for the SSD
    family; before, the backward's reduce-scatter blocked (share 0 for every recurrence) and
    SSD's kernel took its entry states first (forward share 0)."""
    for shares in du.run_distributed(_overlap_worker, 2):
        assert set(shares) == set(BY_ID)
        for case_id, (fwd, bwd) in shares.items():
            assert fwd >= 0.3 and bwd >= 0.3, (case_id, fwd, bwd)
