"""Chunked gated delta rule (KDA and GDN) in plain PyTorch.

Runs anywhere (CPU included), differentiates through ordinary autograd, and is the reference
implementation of ``ops.delta_rule.local.chunk_delta_rule(backend="torch")``.

Algorithm (per value head; see docs/kernels.md for the derivation):

* The stream is cut into sequences (``cu_seqlens``) and every sequence into chunks of ``C``
  tokens; the last chunk of a sequence is zero-padded (q = k = v = beta = 0, log gate 0, which
  leaves the state untouched). All chunks of all sequences are packed into one batch.
* Inside a chunk, with ``G_t`` the cumulative log gate since the chunk start and ``S0`` the
  entry state, the rank-one corrections ``d_t`` satisfy a unit lower-triangular system
  ``(I + A) d = beta * (v - (exp(G) * k) S0)`` with
  ``A[t,s] = beta_t * sum_c k_t[c] k_s[c] exp(G_t[c] - G_s[c])`` for ``s < t``. Solving it once per
  chunk (batched ``solve_triangular``) gives ``d = U - W S0`` (the WY / UT form).
* Every chunk is then an affine map of its entry state, ``S_end = M S0 + E``; a short loop over
  chunk positions (all sequences at once) carries the state; outputs follow in one batched step:
  ``o = (scale q * exp(G)) S0 + Aqk d = (scale q * exp(G) - Aqk W) S0 + Aqk U``.
* Everything up to the chunk maps is independent of the entry states (``prepare_delta_rule_torch``):
  the CP summaries compose those maps (``compose_chunk_maps``) and the local kernel
  (``local_delta_rule_torch``) reuses them, so a CP layer computes them once.
* Gates stay in log space relative to the chunk (or a sub-block of it), and every exponent is
  masked to ``-inf`` before ``exp`` where the pair is not causal, so only ``exp(x)`` with
  ``x <= 0`` is ever evaluated: strong gates underflow to zero instead of overflowing, in the
  forward and in the backward pass.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from ..common.dtypes import compute_dtype
from ..common.scores import decay_scores
from ..common.varlen import ChunkLayout, chunk_layout, device_offsets, host_cu_seqlens, ship

__all__ = [
    "DeltaRuleChunks",
    "chunk_delta_rule_torch",
    "compose_chunk_maps",
    "local_delta_rule_torch",
    "prepare_delta_rule_torch",
    "summaries_delta_rule_torch",
]


class DeltaRuleChunks(NamedTuple):
    """The state-independent work of the chunked delta rule over a span (``prepare_delta_rule_torch``):
    every chunk's scores, WY factors and affine map, shared by the local kernel and the CP
    summaries. NC chunks, C tokens each, value heads HV.

    ``q``, ``k`` ``[NC, HV, C, K]`` packed (q scaled); ``G`` the cumulative log gates
    (``[NC, HV, C, K]`` for KDA, ``[NC, HV, C]`` for GDN); ``U [NC, HV, C, V]``, ``W [NC, HV, C, K]`` the WY factors (``d = U - W S0``);
    ``M [NC, HV, K, K]``, ``E [NC, HV, K, V]`` the chunk map ``S_end = M S0 + E``. ``saved``
    holds the local kernel's chunk entry states for the summaries' backward (``compose_chunk_maps``).
    """

    layout: ChunkLayout
    cu: list[int]
    state_shape: tuple[int, int, int]
    out_dtype: torch.dtype
    kind: str
    sub_chunk_size: int
    q: Tensor
    k: Tensor
    G: Tensor
    U: Tensor
    W: Tensor
    M: Tensor
    E: Tensor
    saved: dict[str, Tensor]


def prepare_delta_rule_torch(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    kind: str,
    scale: float | None = None,
    cu_seqlens: Tensor | None = None,
    cu_seqlens_cpu: Tensor | None = None,
    chunk_size: int = 64,
    sub_chunk_size: int = 8,
) -> DeltaRuleChunks:
    """Everything of ``chunk_delta_rule_torch`` that does not depend on the entry states (shapes
    and arguments as there); differentiable."""
    if kind not in ("kda", "gdn"):
        raise ValueError(f"kind must be 'kda' or 'gdn', got {kind!r}")
    T, H, K = q.shape[1:]
    HV, V = v.shape[2:]
    scale = K**-0.5 if scale is None else scale
    cd = compute_dtype(q.dtype)
    dev = q.device
    C = chunk_size
    sub = sub_chunk_size if (sub_chunk_size and C % sub_chunk_size == 0) else C
    cu = host_cu_seqlens(T, cu_seqlens, cu_seqlens_cpu)
    lay = chunk_layout(cu, C, device_offsets(cu, cu_seqlens, dev))
    if not lay.num_chunks:  # no tokens: nothing to prepare (the local kernel passes states on)

        def z(*shape: int) -> Tensor:
            return q.new_zeros(0, HV, *shape, dtype=cd)

        qk, G0 = z(C, K), (z(C, K) if kind == "kda" else z(C))
        return DeltaRuleChunks(
            lay, cu, (HV, K, V), v.dtype, kind, sub, qk, qk, G0, z(C, V), qk, z(K, K), z(K, V), {}
        )
    rep = HV // H
    qc = lay.pack(q, cd).repeat_interleave(rep, dim=1) * scale  # [NC, HV, C, K]
    kc = lay.pack(k, cd).repeat_interleave(rep, dim=1)
    vc = lay.pack(v, cd)  # [NC, HV, C, V]
    bc = lay.pack(beta, cd)  # [NC, HV, C]
    G = lay.pack(g, cd).cumsum(2)  # cumulative log gate inside the chunk, <= 0
    # Key-key scores only: the query scores are not needed before the entry states are, so the
    # local kernel computes them while the CP all-gather is in flight.
    A = _scores(kc, kc, G, sub)
    if kind == "kda":
        Gl = G[:, :, -1, :]  # [NC, HV, K] log gate over the whole chunk
        decay_end = torch.exp(Gl.unsqueeze(-2) - G)  # exp(G_C - G_t) <= 1
    else:
        Gl = G[:, :, -1]  # [NC, HV]
        decay_end = torch.exp(Gl.unsqueeze(-1) - G).unsqueeze(-1)
    kg = kc * _exp_gate(kind, G)

    # WY form: (I + beta*A) d = beta*v - beta*(k*exp(G)) S0  =>  d = U - W S0.
    b = bc.unsqueeze(-1)
    A = b * A  # only its strictly lower part is read: the solve assumes a unit diagonal
    rhs = torch.cat([b * vc, b * kg], -1)  # one solve for both right-hand sides
    U, W = torch.linalg.solve_triangular(A, rhs, upper=False, unitriangular=True).split([V, K], -1)

    # Chunk as an affine map of its entry state: S_end = M S0 + E.
    khT = (kc * decay_end).transpose(-1, -2)  # k_t exp(G_C - G_t), [NC, HV, K, C]
    if kind == "kda":
        M = torch.diag_embed(torch.exp(Gl)) - khT @ W  # [NC, HV, K, K]
    else:
        eye = torch.eye(K, dtype=cd, device=dev)
        M = torch.exp(Gl)[..., None, None] * eye - khT @ W
    E = khT @ U  # [NC, HV, K, V]
    return DeltaRuleChunks(lay, cu, (HV, K, V), v.dtype, kind, sub, qc, kc, G, U, W, M, E, {})


def _scores(a: Tensor, b: Tensor, G: Tensor, sub: int) -> Tensor:
    """Causal decay scores ``[NC, HV, C, C]`` of ``a`` against ``b`` (``common.scores``'s
    ``decay_scores`` for one operand; KDA's gate per key, GDN's per head)."""
    return decay_scores(a.unsqueeze(0), b, G, sub)[0]


def _exp_gate(kind: str, G: Tensor) -> Tensor:
    """``exp(G)`` broadcastable against ``[NC, HV, C, K]``."""
    return torch.exp(G) if kind == "kda" else torch.exp(G).unsqueeze(-1)


def local_delta_rule_torch(
    chunks: DeltaRuleChunks,
    initial_state: Tensor | Callable[[], Tensor | None] | None = None,
    output_final_state: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """The local kernel on prepared chunks: ``(o [1, T, HV, V], final [N, HV, K, V] or None)``.

    ``initial_state`` ``[N, HV, K, V]``, None (zeros) or a thunk returning it: the thunk is called
    after the state-independent output terms are issued (the CP driver's all-gather is in flight
    meanwhile). Outputs are ``o = (q exp(G) - Aqk W) S0 + Aqk U`` per chunk, with the causal
    query-key scores ``Aqk``.
    """
    lay, cu = chunks.layout, chunks.cu
    HV, K, V = chunks.state_shape
    cd, dev = chunks.M.dtype, chunks.M.device
    # State-independent: the query side of the state term and the intra-chunk outputs.
    Aqk = _scores(chunks.q, chunks.k, chunks.G, chunks.sub_chunk_size)
    qw = chunks.q * _exp_gate(chunks.kind, chunks.G) - Aqk @ chunks.W  # [NC, HV, C, K]
    oi = Aqk @ chunks.U  # [NC, HV, C, V]
    h0 = initial_state() if callable(initial_state) else initial_state
    state0 = (
        h0.to(cd) if h0 is not None else torch.zeros(len(cu) - 1, HV, K, V, dtype=cd, device=dev)
    )
    if not lay.num_chunks:
        o = torch.zeros(1, cu[-1], HV, V, dtype=chunks.out_dtype, device=dev)
        return o, (state0.clone() if output_final_state else None)
    # Inter-chunk recurrence S <- M S + E, and every chunk's entry state S0 [NC, HV, K, V].
    final, S0 = lay.scan(chunks.M, chunks.E, state0, torch.matmul, entries=True)
    assert S0 is not None
    chunks.saved["entry"] = S0.detach()  # for compose_chunk_maps' backward
    oc = qw @ S0 + oi  # [NC, HV, C, V]
    return lay.unpack(oc).to(chunks.out_dtype), (final if output_final_state else None)


def _compose(M: Tensor, E: Tensor, plan: _ComposePlan) -> Tensor:
    """``S <- M_c S + [E_c | 0]`` from ``S = [E_1 | M_1]`` over the plan's chunks: ``[R', HV, K,
    V + K]`` in the plan's row order (plain ops: autograd through it takes any cotangent)."""
    V = E.shape[-1]
    ids0 = plan.ids(0)
    S = torch.cat([E[ids0], M[ids0]], -1)
    for p in range(1, len(plan.steps)):
        ids = plan.ids(p)
        a = ids.numel()
        head = M[ids] @ S[:a]
        head[..., :V] += E[ids]
        S = torch.cat([head, S[a:]], 0) if a < S.shape[0] else head
    return S


class _ComposeChunkMaps(torch.autograd.Function):
    """Summaries ``[E | M]`` of whole subsequences from their chunk maps (``compose_chunk_maps``).

    Forward: ``S <- M_c S + [E_c | 0]`` from ``S = [0 | I]`` over each row's chunks (the first
    chunk needs no product: ``S = [E_1 | M_1]``). Backward: a summary is only ever applied to
    the entry state ``h`` its publisher's local kernel used (``Recurrence.apply``), so its
    cotangent is ``D [I | hᵀ]`` with ``D`` its first V columns; the adjoint then carries
    ``D [K, V]`` (not ``[K, V + K]``) back through the chunks, and each chunk's ``dM_c = Λ_c S0_cᵀ``
    uses the local kernel's own entry state ``S0_c`` of that chunk: the backward costs two
    ``K x K x V`` products per chunk, as the local kernel's state scan does.
    """

    @staticmethod
    def forward(ctx, M: Tensor, E: Tensor, plan: _ComposePlan, saved: dict) -> Tensor:  # type: ignore[override]
        ctx.plan, ctx.saved = plan, saved
        ctx.save_for_backward(M)
        return _compose(M, E, plan)

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        (M,) = ctx.saved_tensors
        plan = ctx.plan
        if "entry" not in ctx.saved:
            raise RuntimeError("compose_chunk_maps' backward needs the local kernel's forward")
        S0 = ctx.saved["entry"]
        V = S0.shape[-1]
        lam = grad[..., :V]  # D, one per row (rows in the plan's order)
        ids_all, lams = [], []
        for p in range(len(plan.steps) - 1, -1, -1):
            ids = plan.ids(p)
            a = ids.numel()
            ids_all.append(ids)
            lams.append(lam[:a])
            if p:
                lam = torch.cat([M[ids].transpose(-1, -2) @ lam[:a], lam[a:]], 0)
        ids = torch.cat(ids_all)
        lam_c = torch.cat(lams)  # Λ_c of every composed chunk
        dE = torch.zeros(M.shape[0], *lam_c.shape[1:], dtype=lam_c.dtype, device=M.device)
        dE.index_add_(0, ids, lam_c)
        dM = torch.zeros_like(M).index_add_(0, ids, lam_c @ S0[ids].transpose(-1, -2))
        return dM, dE, None, None


class _ComposePlan(NamedTuple):
    """Schedule of ``compose_chunk_maps``, on the device: rows sorted by chunk count
    (descending); ``first [R']`` the first chunk id of each sorted row, ``steps[p]`` (host
    ints) how many rows still run at chunk position p (a prefix)."""

    order: Tensor  # [R'] row index of each sorted row
    first: Tensor
    steps: list[int]

    def ids(self, p: int) -> Tensor:
        """The chunk ids at position p of the rows still running."""
        return self.first[: self.steps[p]] + p


def compose_chunk_maps(
    chunks: DeltaRuleChunks,
    subsequences: list[int],
    *,
    entry_backward: bool = True,
    rows: Tensor | None = None,
) -> Tensor:
    """``[R, HV, K, V + K]`` summaries ``[E | M]`` of the prepared subsequences ``subsequences``
    (indices into ``chunks.cu``; −1 or an empty subsequence: the identity map).

    Composes the chunk maps ``prepare_delta_rule_torch`` made (no scores, no solve, no outputs).
    ``rows``: the same indices on the chunks' device (``SummaryRows.subsequence``; shipped from
    ``subsequences`` when None): the schedule is built there, so nothing is copied or read back.
    ``entry_backward``: differentiable through ``_ComposeChunkMaps`` (the ``D [I | hᵀ]`` backward,
    valid for the driver's use once ``local_delta_rule_torch`` has run on the same chunks); False:
    plain autograd through the composition, any cotangent ``[dE | dM]`` (the summaries' custom op,
    ``summaries_delta_rule_torch``).
    """
    HV, K, V = chunks.state_shape
    lay = chunks.layout
    R = len(subsequences)
    nch = [lay.chunks[n] if n >= 0 else 0 for n in subsequences]
    live = sum(1 for n in nch if n)
    steps = [sum(1 for n in nch if n > p) for p in range(max(nch, default=0))]
    cd, dev = chunks.M.dtype, chunks.M.device
    out = torch.zeros(R, HV, K, V + K, dtype=cd, device=dev)
    out[..., V:] = torch.eye(K, dtype=cd, device=dev)
    if not live:
        return out
    rows = ship(subsequences, dev) if rows is None else rows.to(torch.int64)
    real = rows >= 0
    safe = rows.clamp(min=0)
    counts = torch.where(real, lay.counts[safe], 0)
    # Rows by chunk count, descending and stable (the host's order of ``steps``): the rows with
    # chunks are the first ``live``.
    order = torch.argsort(counts, descending=True, stable=True)[:live]
    plan = _ComposePlan(order, lay.first[safe[order]], steps)
    if entry_backward:
        S = _ComposeChunkMaps.apply(chunks.M, chunks.E, plan, chunks.saved)
    else:
        S = _compose(chunks.M, chunks.E, plan)
    return out.index_copy(0, order, S)


def summaries_delta_rule_torch(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    kind: str,
    scale: float | None = None,
    cu_seqlens_cpu: Tensor | None = None,
    live: int | None = None,
) -> Tensor:
    """The states-only pass: ``[N, HV, K, V + K]`` summaries ``[E | M]`` of every packed sequence
    (``prepare_delta_rule_torch``, then ``compose_chunk_maps``; no query scores, no outputs),
    differentiable by plain autograd for any cotangent. What the compiled path's summaries
    custom op runs (``custom_ops.delta_rule_summaries_torch_op``). ``live``: only the first
    ``live`` sequences are computed (their tokens alone are read); the rest get the identity
    (the routing's padding sequences under caps)."""
    cu = host_cu_seqlens(q.shape[1], None, cu_seqlens_cpu)
    n = len(cu) - 1
    live = n if live is None else live
    end = cu[live]
    q, k, v, g, beta = (x[:, :end] for x in (q, k, v, g, beta))
    cu_live = torch.tensor(cu[: live + 1], dtype=torch.int64)
    chunks = prepare_delta_rule_torch(
        q, k, v, g, beta, kind=kind, scale=scale, cu_seqlens_cpu=cu_live
    )
    rows = list(range(live)) + [-1] * (n - live)
    return compose_chunk_maps(chunks, rows, entry_backward=False)


def chunk_delta_rule_torch(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    kind: str,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Tensor | None = None,
    cu_seqlens_cpu: Tensor | None = None,
    chunk_size: int = 64,
    sub_chunk_size: int = 8,
) -> tuple[Tensor, Tensor | None]:
    """Chunked KDA / GDN forward (autograd gives the backward): ``prepare_delta_rule_torch``
    then ``local_delta_rule_torch``.

    Args:
        q, k: ``[1, T, H, K]``; v: ``[1, T, HV, V]`` with HV a multiple of H (GVA).
        g: natural-log decay (≤ 0), ``[1, T, HV, K]`` for kind="kda", ``[1, T, HV]`` for "gdn".
        beta: ``[1, T, HV]``.
        scale: query scale, default ``K ** -0.5``.
        initial_state: ``[N, HV, K, V]`` entry state of every sequence (zeros when None).
        cu_seqlens / cu_seqlens_cpu: ``[N+1]`` sequence offsets: the host copy gives the sizes,
            the device copy the chunk tables (``common.varlen.chunk_layout``).
        chunk_size: tokens per chunk; ``sub_chunk_size`` (KDA only) must divide it, otherwise
            the whole chunk is one sub-block.

    Returns:
        ``(o [1, T, HV, V] in v's dtype, final [N, HV, K, V] or None)``: the final states (when
        ``output_final_state``) in the compute dtype (float64 for float64 inputs, else
        float32). Zero-length sequences return their initial state.
    """
    chunks = prepare_delta_rule_torch(
        q,
        k,
        v,
        g,
        beta,
        kind=kind,
        scale=scale,
        cu_seqlens=cu_seqlens,
        cu_seqlens_cpu=cu_seqlens_cpu,
        chunk_size=chunk_size,
        sub_chunk_size=sub_chunk_size,
    )
    return local_delta_rule_torch(chunks, initial_state, output_final_state)
