"""The packed-document mask of a microbatch, from its positions (torch only).

Names (docs/CONTRACTS.md, "One meaning per name"): ``row_doc`` is a *per-row* document index
``[B, L]`` int32 that restarts at 0 on every row; ``SequenceContext.doc_ids`` is a different thing,
the *global* document index ``[T_local]`` int64 of each local token of the flattened stream.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "block_document_starts",
    "block_document_starts_from_positions",
    "document_mask_mod",
    "row_document_index",
    "visible_key_blocks",
]


def row_document_index(positions: Tensor) -> Tensor:
    """Per-row document index ``row_doc [B, L]`` int32 of ``positions [B, L]`` (a document starts
    where ``positions == 0`` and at every row start), on ``positions.device``: no host copy."""
    starts = positions == 0
    starts[:, 0] = True
    return torch.cumsum(starts.to(torch.int32), dim=1) - 1


def document_mask_mod(row_doc: Tensor):
    """flex ``mask_mod`` of the causal packed-document mask over ``row_doc [B, L]``: query q of
    row b sees key kv iff ``kv <= q`` and both lie in the same document of that row."""

    def mask_mod(b, h, q, kv):
        return (q >= kv) & (row_doc[b, q] == row_doc[b, kv])

    return mask_mod


def block_document_starts(cu_seqlens: Tensor, batch: int, seq_len: int, block_size: int) -> Tensor:
    """Row-local start ``[B, L / block_size]`` int64 of the document that holds the first token
    of each ``block_size``-token block, from the global boundaries ``cu_seqlens [D + 1]`` of the
    flattened ``[B, L]`` rows (a row start counts as a document start even if not listed).

    One binary search per block: O(blocks · log D), on ``cu_seqlens.device``. ``L`` must be a
    multiple of ``block_size``."""
    if seq_len % block_size:
        raise ValueError(f"seq_len ({seq_len}) must be a multiple of block_size ({block_size})")
    first = torch.arange(batch * (seq_len // block_size), device=cu_seqlens.device) * block_size
    row_start = first - first % seq_len
    doc = torch.searchsorted(cu_seqlens, first, right=True) - 1
    start = torch.maximum(cu_seqlens[doc], row_start) - row_start
    return start.view(batch, -1)


def block_document_starts_from_positions(positions: Tensor, block_size: int) -> Tensor:
    """:func:`block_document_starts` from ``positions [B, L]`` on their device, with no host
    copy (a running maximum over the document starts: O(B · L))."""
    col = torch.arange(positions.shape[1], device=positions.device)
    last_start = torch.where(positions == 0, col, 0).cummax(dim=1).values  # column 0 counts
    return last_start[:, ::block_size]


def visible_key_blocks(doc_start: Tensor, block_size: int) -> Tensor:
    """Key blocks each query block sees under the causal document mask, ``[B, NB]`` int64, from
    :func:`block_document_starts`: query block ``i`` (tokens ``[i·s, (i+1)·s)``) sees exactly
    the keys from the start of its first token's document up to its last token (the documents
    inside a block tile it), so blocks ``start // s`` to ``i``, full or partial alike."""
    blocks = torch.arange(doc_start.shape[1], device=doc_start.device)
    return blocks - doc_start // block_size + 1
