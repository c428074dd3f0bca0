"""The CP gradient check on every simulated rank, for any registered recurrence (test support).

FLA #1115 was a KDA CP bug with exact forwards and wrong gradients on every non-last rank, so
the check compares every rank's gradients, on one device: ``cp_gradients`` simulates ``world``
ranks' contiguous spans in one process through the CP driver's world-1 path (``group=None``),
the spans in **reverse** rank order in one span, so that no fragment follows its predecessor
there and every continuation goes through a published summary, the all-gather's buffer and the
fold, as across ranks (world 1: the all-gather is the identity, its backward no reduce-scatter;
the gloo tests cover those). The documents cross every rank boundary (one runs from rank 1 to
the last rank), so every rank but the last publishes. Inputs are the case's own
(``tests/recurrences.py``), float32 for the CP op; the reference is the unsharded torch kernel in
float64 over the whole stream, same inputs and output cotangent. ``compare`` gives the worst
relative error per rank (``max |cp - ref| / max |ref|`` of each tensor, worst over the inputs'
gradients; the outputs apart).

Used by tests/test_gpu_parity.py (every case, torch and fla; the GPU check's one call runs it on
CUDA) and its check of the check (a fold whose backward is 10 % off must fail ranks 0-2).
"""

from __future__ import annotations

from typing import Any

import torch

from tests.recurrences import RecurrenceCase
from torchtitan_cp.ops.cp.driver import context_parallel_recurrence
from torchtitan_cp.ops.cp.recurrence import Recurrence, SequenceTables, recurrence, run_local
from torchtitan_cp.routing import RoutingPlan, contiguous_fragments

WORLD = 4


def layout(world: int, tokens_per_rank: int) -> tuple[list[int], list[list[tuple[int, int]]]]:
    """Documents over ``world`` contiguous rank spans of ``L`` tokens: a one-token document, one
    over the first boundary, a 5-token one, one from rank 1 to the last rank (every later
    boundary, pass-through ranks between), the rest on the last rank. Returns ``(cu_seqlens,
    table)``; ``table[r]`` is rank ``r``'s fragments."""
    L = tokens_per_rank
    total = world * L
    cu = sorted({0, 1, L + L // 3, L + L // 3 + 5, (world - 1) * L + L // 3, total})
    return cu, [list(f) for f in contiguous_fragments(total, 1, world)]


def cp_gradients(
    case: RecurrenceCase,
    backend: str,
    device: torch.device,
    *,
    world: int = WORLD,
    tokens_per_rank: int,
    K: int,
    V: int,
    seed: int = 0,
    rec: Recurrence | None = None,
) -> dict[str, Any]:
    """Per simulated rank, the CP op's outputs and input gradients next to the float64
    reference's on the same tokens, and the reference's whole tensors (the scale). ``rec``
    replaces the registered recurrence (a test double)."""
    cu, table = layout(world, tokens_per_rank)
    T = cu[-1]
    full = [x.to(device) for x in case.inputs(T, seed, torch.float64, K=K, V=V)]
    ref_rec = recurrence(case.name, backend="torch", **case.options)
    cu_t = torch.tensor(cu, dtype=torch.int32)
    leaves = [x.clone().requires_grad_(True) for x in full]
    o_ref, _ = run_local(ref_rec, tuple(leaves), SequenceTables(cu_t.to(device), cu_t, None, None))
    d_o = torch.randn(
        o_ref.shape, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64
    ).to(device)
    ref_grads = torch.autograd.grad((o_ref * d_o).sum(), leaves)

    span_frags = [f for r in reversed(range(world)) for f in table[r]]
    routing = RoutingPlan.build(cu, [span_frags], 0).to_device(device)
    span = torch.tensor([t for a, b in span_frags for t in range(a, b)], device=device)
    loc = [x.index_select(1, span).float().requires_grad_(True) for x in full]
    rec = rec or recurrence(case.name, backend=backend, **case.options)
    o, _ = context_parallel_recurrence(rec, tuple(loc), routing=routing, group=None)
    grads = torch.autograd.grad((o.double() * d_o.index_select(1, span)).sum(), loc)

    where = {t: i for i, t in enumerate(span.tolist())}  # global token -> span position
    names = [f"d{n}" for n in case.names]
    ranks = []
    for r in range(world):
        ids = [t for a, b in table[r] for t in range(a, b)]
        tokens = torch.tensor(ids, device=device)
        pos = torch.tensor([where[t] for t in ids], device=device)
        ranks.append({
            "o": (o.index_select(1, pos), o_ref.index_select(1, tokens)),
            **{n: (gr.index_select(1, pos), ref.index_select(1, tokens))
               for n, gr, ref in zip(names, grads, ref_grads)},
        })  # fmt: skip # a table, laid out by hand to read across
    return {
        "ranks": ranks,
        "names": names,
        "scale": {"o": o_ref.detach(), **dict(zip(names, ref_grads))},
        "published_summaries": routing.summary_cu_seqlens.numel() - 1,
        "cu_seqlens": cu,
    }


def compare(cmp: dict[str, Any], tol: float) -> dict[str, Any]:
    """Worst relative error per simulated rank and the verdict: every rank's gradients and
    outputs within ``tol``."""

    def rel(name: str, pair) -> float:
        a, ref = pair
        scale = cmp["scale"][name].abs().max().clamp(min=1e-12)
        return ((a.double() - ref.double()).abs().max() / scale).item()

    grad = [max(rel(n, rank[n]) for n in cmp["names"]) for rank in cmp["ranks"]]
    fwd = [rel("o", rank["o"]) for rank in cmp["ranks"]]
    return {
        "max_rel_grad_err_per_rank": grad,
        "max_rel_out_err_per_rank": fwd,
        "tol": tol,
        "within_tol": max(grad + fwd) <= tol,
    }


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the backward scales the cotangent (a wrong-gradient kernel)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return grad * 1.1


class PerturbedFold:
    """A registered recurrence whose fold's gradient into the summaries is 10 % too large (its
    forward exact): the bug class of FLA #1115, as a test double of the check."""

    def __init__(self, inner: Recurrence) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def apply(self, summary: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        return self.inner.apply(_ScaleGrad.apply(summary), state)
