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
  ``o = (scale q * exp(G)) S0 + Aqk d``.
* Gates stay in log space relative to the chunk (or a sub-block of it), and every exponent is
  masked to ``-inf`` before ``exp`` where the pair is not causal, so only ``exp(x)`` with
  ``x <= 0`` is ever evaluated: strong gates underflow to zero instead of overflowing, in the
  forward and in the backward pass.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..common.dtypes import compute_dtype
from ..common.scores import causal_mask, gdn_scores
from ..common.varlen import chunk_layout, entry_states

__all__ = ["chunk_delta_rule_torch"]


def _kda_scores(a: Tensor, b: Tensor, G: Tensor, sub: int) -> Tensor:
    """``[x, ..., t, s] = sum_c a[x]_t[c] b_s[c] exp(G_t[c] - G_s[c])`` for s <= t, else 0.

    a ``[X, ..., C, K]`` (a stack of X operands sharing the decays, e.g. q and k), b and G
    ``[..., C, K]`` (G cumulative log gate per channel); ``sub`` divides C.

    A pairwise ``[C, C, K]`` decay tensor would be exact but large, and the factorisation
    ``exp(G_t) * exp(-G_s)`` overflows for strong gates. So the chunk is split into sub-blocks of
    ``sub`` tokens: for t in block i and s in an earlier block, ``exp(G_t - G_s)`` factors through
    the log gate R_i just before block i as ``exp(G_t - R_i) * exp(R_i - G_s)``, both factors
    ≤ 1 (a matmul); only the ``sub × sub`` diagonal blocks use the pairwise tensor.
    """
    C, K = b.shape[-2:]
    n = C // sub
    lead = a.shape[:-2]
    dev = a.device
    Gb = G.unflatten(-2, (n, sub))  # [..., n, sub, K]
    # R_i: cumulative log gate just before block i (0 before the chunk).
    ref = torch.cat([torch.zeros_like(Gb[..., :1, -1, :]), Gb[..., :-1, -1, :]], -2)

    # Off-diagonal blocks. Row factor exp(G_t - R_i) <= 1 for t in block i; one per token, so
    # the stacked operands a need no per-block copies.
    left = a.unflatten(-2, (n, sub)) * torch.exp(Gb - ref.unsqueeze(-2))  # [X, ..., n, sub, K]
    # Column factor exp(R_i - G_s) only for s in a block before i; -inf elsewhere so exp gives 0
    # (and a zero gradient) instead of a possibly huge number.
    earlier = torch.arange(C, device=dev)[None, :] // sub < torch.arange(n, device=dev)[:, None]
    right_exp = (ref.unsqueeze(-2) - G.unsqueeze(-3)).masked_fill(~earlier[:, :, None], -math.inf)
    right = b.unsqueeze(-3) * torch.exp(right_exp)  # [..., n(i), C(s), K]
    off = (left @ right.transpose(-1, -2)).reshape(*lead, C, C)  # row index i*sub + t

    # Diagonal blocks: pairwise decay within a block, masked before exp.
    keep = causal_mask(sub, False, dev)
    diff = Gb.unsqueeze(-2) - Gb.unsqueeze(-3)  # [..., n, sub(t), sub(s), K]
    decay = torch.exp(diff.masked_fill(~keep[..., None], -math.inf))
    bd = b.unflatten(-2, (n, sub)).unsqueeze(-3) * decay  # b_s exp(G_t - G_s), [..., n, t, s, K]
    # One [X, K] x [K, sub] product per row t (einsum avoids expanding bd over X).
    diag = torch.einsum("x...tk,...tsk->x...ts", a.unflatten(-2, (n, sub)), bd)
    # Scatter the n diagonal blocks into [C, C]: diag_embed puts block j at (j, j).
    blocks = torch.diag_embed(diag.movedim(-3, -1))  # [X, ..., sub(t), sub(s), n, n]
    blocks = blocks.permute(*range(len(lead)), -2, -4, -1, -3).reshape(*lead, C, C)
    return off + blocks


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
    states_only: bool = False,
) -> tuple[Tensor | None, Tensor | None]:
    """Chunked KDA / GDN forward (autograd gives the backward).

    Args:
        q, k: ``[1, T, H, K]``; v: ``[1, T, HV, V]`` with HV a multiple of H (GVA).
        g: natural-log decay (≤ 0), ``[1, T, HV, K]`` for kind="kda", ``[1, T, HV]`` for "gdn".
        beta: ``[1, T, HV]``.
        scale: query scale, default ``K ** -0.5``.
        initial_state: ``[N, HV, K, V]`` entry state of every sequence (zeros when None).
        cu_seqlens / cu_seqlens_cpu: ``[N+1]`` sequence offsets (host copy preferred).
        chunk_size: tokens per chunk; ``sub_chunk_size`` (KDA only) must divide it, otherwise
            the whole chunk is one sub-block.
        states_only: return ``(None, final)`` without computing any output (no query
            products, no per-chunk entry states kept): the CP summary pass.

    Returns:
        ``(o [1, T, HV, V] in v's dtype or None, final [N, HV, K, V] or None)``: the final
        states (when ``output_final_state`` or ``states_only``) in the compute dtype (float64
        for float64 inputs, else float32). Zero-length sequences return their initial state.
    """
    if kind not in ("kda", "gdn"):
        raise ValueError(f"kind must be 'kda' or 'gdn', got {kind!r}")
    T, H, K = q.shape[1:]
    HV, V = v.shape[2:]
    scale = K**-0.5 if scale is None else scale
    cd = compute_dtype(q.dtype)
    dev = q.device
    C = chunk_size
    sub = sub_chunk_size if (sub_chunk_size and C % sub_chunk_size == 0) else C
    cu, state0 = entry_states(q, v, cu_seqlens, cu_seqlens_cpu, initial_state)
    output_final_state = output_final_state or states_only
    if T == 0:
        o = None if states_only else v.new_zeros(1, 0, HV, V)
        return o, (state0.clone() if output_final_state else None)

    lay = chunk_layout(cu, C)
    rep = HV // H
    qc = lay.pack(q, cd).repeat_interleave(rep, dim=1) * scale  # [NC, HV, C, K]
    kc = lay.pack(k, cd).repeat_interleave(rep, dim=1)
    vc = lay.pack(v, cd)  # [NC, HV, C, V]
    bc = lay.pack(beta, cd)  # [NC, HV, C]
    G = lay.pack(g, cd).cumsum(2)  # cumulative log gate inside the chunk, <= 0
    # States only: the query never enters (no q products, no Aqk scores).
    ops = kc.unsqueeze(0) if states_only else torch.stack([qc, kc])
    if kind == "kda":
        Gl = G[:, :, -1, :]  # [NC, HV, K] log gate over the whole chunk
        decay_end = torch.exp(Gl.unsqueeze(-2) - G)  # exp(G_C - G_t) <= 1
        eG = torch.exp(G)
        *Aqk, A = _kda_scores(ops, kc, G, sub=sub)
    else:
        Gl = G[:, :, -1]  # [NC, HV]
        decay_end = torch.exp(Gl.unsqueeze(-1) - G).unsqueeze(-1)
        eG = torch.exp(G).unsqueeze(-1)
        *Aqk, A = gdn_scores(ops, kc, G)
    kg = kc * eG

    # WY form: (I + beta*A) d = beta*v - beta*(k*exp(G)) S0  =>  d = U - W S0.
    b = bc.unsqueeze(-1)
    A = b * A  # only its strictly lower part is read: the solve assumes a unit diagonal
    rhs = torch.cat([b * vc, b * kg], -1)  # one solve for both right-hand sides
    U, W = torch.linalg.solve_triangular(A, rhs, upper=False, unitriangular=True).split([V, K], -1)

    # Chunk as an affine map of its entry state: S_end = M S0 + E.
    kh = kc * decay_end  # k_t exp(G_C - G_t)
    khT = kh.transpose(-1, -2)
    if kind == "kda":
        M = torch.diag_embed(torch.exp(Gl)) - khT @ W  # [NC, HV, K, K]
    else:
        eye = torch.eye(K, dtype=cd, device=dev)
        M = torch.exp(Gl)[..., None, None] * eye - khT @ W
    E = khT @ U  # [NC, HV, K, V]

    # Inter-chunk recurrence S <- M S + E, and every chunk's entry state S0 [NC, HV, K, V].
    final, S0 = lay.scan(M, E, state0, torch.matmul, entries=not states_only)
    if states_only:
        return None, final
    assert S0 is not None
    d = U - W @ S0
    oc = (qc * eG) @ S0 + Aqk[0] @ d  # [NC, HV, C, V]
    return lay.unpack(oc).to(v.dtype), (final if output_final_state else None)
