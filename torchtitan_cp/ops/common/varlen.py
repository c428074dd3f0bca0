"""Host-side varlen bookkeeping shared by the pure-PyTorch kernels: offsets as ints, per-token
sequence ids, and the packing of every sequence into whole chunks."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from .dtypes import compute_dtype


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


def entry_states(q: Tensor, v: Tensor, num_seqs: int, initial_state: Tensor | None) -> Tensor:
    """Every sequence's entry state ``[N, HV, K, V]`` in the compute dtype, for a chunked kernel
    over ``q [1, T, H, K]`` and ``v [1, T, HV, V]``: ``initial_state`` cast, or zeros when None."""
    cd = compute_dtype(q.dtype)
    if initial_state is not None:
        return initial_state.to(cd)
    HV, V = v.shape[2:]
    return torch.zeros(num_seqs, HV, q.shape[3], V, dtype=cd, device=q.device)


def seq_ids_and_positions(cu: list[int]) -> tuple[Tensor, Tensor]:
    """For every token of the stream: its sequence index and its position within that sequence.

    Returns two int64 CPU tensors of length ``cu[-1]``.
    """
    offsets = torch.tensor(cu, dtype=torch.int64)
    lengths = offsets[1:] - offsets[:-1]
    seq = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    pos = torch.arange(cu[-1], dtype=torch.int64) - offsets[:-1][seq]
    return seq, pos


class ChunkLayout(NamedTuple):
    """Host-side index tables that pack every sequence into whole chunks (int64 CPU tensors),
    and the three steps every chunked torch kernel takes with them: ``pack`` its inputs, ``scan``
    the state through each sequence's chunks, ``unpack`` its outputs.

    chunk_size: C tokens per chunk; num_chunks: NC over all sequences.
    src: ``[NC*C]`` token index of every packed slot (``T`` = the zero padding row).
    dst: ``[T]`` packed slot of every token.
    order: sequences sorted by chunk count, descending, so the sequences still running at chunk
        position p are a prefix of this order; inv_order undoes it.
    steps: number of sequences still running at every chunk position (Python ints).
    perm: ``[NC]`` packed chunk ids in loop order (position 0 of every running sequence, then
        position 1, ...); inv_perm undoes it.
    """

    chunk_size: int
    num_chunks: int
    src: Tensor
    dst: Tensor
    order: Tensor
    inv_order: Tensor
    steps: list[int]
    perm: Tensor
    inv_perm: Tensor

    def pack(self, x: Tensor, dtype: torch.dtype) -> Tensor:
        """``[1, T, Hx, ...]`` -> ``[NC, Hx, C, ...]`` in ``dtype``, padding with zeros."""
        x = x[0].to(dtype)
        x = torch.cat([x, x.new_zeros(1, *x.shape[1:])], 0)[self.src.to(x.device)]
        return x.unflatten(0, (self.num_chunks, self.chunk_size)).movedim(1, 2)

    def unpack(self, y: Tensor) -> Tensor:
        """``[NC, Hx, C, ...]`` per-chunk outputs -> ``[1, T, Hx, ...]`` per token."""
        return y.movedim(1, 2).flatten(0, 1)[self.dst.to(y.device)].unsqueeze(0)

    def scan(
        self,
        M: Tensor,
        E: Tensor,
        state0: Tensor,
        apply: Callable[[Tensor, Tensor], Tensor],
        entries: bool,
    ) -> tuple[Tensor, Tensor | None]:
        """Carry the states ``state0 [N, ...]`` through every sequence's chunks in order,
        ``S <- apply(M_c, S) + E_c`` with chunk c's affine map ``M [NC, ...]``, ``E [NC, ...]``:
        one step per chunk position, the sequences still running at once.

        Returns ``(final [N, ...], entry [NC, ...] or None)``: every sequence's final state and,
        with ``entries``, the entry state of every packed chunk."""
        dev = state0.device
        perm = self.perm.to(dev)
        Ms, Es = M[perm], E[perm]
        S = state0[self.order.to(dev)]
        kept: list[Tensor] = []
        start = 0
        for a in self.steps:
            S_a = S[:a]
            if entries:
                kept.append(S_a)
            S_new = apply(Ms[start : start + a], S_a) + Es[start : start + a]
            S = torch.cat([S_new, S[a:]], 0) if a < S.shape[0] else S_new
            start += a
        final = S[self.inv_order.to(dev)]
        return final, (torch.cat(kept, 0)[self.inv_perm.to(dev)] if entries else None)


def chunk_layout(cu: list[int], C: int) -> ChunkLayout:
    """The packing of the sequences of offsets ``cu`` into chunks of ``C`` tokens."""
    T = cu[-1]
    lengths = torch.tensor(cu[1:]) - torch.tensor(cu[:-1])
    nch = (lengths + C - 1) // C  # chunks per sequence (0 for an empty one)
    first_chunk = torch.cumsum(nch, 0) - nch
    NC = int(nch.sum())
    seq, pos = seq_ids_and_positions(cu)
    dst = first_chunk[seq] * C + pos
    src = torch.full((NC * C,), T, dtype=torch.int64)
    src[dst] = torch.arange(T)
    order = torch.argsort(nch, descending=True, stable=True)
    nch_sorted = nch[order]
    steps = [int((nch_sorted > p).sum()) for p in range(int(nch.max()))]
    perm = torch.cat([first_chunk[order[:a]] + p for p, a in enumerate(steps)] or [src[:0]])
    inv_order, inv_perm = torch.argsort(order), torch.argsort(perm)
    return ChunkLayout(C, NC, src, dst, order, inv_order, steps, perm, inv_perm)
