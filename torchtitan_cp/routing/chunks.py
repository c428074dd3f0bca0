"""Chunk metadata of varlen offsets, built on the host (torch only).

The chunked delta-rule kernels and the Triton causal conv launch one program per chunk of
``chunk_size`` tokens of each sequence. Their library builds that chunk table from
``cu_seqlens`` on every call (on the host, then a blocking copy); the routing plan builds it
here instead and ships it with the rest of ``DeviceRouting`` (docs/kernels.md, "Precomputed
kernel metadata"). ``chunk_size`` is a parameter: routing/ does not import the kernel library.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["chunk_indices", "chunk_offsets"]


def _chunk_counts(cu_seqlens: Tensor, chunk_size: int) -> Tensor:
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError(f"cu_seqlens must be 1-D with >= 1 entry, got {list(cu_seqlens.shape)}")
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.int64)
    return torch.div(lens + (chunk_size - 1), chunk_size, rounding_mode="floor")


def chunk_offsets(cu_seqlens: Tensor, chunk_size: int) -> Tensor:
    """``[N + 1]`` int64: index of each sequence's first chunk in the chunk table, then the total.

    ``cu_seqlens`` is ``[N + 1]`` host offsets (tokens); zero-length sequences own no chunk.
    """
    counts = _chunk_counts(cu_seqlens, chunk_size)
    out = torch.zeros(counts.numel() + 1, dtype=torch.int64)
    torch.cumsum(counts, 0, out=out[1:])
    return out


def chunk_indices(cu_seqlens: Tensor, chunk_size: int) -> Tensor:
    """``[NT, 2]`` int32: ``(sequence, chunk within that sequence)`` for every chunk, in order.

    ``NT = sum(ceil(len_i / chunk_size))``; ``cu_seqlens`` is ``[N + 1]`` host offsets.
    """
    counts = _chunk_counts(cu_seqlens, chunk_size)
    first = chunk_offsets(cu_seqlens, chunk_size)
    total = int(first[-1])
    seq = torch.repeat_interleave(torch.arange(counts.numel(), dtype=torch.int64), counts)
    within = torch.arange(total, dtype=torch.int64) - first[:-1][seq]
    return torch.stack([seq, within], dim=1).to(torch.int32)
