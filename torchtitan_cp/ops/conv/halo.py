"""Context-parallel history for the short causal convolution (multi-hop halo exchange).

A width-W causal conv needs the W-1 = C tokens before each token in the same document. Only a
fragment's first subsequence can miss them locally. Each rank publishes the last C tokens of
each of its fragments, one all-gather shares them, and ``routing.halo_index`` picks, for each
fragment start, the C tokens before it - possibly from several earlier fragments on several
ranks when fragments are shorter than C (the routing plan resolves those hops).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor

if TYPE_CHECKING:
    from torchtitan_cp.routing import DeviceRouting

from ..cp.collectives import all_gather_autograd, check_routing_group

__all__ = ["context_parallel_conv_history"]


def _masked_rows(src: Tensor, index: Tensor) -> Tensor:
    # Rows of src [R, D] at index [...] (-1 -> zero row), differentiable in src.
    if src.shape[0] == 0:  # a rank without tokens: all -1, but stay in src's autograd graph
        return src.new_zeros(*index.shape, src.shape[-1]) + src.sum()
    rows = src.index_select(0, index.reshape(-1).clamp(min=0)).view(*index.shape, src.shape[-1])
    return torch.where((index >= 0).unsqueeze(-1), rows, torch.zeros_like(rows))


def context_parallel_conv_history(
    x: Tensor, *, routing: DeviceRouting, group: dist.ProcessGroup | None
) -> Tensor:
    """Conv ``initial_state`` for every local subsequence under context parallelism.

    ``x [1, T_local, D]`` is the conv input of this rank's span. Returns ``[N, D, C]``
    (N = local subsequences, C = ``routing.conv_history`` = W-1, oldest token first): the C
    tokens preceding each fragment's first subsequence within its document, zero where the
    document starts inside that window, and zeros for every other subsequence. Pass it as
    ``causal_conv1d(..., initial_state=...)``. Differentiable; the gradient of the borrowed
    tokens is reduce-scattered back to the ranks that own them. One collective per call of
    ``W_cp * S * C * D`` elements in x's dtype.
    """
    check_routing_group(routing, group, x.shape[1])
    C = routing.conv_history
    D = x.shape[-1]
    N = routing.cu_seqlens.numel() - 1
    if C == 0:
        return x.new_zeros(N, D, 0)
    # [S, C, D]: last C tokens of each local fragment, right-aligned, zero-padded.
    tails = _masked_rows(x[0], routing.tail_index)
    flat = all_gather_autograd(tails, group).reshape(-1, D)  # [W*S*C, D], (r, s, c) order
    hist = _masked_rows(flat, routing.halo_index)  # [S, C, D]
    first = routing.frag_first
    target = torch.where(first >= 0, first, torch.full_like(first, N))  # row N = discard
    out = x.new_zeros(N + 1, C, D).index_add(0, target, hist)[:N]
    return out.transpose(1, 2)  # [N, D, C]
