"""Varlen causal depthwise convolution in plain PyTorch (autograd backward)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .utils import host_cu_seqlens, seq_ids_and_positions

__all__ = ["causal_conv1d_torch"]


def causal_conv1d_torch(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    *,
    cu_seqlens: Tensor | None = None,
    cu_seqlens_cpu: Tensor | None = None,
    initial_state: Tensor | None = None,
    activation: str | None = "silu",
) -> Tensor:
    """``y_t = act(bias + sum_i weight[:, i] * x_{t - (W-1) + i})`` within every sequence.

    Args:
        x: ``[1, T, D]``.
        weight: ``[D, W]``; column ``W-1`` multiplies the current token.
        bias: ``[D]`` or None.
        cu_seqlens / cu_seqlens_cpu: ``[N+1]`` sequence offsets (host copy preferred).
        initial_state: ``[N, D, W-1]``, the W-1 tokens before each sequence, oldest first;
            zeros (no history) when None.
        activation: "silu" (alias "swish") or None.

    Returns:
        ``[1, T, D]`` in x's dtype.

    Vectorised as W shifted gathers from one source buffer ``[x; history; 0]``: token t's tap at
    distance s reads x[t-s] when it lies in the same sequence, else the matching history column
    (or the zero row), so no Python loop over sequences is needed.
    """
    if activation not in ("silu", "swish", None):
        raise ValueError(f"activation must be 'silu' or None, got {activation!r}")
    T, D = x.shape[1:]
    W = weight.shape[1]
    cu = host_cu_seqlens(T, cu_seqlens, cu_seqlens_cpu)
    N = len(cu) - 1
    dev = x.device
    seq, pos = seq_ids_and_positions(cu)

    parts = [x[0]]
    if initial_state is not None and W > 1:
        # [N, D, W-1] -> rows (n, j) of a [N*(W-1), D] block, j = 0 oldest.
        parts.append(initial_state.to(x.dtype).transpose(1, 2).reshape(N * (W - 1), D))
    zero_row = T + (N * (W - 1) if len(parts) == 2 else 0)
    parts.append(x.new_zeros(1, D))
    src = torch.cat(parts, 0)

    y = x[0] * weight[:, W - 1]
    for s in range(1, W):
        inside = pos >= s
        idx = torch.arange(T) - s
        if initial_state is not None:
            # Position pos - s < 0 is history column (W-1) + (pos - s) of this sequence.
            hist = T + seq * (W - 1) + (W - 1) + (pos - s)
            idx = torch.where(inside, idx, hist)
        else:
            idx = torch.where(inside, idx, torch.full_like(idx, zero_row))
        y = y + src[idx.to(dev)] * weight[:, W - 1 - s]
    if bias is not None:
        y = y + bias
    if activation is not None:
        y = F.silu(y)
    return y.unsqueeze(0)
