"""The packed-document mask of a microbatch, from its positions (torch only).

Names (docs/CONTRACTS.md, "One meaning per name"): ``row_doc`` is a *per-row* document index
``[B, L]`` int32 that restarts at 0 on every row; ``SequenceContext.doc_ids`` is a different thing,
the *global* document index ``[T_local]`` int64 of each local token of the flattened stream.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["document_block_mask", "document_mask_mod", "row_document_index"]


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


def document_block_mask(positions: Tensor, block_size: int = 128):
    """Causal packed-document ``BlockMask`` ``[B, 1, L, L]`` of ``positions [B, L]`` on
    ``positions.device``; PTRR's balancer reads only its per-block counts."""
    from torch.nn.attention.flex_attention import create_block_mask

    bsz, seqlen = positions.shape
    return create_block_mask(
        document_mask_mod(row_document_index(positions)), bsz, None, seqlen, seqlen,
        device=positions.device, BLOCK_SIZE=block_size,
    )  # fmt: skip
