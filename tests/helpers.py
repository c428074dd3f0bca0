"""Batch and file builders shared by several test modules (in-process; no torchtitan)."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path

import torch


def fill_positions(bsz: int, seqlen: int, next_length: Callable[[], int]) -> torch.Tensor:
    """int64 ``[bsz, seqlen]`` positions: each row filled with documents of ``next_length()``
    tokens (called once per document, in row order), the last one cut at the row end."""
    pos = torch.empty(bsz, seqlen, dtype=torch.int64)
    for b in range(bsz):
        t = 0
        while t < seqlen:
            n = min(next_length(), seqlen - t)
            pos[b, t : t + n] = torch.arange(n)
            t += n
    return pos


def positions_from_lengths(bsz: int, seqlen: int, lengths: list[int]) -> torch.Tensor:
    """Rows filled with documents of the given lengths (cycled), cut at row ends."""
    it = itertools.count()
    return fill_positions(bsz, seqlen, lambda: lengths[next(it) % len(lengths)])


def random_batch(
    seed: int, bsz: int, seqlen: int, vocab: int, *, one_token_share: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokens ``[bsz, seqlen]``, positions of random documents (1 to seqlen // 2 - 1 tokens) and
    next-token labels. With ``one_token_share`` > 0 that share of documents is one token long and
    the others at least two."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (bsz, seqlen), generator=g)

    def next_length() -> int:
        if one_token_share and torch.rand((), generator=g) < one_token_share:
            return 1
        return int(torch.randint(2 if one_token_share else 1, seqlen // 2, (), generator=g))

    positions = fill_positions(bsz, seqlen, next_length)
    return tokens, positions, torch.roll(tokens, -1, dims=1)


def dense_document_block_mask(positions: torch.Tensor, block_size: int = 128):
    """The causal packed-document ``BlockMask`` ``[B, 1, L, L]`` of ``positions [B, L]``, built by
    flex's eager ``create_block_mask`` over all ``L x L`` token pairs: the oracle the PTRR
    balancer (which never builds it) is checked against, and torchtitan's ``cp_shard`` input."""
    from torch.nn.attention.flex_attention import create_block_mask

    from torchtitan_cp.routing import document_mask_mod, row_document_index

    bsz, seqlen = positions.shape
    return create_block_mask(
        document_mask_mod(row_document_index(positions)), bsz, None, seqlen, seqlen,
        device=positions.device, BLOCK_SIZE=block_size,
    )  # fmt: skip


def flip(path: Path, offset: int = 100, n: int = 64) -> None:
    """Invert ``n`` bytes of ``path`` from ``offset`` (a corrupted checkpoint shard)."""
    data = bytearray(path.read_bytes())
    for i in range(offset, offset + n):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))
