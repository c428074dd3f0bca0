"""The delta-rule kernels as ``torch.library`` custom ops (``ops/common/custom_ops.py`` says why):

==========================================  ==============================================
op (namespace ``torchtitan_cp``)            backward
==========================================  ==============================================
``delta_rule_torch`` (KDA / GDN, PyTorch)   ``delta_rule_torch_bwd``: re-runs the forward
                                            under autograd (costs one extra forward)
``delta_rule_summaries_torch`` (CP          ``delta_rule_summaries_torch_bwd``: re-runs the
summaries ``[E | M]``, states only)         states-only pass under autograd (full cotangent)
``delta_rule_fla_prepare`` (fla-core,      none: its inputs are detached; the two ops below
CUDA: gate cumsum and WY preparation)       return the raw inputs' gradients through it
``delta_rule_fla_local`` (the local kernel  ``delta_rule_fla_bwd``: fla's own
on the prepared factors: state and output   ``chunk_kda_bwd`` / ``chunk_gated_delta_rule_bwd``
kernels)                                    on the saved scores
``delta_rule_summaries_fla`` (CP            ``delta_rule_summaries_fla_bwd``: the WY factors
summaries, the state kernel on the          rebuilt from the saved WY matrix, fla's state
prepared factors of the published tokens)   backward at width V + K from ``[0 | I]`` and the
                                            WY backward
==========================================  ==============================================

The fla ops hand fla's internal functions contiguous tensors only (``common.fla.contiguous``:
saved inputs may be views, cotangents expanded) and return no uninitialised memory (KDA's
``Aqk`` has its never-written upper part zeroed), so compiled gradients equal eager ones and
``torch.library.opcheck`` passes (tests/test_fla_interpreter.py runs both on CPU).

Shapes and conventions are those of ``ops.delta_rule.local`` (docs/CONTRACTS.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any, NamedTuple, cast

import torch
from torch import Tensor

from ..common import custom_ops as shared
from ..common.custom_ops import NS, num_seqs
from ..common.dtypes import compute_dtype
from ..common.fla import FLA_CHUNK_SIZE, contiguous, fla_chunk_indices
from .torch_kernel import chunk_delta_rule_torch, summaries_delta_rule_torch

__all__ = [
    "delta_rule_fla_local_op",
    "delta_rule_fla_prepare_op",
    "delta_rule_summaries_fla_op",
    "delta_rule_summaries_torch_op",
    "delta_rule_torch_op",
]

# ----------------------------------------------------------------------------- delta rule, torch


@torch.library.custom_op(f"{NS}::delta_rule_torch", mutates_args=())
def delta_rule_torch_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    initial_state: Tensor | None,
    cu_seqlens_cpu: Tensor | None,
    kind: str,
    scale: float,
) -> tuple[Tensor, Tensor]:
    """``chunk_delta_rule_torch``; returns ``(o [1,T,HV,V], final_state [N,HV,K,V])`` (the final
    state always: it costs nothing extra here and keeps one output signature)."""
    o, final = chunk_delta_rule_torch(
        q,
        k,
        v,
        g,
        beta,
        kind=kind,
        scale=scale,
        initial_state=initial_state,
        output_final_state=True,
        cu_seqlens_cpu=cu_seqlens_cpu,
    )
    return shared.op_outputs(o, final, initial_state)


@delta_rule_torch_op.register_fake
def _(q, k, v, g, beta, initial_state, cu_seqlens_cpu, kind, scale):
    return v.new_empty(v.shape), shared.state_like((q, k, v), cu_seqlens_cpu)


@torch.library.custom_op(f"{NS}::delta_rule_torch_bwd", mutates_args=())
def delta_rule_torch_bwd_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    initial_state: Tensor | None,
    cu_seqlens_cpu: Tensor | None,
    do: Tensor | None,
    dfinal: Tensor | None,
    kind: str,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients ``(dq, dk, dv, dg, dbeta, dh0)`` by re-running the forward under autograd
    (dh0 is ``[N,HV,K,V]`` zeros without an initial state)."""
    kernel = partial(
        chunk_delta_rule_torch,
        kind=kind,
        scale=scale,
        output_final_state=True,
        cu_seqlens_cpu=cu_seqlens_cpu,
    )
    grads = shared.recompute_grads(
        kernel, (q, k, v, g, beta), initial_state, cu_seqlens_cpu, do, dfinal
    )
    return grads  # type: ignore[return-value]


@delta_rule_torch_bwd_op.register_fake
def _(q, k, v, g, beta, initial_state, cu_seqlens_cpu, do, dfinal, kind, scale):
    return shared.recompute_grads_fake((q, k, v, g, beta), initial_state, cu_seqlens_cpu)


# kind, scale
shared.register_recompute_autograd(delta_rule_torch_op, delta_rule_torch_bwd_op, num_options=2)


# ------------------------------------------------------------------- CP summaries, torch
# The delta rule's CP summaries under torch.compile (``DeltaRule.summarize``): the states-only
# pass, not the local kernel at value width V + K with its output discarded.


@torch.library.custom_op(f"{NS}::delta_rule_summaries_torch", mutates_args=())
def delta_rule_summaries_torch_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    cu_seqlens_cpu: Tensor | None,
    rows_cpu: Tensor | None,
    kind: str,
    scale: float,
) -> Tensor:
    """``summaries_delta_rule_torch``: ``[N, HV, K, V + K] = [E | M]`` of every packed sequence,
    in the compute dtype (the chunk maps composed; no query scores, no outputs). ``rows_cpu``
    ``[N]`` (``SummaryRows.subsequence_cpu``): the rows marked −1 (the routing's padding, last)
    are not computed (identity; their tokens get zero gradients)."""
    return summaries_delta_rule_torch(
        q,
        k,
        v,
        g,
        beta,
        kind=kind,
        scale=scale,
        cu_seqlens_cpu=cu_seqlens_cpu,
        live=_live_rows(rows_cpu),
    ).contiguous()


def _live_rows(rows_cpu: Tensor | None) -> int | None:
    """How many leading summary rows are published (the padding rows, −1, come last)."""
    return None if rows_cpu is None else int(rows_cpu.ge(0).sum())


def _summaries_fake(q: Tensor, v: Tensor, cu_seqlens: Tensor | None, dtype: torch.dtype) -> Tensor:
    HV, K, V = v.shape[2], q.shape[3], v.shape[3]
    return q.new_empty(num_seqs(cu_seqlens), HV, K, V + K, dtype=dtype)


@delta_rule_summaries_torch_op.register_fake
def _(q, k, v, g, beta, cu_seqlens_cpu, rows_cpu, kind, scale):
    return _summaries_fake(q, v, cu_seqlens_cpu, compute_dtype(q.dtype))


@torch.library.custom_op(f"{NS}::delta_rule_summaries_torch_bwd", mutates_args=())
def delta_rule_summaries_torch_bwd_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    cu_seqlens_cpu: Tensor | None,
    rows_cpu: Tensor | None,
    dS: Tensor,
    kind: str,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(dq, dk, dv, dg, dbeta)`` of the summaries for the full cotangent ``dS = [dE | dM]``: the
    states-only pass re-run under autograd (dq is zeros: the summaries do not read q)."""
    return summaries_torch_grads(  # type: ignore[return-value]
        (q, k, v, g, beta), cu_seqlens_cpu, dS, kind, scale, _live_rows(rows_cpu)
    )


def summaries_torch_grads(
    inputs: tuple[Tensor, ...],
    cu_seqlens_cpu: Tensor | None,
    dS: Tensor,
    kind: str,
    scale: float,
    live: int | None = None,
) -> tuple[Tensor, ...]:
    """The body of ``delta_rule_summaries_torch_bwd`` (also what scripts/bench_cp_overhead.py
    counts: a custom op is opaque to FlopCounterMode)."""
    leaves = [x.detach().requires_grad_(True) for x in inputs]
    with shared.autograd_inside_op():
        S = summaries_delta_rule_torch(
            *leaves, kind=kind, scale=scale, cu_seqlens_cpu=cu_seqlens_cpu, live=live
        )
        grads = shared.input_grads([S], [dS], leaves)
    return tuple(gr.to(x.dtype).contiguous() for gr, x in zip(grads, inputs))


@delta_rule_summaries_torch_bwd_op.register_fake
def _(q, k, v, g, beta, cu_seqlens_cpu, rows_cpu, dS, kind, scale):
    return tuple(x.new_empty(x.shape) for x in (q, k, v, g, beta))


def _register_summaries_autograd(op: Any, backward_op: Any) -> None:
    """A summaries op's autograd: ``op(q, k, v, g, beta, *tables, kind, scale)`` saves its
    tensors; ``backward_op(*saved, dS, kind, scale)`` returns ``(dq, dk, dv, dg, dbeta)`` (the
    tables and options have no gradient)."""

    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        *tensors, kind, scale = inputs
        ctx.save_for_backward(*tensors)
        ctx.kind, ctx.scale, ctx.num_args = kind, scale, len(inputs)

    def backward(ctx: Any, dS: Tensor) -> tuple[Tensor | None, ...]:
        grads = backward_op(*ctx.saved_tensors, dS, ctx.kind, ctx.scale)
        return *grads, *(None,) * (ctx.num_args - len(grads))

    op.register_autograd(backward, setup_context=setup_context)


_register_summaries_autograd(delta_rule_summaries_torch_op, delta_rule_summaries_torch_bwd_op)


# ----------------------------------------------------------------------------- delta rule, fla


def _zero_unwritten_scores(A: Tensor, cu_seqlens: Tensor | None) -> Tensor:
    """fla's KDA forward allocates ``Aqk [1, T, HV, BT]`` with ``torch.empty`` and writes, for a
    token at position p of its chunk, columns 0..p only (its backward reads no other). Zero the
    rest, so the op returns no uninitialised memory (opcheck; run-to-run equal outputs).
    Device ops on the device offsets: no host read."""
    T, BT = A.shape[1], A.shape[-1]
    t = torch.arange(T, device=A.device)
    if cu_seqlens is None:
        pos = t % BT
    else:
        cu = cu_seqlens.to(torch.int64)
        seq = torch.searchsorted(cu[1:], t, right=True)  # the sequence each token belongs to
        pos = (t - cu.index_select(0, seq)) % BT
    unwritten = torch.arange(BT, device=A.device)[None, :] > pos[:, None]  # [T, BT]
    return A.masked_fill(unwritten[None, :, None, :], 0)


@torch.library.custom_op(f"{NS}::delta_rule_fla_bwd", mutates_args=())
def delta_rule_fla_bwd_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    beta: Tensor,
    g_cumsum: Tensor,
    a1: Tensor,
    a2: Tensor,
    initial_state: Tensor | None,
    cu_seqlens: Tensor | None,
    cu_seqlens_cpu: Tensor | None,
    chunk_indices: Tensor | None,
    do: Tensor,
    dfinal: Tensor | None,
    kind: str,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """fla-core's own backward; ``(dq, dk, dv, dg, dbeta, dh0)`` (dh0 ``[0]`` without h0)."""
    chunk_indices = fla_chunk_indices(cu_seqlens, cu_seqlens_cpu, chunk_indices, q.shape[1])
    # The saved inputs are the forward's arguments as the caller passed them (views included).
    q, k, v, beta, g_cumsum, a1, a2, initial_state, do, dfinal = contiguous(
        q, k, v, beta, g_cumsum, a1, a2, initial_state, do, dfinal
    )
    kw: dict[str, Any] = dict(
        q=q,
        k=k,
        v=v,
        beta=beta,
        scale=scale,
        initial_state=initial_state,
        do=do,
        dht=dfinal,
        cu_seqlens=cu_seqlens,
        chunk_indices=chunk_indices,
        chunk_size=FLA_CHUNK_SIZE,
    )
    grads: tuple[Any, ...]
    if kind == "kda":
        from fla.ops.kda.chunk_bwd import chunk_kda_bwd

        grads = chunk_kda_bwd(**kw, Aqk=a1, Akk=a2, g=g_cumsum)
    else:
        from fla.ops.gated_delta_rule.chunk import chunk_gated_delta_rule_bwd

        grads = chunk_gated_delta_rule_bwd(**kw, g=g_cumsum, A=a1)
    dq, dk, dv, db, dgate, dh0 = grads[:6]
    dh0 = shared.fla_state_grad(dh0, initial_state, q)
    return (
        dq.to(q.dtype),
        dk.to(k.dtype),
        dv.to(v.dtype),
        cast(Tensor, dgate).to(g_cumsum.dtype),
        db.to(beta.dtype),
        dh0,
    )


@delta_rule_fla_bwd_op.register_fake
def _(
    q,
    k,
    v,
    beta,
    g_cumsum,
    a1,
    a2,
    initial_state,
    cu_seqlens,
    cu_seqlens_cpu,
    chunk_indices,
    do,
    dfinal,
    kind,
    scale,
):
    return shared.fla_grads_fake((q, k, v, g_cumsum, beta), initial_state)


def _fla_grads(ctx, do: Tensor, dfinal: Tensor | None) -> tuple[Tensor | None, ...]:
    """``(dq, dk, dv, dg, dbeta, dh0)`` of the local op (``_setup_fla_local`` saved what fla's
    backward reads)."""
    q, k, v, beta, g_cum, a1, a2, h0, cu, cu_cpu, chunk_indices = ctx.saved_tensors
    if dfinal is not None and dfinal.numel() == 0:
        dfinal = None
    dq, dk, dv, dg, db, dh0 = delta_rule_fla_bwd_op(
        q,
        k,
        v,
        beta,
        g_cum,
        a1,
        a2,
        h0,
        cu,
        cu_cpu,
        chunk_indices,
        do,
        dfinal,
        ctx.kind,
        ctx.scale,
    )
    return dq, dk, dv, dg.to(ctx.g_dtype), db, (dh0 if h0 is not None else None)


# ------------------------------------------------------------------- the local kernel, fla
# Under torch.compile the delta rule on fla is two ops: fla's gate cumsum and WY preparation
# (``delta_rule_fla_prepare``) and the local kernel on its factors (``delta_rule_fla_local``,
# fla's state and output kernels; ``fla_kernel.FACTORS``). In a CP layer the summaries op
# takes the same factors, so the preparation runs once (``DeltaRule.prepare``). The
# preparation op has no autograd: it runs on detached inputs, and the consumers' backward ops
# return the raw inputs' gradients through it (fla's own backward, which rebuilds the WY
# factors from the saved scores).


def prepare_op_call(
    inputs: tuple[Tensor, ...], a: shared.OpArgs, chunk_indices: Tensor | None, kind: str
) -> list[Tensor]:
    """``delta_rule_fla_prepare`` of ``inputs`` (detached) with ``op_args``' offsets."""
    detached = (x.detach() for x in inputs)
    return delta_rule_fla_prepare_op(
        *detached, a.cu_seqlens, a.cu_seqlens_cpu, chunk_indices, kind, a.scale
    )


def local_op_call(
    inputs: tuple[Tensor, ...],
    factors: list[Tensor],
    a: shared.OpArgs,
    chunk_indices: Tensor | None,
    kind: str,
    output_final_state: bool,
) -> tuple[Tensor, Tensor | None]:
    """``delta_rule_fla_local`` with ``op_args``' offsets and entry states: ``(o, final |
    None)``."""
    o, final = delta_rule_fla_local_op(
        *inputs,
        factors,
        a.initial_state,
        a.cu_seqlens,
        a.cu_seqlens_cpu,
        chunk_indices,
        kind,
        a.scale,
        output_final_state,
    )
    return o, (final if output_final_state else None)


@torch.library.custom_op(f"{NS}::delta_rule_fla_prepare", mutates_args=())
def delta_rule_fla_prepare_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    cu_seqlens: Tensor | None,
    cu_seqlens_cpu: Tensor | None,
    chunk_indices: Tensor | None,
    kind: str,
    scale: float,
) -> list[Tensor]:
    """fla's gate cumsum and WY preparation: ``[g_cumsum, A, Aqk, w, u, kg]``. The gate cumsum
    (float32), the WY matrix (KDA's ``Akk``, GDN's ``A``), KDA's query scores ``Aqk`` (its
    never-written upper part zeroed; GDN ``[0]``), the WY factors ``w [1,T,HV,K]``, ``u
    [1,T,HV,V]`` and KDA's gated keys ``kg [1,T,HV,K]`` (GDN ``[0]``: its state pass reads k)."""
    from .fla_kernel import FlaState, prepared_factors

    q, k, v, g, beta = contiguous(q, k, v, g, beta)
    ci = fla_chunk_indices(cu_seqlens, cu_seqlens_cpu, chunk_indices, q.shape[1])
    idx = dict(cu_seqlens=cu_seqlens, chunk_indices=ci, chunk_offsets=None)
    st = FlaState(kind=kind, scale=scale, inputs=(q, k, v, g, beta), idx=idx, g_dtype=g.dtype)
    factors = prepared_factors(st)
    if kind == "kda":
        factors[2] = _zero_unwritten_scores(factors[2], cu_seqlens)
    return factors


@delta_rule_fla_prepare_op.register_fake
def _(q, k, v, g, beta, cu_seqlens, cu_seqlens_cpu, chunk_indices, kind, scale):
    T, HV, K, V = q.shape[1], v.shape[2], q.shape[3], v.shape[3]
    scores = k.new_empty(1, T, HV, FLA_CHUNK_SIZE)
    kda = kind == "kda"
    return [
        g.new_empty(g.shape, dtype=torch.float32),
        scores,
        scores.new_empty(scores.shape) if kda else q.new_empty(0),
        k.new_empty(1, T, HV, K),
        v.new_empty(1, T, HV, V),
        k.new_empty(1, T, HV, K) if kda else q.new_empty(0),
    ]


@torch.library.custom_op(f"{NS}::delta_rule_fla_local", mutates_args=())
def delta_rule_fla_local_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    factors: Sequence[Tensor],
    initial_state: Tensor | None,
    cu_seqlens: Tensor | None,
    cu_seqlens_cpu: Tensor | None,
    chunk_indices: Tensor | None,
    kind: str,
    scale: float,
    output_final_state: bool,
) -> tuple[Tensor, Tensor]:
    """The local kernel on ``delta_rule_fla_prepare``'s ``factors``: fla's state kernel from
    ``initial_state`` and its output kernel. Returns ``(o [1,T,HV,V] in q's dtype, final_state
    [N,HV,K,V] float32)`` (``[0]`` when not requested); the backward is fla's own
    (``delta_rule_fla_bwd``) on the saved scores."""
    from .fla_kernel import FACTORS, local_fwd, op_state

    q, k, v, g, beta, initial_state = contiguous(q, k, v, g, beta, initial_state)
    ci = fla_chunk_indices(cu_seqlens, cu_seqlens_cpu, chunk_indices, q.shape[1])
    idx = dict(cu_seqlens=cu_seqlens, chunk_indices=ci, chunk_offsets=None)
    named = dict(zip(FACTORS, contiguous(*factors), strict=True))
    st = op_state((q, k, v, g, beta), named, kind=kind, scale=scale, idx=idx)
    o, final = local_fwd(st, initial_state, output_final_state)
    return o, (final if final is not None else shared.absent_state(q))


@delta_rule_fla_local_op.register_fake
def _(
    q,
    k,
    v,
    g,
    beta,
    factors,
    initial_state,
    cu_seqlens,
    cu_seqlens_cpu,
    chunk_indices,
    kind,
    scale,
    output_final_state,
):
    final = shared.fla_final_fake(q, v, cu_seqlens, output_final_state)
    return q.new_empty(*v.shape), final


def _setup_fla_local(ctx, inputs, output) -> None:
    q, k, v, g, beta, factors, h0, cu, cu_cpu, chunk_indices, kind, scale, _ = inputs
    g_cum, A, Aqk = factors[:3]
    a1, a2 = (Aqk, A) if kind == "kda" else (A, Aqk)  # what fla's backward takes (kda, gdn)
    ctx.save_for_backward(q, k, v, beta, g_cum, a1, a2, h0, cu, cu_cpu, chunk_indices)
    ctx.kind, ctx.scale, ctx.g_dtype, ctx.n_factors = kind, scale, g.dtype, len(factors)


def _backward_fla_local(ctx, do, dfinal):
    dq, dk, dv, dg, db, dh0 = _fla_grads(ctx, do, dfinal)
    return dq, dk, dv, dg, db, [None] * ctx.n_factors, dh0, *(None,) * 6


delta_rule_fla_local_op.register_autograd(_backward_fla_local, setup_context=_setup_fla_local)


# --------------------------------------------------------------------- CP summaries, fla
# The compiled path's states-only summaries on fla (``fla_kernel.summaries_fwd``), on the
# preparation op's factors of the published tokens. The eager path joins the summaries'
# ``D [I | hᵀ]`` cotangent with the local kernel's inside one layer's autograd nodes
# (``fla_kernel``), which does not cross op boundaries; this op's backward takes the full
# cotangent ``[dE | dM]`` (what the fold's traced backward gives) and runs the state backward
# at width V + K from ``[0 | I]``, on the WY factors rebuilt from the saved WY matrix.


class _LiveStream(NamedTuple):
    """The published rows' part of a summary stream (``_live_stream``)."""

    inputs: list[Tensor]  # token-major tensors over the live rows' tokens, contiguous
    idx: dict[str, Any]  # cu_seqlens and the chunk table fla's pieces take
    live: int  # live rows
    rows: int  # all rows


def _live_stream(xs, cu_seqlens, cu_seqlens_cpu, chunk_indices, rows_cpu) -> _LiveStream:
    """The tokens (of each token-major ``xs [1, T, ...]``; a ``[0]`` stays) and offsets of the
    first ``live`` sequences (the padding rows, −1 in ``rows_cpu``, come last and are not
    computed); host offsets only."""
    n = num_seqs(cu_seqlens)
    live = n if rows_cpu is None else int(rows_cpu.ge(0).sum())
    # The whole stream's table, then its first rows: the live sequences' chunks come first.
    ci = fla_chunk_indices(cu_seqlens, cu_seqlens_cpu, chunk_indices, xs[0].shape[1])
    if live < n:
        assert cu_seqlens_cpu is not None and ci is not None  # always given by the callers
        cu_cpu = cu_seqlens_cpu[: live + 1].to(torch.int64)
        lens = cu_cpu[1:] - cu_cpu[:-1]
        ci = ci[: int(((lens + FLA_CHUNK_SIZE - 1) // FLA_CHUNK_SIZE).sum())]
        end = int(cu_cpu[-1])
        xs = [x[:, :end] if x.dim() > 1 else x for x in xs]
        cu_seqlens = cu_seqlens[: live + 1]
    idx = dict(cu_seqlens=cu_seqlens, chunk_indices=ci, chunk_offsets=None)
    return _LiveStream(contiguous(*xs), idx, live, n)


@torch.library.custom_op(f"{NS}::delta_rule_summaries_fla", mutates_args=())
def delta_rule_summaries_fla_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    factors: Sequence[Tensor],
    cu_seqlens: Tensor,
    cu_seqlens_cpu: Tensor | None,
    chunk_indices: Tensor | None,
    rows_cpu: Tensor | None,
    kind: str,
    scale: float,
) -> Tensor:
    """fla's states-only pass: ``[N, HV, K, V + K] = [E | M]`` float32 of every packed sequence
    (the state kernel on ``factors``, ``delta_rule_fla_prepare``'s of these tokens; ``Aqk``
    may be ``[0]``; no output kernel); the rows marked −1 in ``rows_cpu`` (the routing's
    padding, last) are identities, not computed."""
    from .fla_kernel import FACTORS, op_state, summaries_fwd

    st = _live_stream(
        [q, k, v, g, beta, *factors], cu_seqlens, cu_seqlens_cpu, chunk_indices, rows_cpu
    )
    HV, K, V = v.shape[2], q.shape[3], v.shape[3]
    out = torch.zeros(st.rows, HV, K, V + K, dtype=torch.float32, device=q.device)
    out[..., V:] = torch.eye(K, dtype=torch.float32, device=q.device)
    if st.live:
        inputs, named = tuple(st.inputs[:5]), dict(zip(FACTORS, st.inputs[5:], strict=True))
        out[: st.live] = summaries_fwd(op_state(inputs, named, kind=kind, scale=scale, idx=st.idx))
    return out


@delta_rule_summaries_fla_op.register_fake
def _(q, k, v, g, beta, factors, cu_seqlens, cu_seqlens_cpu, chunk_indices, rows_cpu, kind, scale):
    return _summaries_fake(q, v, cu_seqlens, torch.float32)


@torch.library.custom_op(f"{NS}::delta_rule_summaries_fla_bwd", mutates_args=())
def delta_rule_summaries_fla_bwd_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    g_cumsum: Tensor,
    A: Tensor,
    cu_seqlens: Tensor,
    cu_seqlens_cpu: Tensor | None,
    chunk_indices: Tensor | None,
    rows_cpu: Tensor | None,
    dS: Tensor,
    kind: str,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(dq, dk, dv, dg, dbeta)`` for the full cotangent ``dS``: the WY factors rebuilt from
    the saved WY matrix ``A`` and gate cumsum, then fla's state backward at value width V + K
    from ``[0 | I]`` and its WY backward (dq is zeros, and so is every gradient of a padding
    row's tokens)."""
    from .fla_kernel import op_state, summaries_bwd

    grads = [torch.zeros_like(x, memory_format=torch.contiguous_format) for x in (q, k, v, g, beta)]
    xs = [q, k, v, g, beta, g_cumsum, A]
    st = _live_stream(xs, cu_seqlens, cu_seqlens_cpu, chunk_indices, rows_cpu)
    if not st.live:
        return tuple(grads)  # type: ignore[return-value]
    named = dict(g_cs=st.inputs[5], A=st.inputs[6])
    prepared = op_state(tuple(st.inputs[:5]), named, kind=kind, scale=scale, idx=st.idx)
    live_grads = summaries_bwd(prepared, dS[: st.live].contiguous())
    end = st.inputs[0].shape[1]
    for gr, d in zip(grads[1:], live_grads, strict=True):  # dk, dv, dg, dbeta
        gr[:, :end] = d.to(gr.dtype)
    return tuple(grads)  # type: ignore[return-value]


@delta_rule_summaries_fla_bwd_op.register_fake
def _(
    q,
    k,
    v,
    g,
    beta,
    g_cumsum,
    A,
    cu_seqlens,
    cu_seqlens_cpu,
    chunk_indices,
    rows_cpu,
    dS,
    kind,
    scale,
):
    return tuple(x.new_empty(x.shape) for x in (q, k, v, g, beta))


def _setup_summaries_fla(ctx, inputs, output) -> None:
    q, k, v, g, beta, factors, cu, cu_cpu, chunk_indices, rows_cpu, kind, scale = inputs
    g_cum, A = factors[:2]  # the WY factors are rebuilt from A (memory: as fla keeps scores)
    ctx.save_for_backward(q, k, v, g, beta, g_cum, A, cu, cu_cpu, chunk_indices, rows_cpu)
    ctx.kind, ctx.scale, ctx.n_factors = kind, scale, len(factors)


def _backward_summaries_fla(ctx, dS):
    grads = delta_rule_summaries_fla_bwd_op(*ctx.saved_tensors, dS, ctx.kind, ctx.scale)
    return *grads, [None] * ctx.n_factors, *(None,) * 6


delta_rule_summaries_fla_op.register_autograd(
    _backward_summaries_fla, setup_context=_setup_summaries_fla
)
