"""Chunk metadata of varlen offsets, built on the host (torch only).

The chunked delta-rule kernels and the Triton causal conv launch one program per chunk of
``chunk_size`` tokens of each sequence. Their library builds that chunk table from
``cu_seqlens`` on every call (on the host, then a blocking copy); the routing plan builds it
here instead and ships it with the rest of ``DeviceRouting`` (docs/kernels.md, "Precomputed
kernel metadata"). ``chunk_size`` is a parameter: routing/ does not import the kernel library.

``device_chunk_tables`` builds the same tables on the offsets' own device, padded to a row count
the caller fixes from shapes (``chunk_bound``): a stream the routing has no host tables for,
such as a kernel's stream of several steps per token (``SequenceTables.expanded`` in
``ops.cp``), then costs no host read and keeps one shape under ``torch.compile``.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["chunk_bound", "chunk_indices", "chunk_offsets", "chunk_tables", "device_chunk_tables"]


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


def device_chunk_tables(cu_seqlens: Tensor, chunk_size: int, rows: int) -> tuple[Tensor, Tensor]:
    """:func:`chunk_tables` of ``cu_seqlens [N + 1]`` built on its device, with no host read.

    ``chunk_indices`` is ``[rows, 2]`` int32: the first NT rows equal the host table's, the
    rest are ``(-1, -1)`` padding (as ``DeviceRouting``'s with caps); ``chunk_offsets [N + 1]``
    int64. ``rows`` must be at least NT (``chunk_bound`` of the stream's token count and N is):
    the offsets are not read, so a smaller ``rows`` would cut the table.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError(f"cu_seqlens must be 1-D with >= 1 entry, got {list(cu_seqlens.shape)}")
    cu = cu_seqlens.to(torch.int64)
    counts = torch.div(cu[1:] - cu[:-1] + (chunk_size - 1), chunk_size, rounding_mode="floor")
    offsets = torch.cat([cu.new_zeros(1), torch.cumsum(counts, 0)])
    row = torch.arange(rows, device=cu.device)
    # Row j belongs to the sequence n with offsets[n] <= j < offsets[n + 1] (empty ones own none).
    seq = torch.searchsorted(offsets[1:], row, right=True)
    within = row - offsets.index_select(0, seq.clamp(max=max(counts.numel() - 1, 0)))
    table = torch.stack([seq, within], dim=1)
    table = torch.where((seq < counts.numel()).unsqueeze(1), table, torch.full_like(table, -1))
    return table.to(torch.int32), offsets
