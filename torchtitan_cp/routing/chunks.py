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

__all__ = ["chunk_bound", "chunk_indices", "chunk_offsets", "chunk_tables"]


def chunk_bound(num_tokens: int, num_seqs: int, chunk_size: int) -> int:
    """Most chunks ``num_seqs`` sequences of ``num_tokens`` tokens in all can have:
    ``ceil(num_tokens / chunk_size) + num_seqs`` (each sequence adds at most one partial chunk).
    With caps, ``DeviceRouting`` pads its chunk tables to this many rows (a fixed shape)."""
    return -(-num_tokens // chunk_size) + num_seqs


def chunk_tables(cu_seqlens: Tensor, chunk_size: int) -> tuple[Tensor, Tensor]:
    """``(chunk_indices [NT, 2] int32, chunk_offsets [N + 1] int64)`` of host offsets ``[N + 1]``.

    Row ``j`` of ``chunk_indices`` is ``(sequence, chunk within that sequence)`` of the ``j``-th
    chunk in token order; ``chunk_offsets[n]`` is sequence ``n``'s first row, ``[N]`` = NT =
    ``sum(ceil(len_n / chunk_size))``. Zero-length sequences own no chunk.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError(f"cu_seqlens must be 1-D with >= 1 entry, got {list(cu_seqlens.shape)}")
    lens = cu_seqlens[1:].to(torch.int64) - cu_seqlens[:-1]
    counts = torch.div(lens + (chunk_size - 1), chunk_size, rounding_mode="floor")
    offsets = torch.zeros(counts.numel() + 1, dtype=torch.int64)
    torch.cumsum(counts, 0, out=offsets[1:])
    seq = torch.repeat_interleave(counts)  # n repeated counts[n] times
    within = torch.arange(seq.numel(), dtype=torch.int64) - offsets[seq]
    return torch.stack([seq, within], dim=1).to(torch.int32), offsets


def chunk_indices(cu_seqlens: Tensor, chunk_size: int) -> Tensor:
    """``[NT, 2]`` int32 ``(sequence, chunk within it)`` rows; see :func:`chunk_tables`."""
    return chunk_tables(cu_seqlens, chunk_size)[0]


def chunk_offsets(cu_seqlens: Tensor, chunk_size: int) -> Tensor:
    """``[N + 1]`` int64 first chunk row of each sequence, then NT; see :func:`chunk_tables`."""
    return chunk_tables(cu_seqlens, chunk_size)[1]
