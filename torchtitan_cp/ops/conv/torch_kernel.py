"""Varlen causal depthwise convolution in plain PyTorch (autograd backward)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..common.dtypes import compute_dtype
from ..common.varlen import device_offsets, host_cu_seqlens, token_sequences

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
        cu_seqlens / cu_seqlens_cpu: ``[N+1]`` sequence offsets: the host copy gives the sizes,
            the device copy (on x's device) the gather index; either alone works (a device
            copy alone is read back once, a host copy alone is shipped without waiting).
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
    # Accumulate the W taps in float32 (float64 for float64 inputs), like FLA's kernel.
    cd = compute_dtype(x.dtype)
    dev = x.device
    seq, pos = token_sequences(device_offsets(cu, cu_seqlens, dev), T)

    # Source rows: the T tokens, then (if given) the N*(W-1) history tokens, then one zero row.
    parts = [x[0].to(cd)]
    with_hist = initial_state is not None and W > 1
    if with_hist:
        # [N, D, W-1] -> row T + n*(W-1) + j holds history token j (0 = oldest) of sequence n.
        parts.append(initial_state.to(cd).transpose(1, 2).reshape(N * (W - 1), D))
    zero_row = T + (N * (W - 1) if with_hist else 0)
    parts.append(x.new_zeros(1, D, dtype=cd))
    src = torch.cat(parts, 0)

    # Gather index of the tap at distance s (s = 1..W-1) for every token, built on the device
    # from the offsets there (no host-built table to copy).
    shift = torch.arange(1, W, device=dev)[:, None]  # [W-1, 1]
    back = pos[None, :] - shift  # position of the tapped token inside its sequence
    if with_hist:
        outside = T + seq[None, :] * (W - 1) + (W - 1) + back  # history column (W-1) + back
    else:
        outside = torch.full_like(back, zero_row)
    idx = torch.where(back >= 0, torch.arange(T, device=dev)[None, :] - shift, outside)

    w = weight.to(cd)
    y = src[:T] * w[:, W - 1]
    for s in range(1, W):
        y = y + src[idx[s - 1]] * w[:, W - 1 - s]
    if bias is not None:
        y = y + bias.to(cd)
    if activation is not None:
        y = F.silu(y)
    return y.unsqueeze(0).to(x.dtype)
