"""Varlen bookkeeping shared by the pure-PyTorch kernels: offsets as host ints, per-token
sequence ids, and the packing of every sequence into whole chunks.

Sizes come from the host offsets (Python ints); every index table a kernel applies to device
tensors is built on the device from the device copy of the same offsets (the routing's
``cu_seqlens``, shipped once per microbatch): no host-built table is copied to the device and no
device value is read back, so the kernels never make the host wait (docs/kernels.md, "No host
sync in the torch kernels")."""

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


def ship(values: list[int], device: torch.device) -> Tensor:
    """Host ints as an int64 tensor on ``device`` without making the host wait: on CUDA pinned
    and copied ``non_blocking`` (the caching host allocator keeps the pinned block until the
    copy has run); on the CPU the host tensor itself. For callers that bring no device copy of
    what they index with; the routing brings its own (``DeviceRouting``, one copy per
    microbatch)."""
    t = torch.tensor(values, dtype=torch.int64)
    if device.type == "cpu":
        return t
    if device.type == "cuda":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def device_offsets(cu: list[int], cu_seqlens: Tensor | None, device: torch.device) -> Tensor:
    """The offsets ``cu`` on ``device``: ``cu_seqlens`` itself when it is there already (the
    routing's ``cu_seqlens``: no copy), else ``ship(cu)``."""
    if cu_seqlens is not None and cu_seqlens.device == device:
        return cu_seqlens
    return ship(cu, device)


def token_sequences(offsets: Tensor, num_tokens: int) -> tuple[Tensor, Tensor]:
    """For every token of the stream: its sequence index and its position within that
    sequence, built on ``offsets``' device from ``offsets [N+1]`` and the host count
    ``num_tokens`` (sizes from the host: nothing is read back). Two int64 tensors ``[T]``."""
    off = offsets.to(torch.int64)
    tok = torch.arange(num_tokens, dtype=torch.int64, device=off.device)
    # Sequence n holds the tokens in [off[n], off[n+1]): the ends at or before t count the
    # sequences before t's (zero-length ones included).
    seq = torch.searchsorted(off[1:].contiguous(), tok, right=True)
    return seq, tok - off[seq]


class ChunkLayout(NamedTuple):
    """Index tables that pack every sequence into whole chunks (int64 tensors on the kernel's
    device, built there by ``chunk_layout``), and the three steps every chunked torch kernel
    takes with them: ``pack`` its inputs, ``scan`` the state through each sequence's chunks,
    ``unpack`` its outputs.

    chunk_size: C tokens per chunk; num_chunks: NC over all sequences.
    src: ``[NC*C]`` token index of every packed slot (``T`` = the zero padding row).
    dst: ``[T]`` packed slot of every token.
    order: sequences sorted by chunk count, descending, so the sequences still running at chunk
        position p are a prefix of this order; inv_order undoes it.
    steps: number of sequences still running at every chunk position (Python ints).
    perm: ``[NC]`` packed chunk ids in loop order (position 0 of every running sequence, then
        position 1, ...); inv_perm undoes it.
    first: ``[N]`` packed id of every sequence's first chunk; counts: ``[N]`` its chunks.
    chunks: ``[N]`` the same counts as Python ints (from the host offsets).
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
    first: Tensor
    counts: Tensor
    chunks: list[int]

    def pack(self, x: Tensor, dtype: torch.dtype) -> Tensor:
        """``[1, T, Hx, ...]`` -> ``[NC, Hx, C, ...]`` in ``dtype``, padding with zeros."""
        x = x[0].to(dtype)
        x = torch.cat([x, x.new_zeros(1, *x.shape[1:])], 0)[self.src]
        return x.unflatten(0, (self.num_chunks, self.chunk_size)).movedim(1, 2)

    def unpack(self, y: Tensor) -> Tensor:
        """``[NC, Hx, C, ...]`` per-chunk outputs -> ``[1, T, Hx, ...]`` per token."""
        return y.movedim(1, 2).flatten(0, 1)[self.dst].unsqueeze(0)

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
        Ms, Es = M[self.perm], E[self.perm]
        S = state0[self.order]
        kept: list[Tensor] = []
        start = 0
        for a in self.steps:
            S_a = S[:a]
            if entries:
                kept.append(S_a)
            S_new = apply(Ms[start : start + a], S_a) + Es[start : start + a]
            S = torch.cat([S_new, S[a:]], 0) if a < S.shape[0] else S_new
            start += a
        final = S[self.inv_order]
        return final, (torch.cat(kept, 0)[self.inv_perm] if entries else None)


def chunk_layout(cu: list[int], C: int, offsets: Tensor) -> ChunkLayout:
    """The packing of the sequences of host offsets ``cu`` into chunks of ``C`` tokens, its
    tables built on ``offsets``' device from ``offsets`` (the same offsets there, e.g. the
    routing's ``cu_seqlens``; ``device_offsets``) and host ints: sizes and the scan's steps come
    from ``cu``, every table from ``offsets``, so nothing is copied or read back."""
    T, N = cu[-1], len(cu) - 1
    chunks = [(b - a + C - 1) // C for a, b in zip(cu[:-1], cu[1:])]  # 0 for an empty one
    NC = sum(chunks)
    # steps[p]: the sequences with more than p chunks (a prefix of ``order``).
    ending = [0] * (max(chunks, default=0) + 1)
    for n in chunks:
        ending[n] += 1
    steps, running = [], N - ending[0]
    for p in range(len(ending) - 1):
        steps.append(running)
        running -= ending[p + 1]
    off = offsets.to(torch.int64)
    dev = off.device
    counts = torch.div(off[1:] - off[:-1] + (C - 1), C, rounding_mode="floor")
    ends = torch.cumsum(counts, 0)
    first = ends - counts
    chunk = torch.arange(NC, dtype=torch.int64, device=dev)
    chunk_seq = torch.searchsorted(ends, chunk, right=True)  # sequence of every packed chunk
    within = chunk - first[chunk_seq]  # its position inside that sequence
    slot_tok = (off[chunk_seq] + within * C).unsqueeze(1) + torch.arange(C, device=dev)
    src = torch.where(slot_tok < off[chunk_seq + 1].unsqueeze(1), slot_tok, T).reshape(-1)
    seq, pos = token_sequences(off, T)
    dst = first[seq] * C + pos
    order = torch.argsort(counts, descending=True, stable=True)
    inv_order = torch.argsort(order)
    # Loop order: by position inside the sequence, then by the sequence's place in ``order``.
    perm = torch.argsort(within * max(N, 1) + inv_order[chunk_seq])
    inv_perm = torch.argsort(perm)
    return ChunkLayout(
        C, NC, src, dst, order, inv_order, steps, perm, inv_perm, first, counts, chunks
    )
