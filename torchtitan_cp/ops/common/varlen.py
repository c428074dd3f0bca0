"""Host-side varlen bookkeeping shared by the pure-PyTorch kernels."""

from __future__ import annotations

import torch
from torch import Tensor


def host_cu_seqlens(
    total: int, cu_seqlens: Tensor | None, cu_seqlens_cpu: Tensor | None
) -> list[int]:
    """Sequence offsets as Python ints, preferring the host copy (no device→host sync).

    Without either tensor the whole stream ``[0, total)`` is one sequence.
    """
    if cu_seqlens_cpu is not None:
        cu = cu_seqlens_cpu.tolist()
    elif cu_seqlens is not None:
        # A device tensor here costs one sync; callers on CUDA should pass cu_seqlens_cpu.
        cu = cu_seqlens.tolist()
    else:
        return [0, total]
    return [int(c) for c in cu]


def seq_ids_and_positions(cu: list[int]) -> tuple[Tensor, Tensor]:
    """For every token of the stream: its sequence index and its position within that sequence.

    Returns two int64 CPU tensors of length ``cu[-1]``.
    """
    offsets = torch.tensor(cu, dtype=torch.int64)
    lengths = offsets[1:] - offsets[:-1]
    seq = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    pos = torch.arange(cu[-1], dtype=torch.int64) - offsets[:-1][seq]
    return seq, pos
