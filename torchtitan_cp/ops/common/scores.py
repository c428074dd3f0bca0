"""Masked decay scores of the chunked pure-PyTorch kernels (delta rule, SSD).

Every exponent is masked to ``-inf`` before ``exp`` where the pair is not causal, so only
``exp(x)`` with ``x <= 0`` is evaluated: strong gates underflow to zero instead of overflowing.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["causal_mask", "gdn_scores"]


def causal_mask(n: int, strict: bool, device: torch.device) -> Tensor:
    """[n, n] bool, True where column s may feed row t (s < t, or s <= t)."""
    return torch.ones(n, n, dtype=torch.bool, device=device).tril(-1 if strict else 0)


def gdn_scores(a: Tensor, b: Tensor, G: Tensor) -> Tensor:
    """``[x, ..., t, s] = (a[x]_t · b_s) exp(G_t - G_s)`` for s <= t, zero above the diagonal.

    a ``[X, ..., C, K]`` (a stack of X operands sharing the decays), b ``[..., C, K]``;
    G ``[..., C]`` cumulative log gate (scalar per token).
    """
    C = a.shape[-2]
    keep = causal_mask(C, False, a.device)
    # Mask before exp: above the diagonal G_t - G_s > 0 and could overflow.
    decay = torch.exp((G[..., :, None] - G[..., None, :]).masked_fill(~keep, -math.inf))
    return (a @ b.transpose(-1, -2)) * decay
