"""Masked decay scores of the chunked pure-PyTorch kernels (delta rule, SSD), for both gate
shapes: one log decay per head and token (GDN, SSD: ``head_decay_scores``) or one per key
channel (KDA: ``key_decay_scores``); ``decay_scores`` picks by the gate's shape.

Every exponent is masked to ``-inf`` before ``exp`` where the pair is not causal, so only
``exp(x)`` with ``x <= 0`` is evaluated: strong gates underflow to zero instead of overflowing.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["causal_mask", "decay_scores", "head_decay_scores", "key_decay_scores"]


def causal_mask(n: int, strict: bool, device: torch.device) -> Tensor:
    """[n, n] bool, True where column s may feed row t (s < t, or s <= t)."""
    return torch.ones(n, n, dtype=torch.bool, device=device).tril(-1 if strict else 0)


def head_decay_scores(a: Tensor, b: Tensor, G: Tensor) -> Tensor:
    """A gate per head (GDN, SSD): ``[x, ..., t, s] = (a[x]_t · b_s) exp(G_t - G_s)`` for
    s <= t, zero above the diagonal.

    a ``[X, ..., C, K]`` (a stack of X operands sharing the decays), b ``[..., C, K]``;
    G ``[..., C]`` cumulative log gate (scalar per token).
    """
    C = a.shape[-2]
    keep = causal_mask(C, False, a.device)
    # Mask before exp: above the diagonal G_t - G_s > 0 and could overflow.
    decay = torch.exp((G[..., :, None] - G[..., None, :]).masked_fill(~keep, -math.inf))
    return (a @ b.transpose(-1, -2)) * decay


def key_decay_scores(a: Tensor, b: Tensor, G: Tensor, sub: int) -> Tensor:
    """A gate per key (KDA, GLA): ``[x, ..., t, s] = sum_c a[x]_t[c] b_s[c] exp(G_t[c] - G_s[c])``
    for s <= t, else 0.

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


def decay_scores(a: Tensor, b: Tensor, G: Tensor, sub: int) -> Tensor:
    """``key_decay_scores`` when G is ``[..., C, K]`` like b, ``head_decay_scores`` when it is
    ``[..., C]`` (``sub``, the sub-block size, serves the per-key case only)."""
    if G.dim() == b.dim():
        return key_decay_scores(a, b, G, sub)
    return head_decay_scores(a, b, G)
