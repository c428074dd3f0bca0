"""Document ``BlockMask`` for flex attention, unsharded or for one CP rank's queries.

Under CP, torch's flex path (what torchtitan's ``apply_cp_to_forward`` uses) gives each rank its
own queries and the all-gathered keys/values in load-balanced order, and a ``BlockMask`` whose
query rows are that rank's tokens. torch builds that mask from a ``_LoadBalancer``; here the
balancer is the microbatch's ``Layout.index``, the same index that shards the batch, so the
mask can never disagree with the data (and nothing is read back to build it).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.experimental._context_parallel._attention import (
    _create_cp_block_mask,
)
from torch.distributed.tensor.experimental._context_parallel._load_balancer import (
    _LoadBalancer,
)
from torch.nn.attention.flex_attention import (
    _DEFAULT_SPARSE_BLOCK_SIZE,
    BlockMask,
    create_block_mask,
)

from torchtitan_cp.routing import check_divisible, document_mask_mod

__all__ = ["FLEX_BLOCK_SIZE", "LayoutOrder", "check_flex_shape", "flex_document_mask"]

# torch shards a flex BlockMask in whole blocks of this many query tokens.
FLEX_BLOCK_SIZE = _DEFAULT_SPARSE_BLOCK_SIZE

_compiled_create_block_mask = None


class LayoutOrder(_LoadBalancer):
    """torch's load-balancer interface over a fixed rearrange index ``[1 or B, L]``.

    ``None`` means contiguous sharding. It must still be passed as an object: given no
    balancer, torch's mask sharding falls back to head-tail while the batch stays contiguous.
    """

    def __init__(self, index: Tensor | None) -> None:
        self.index = index

    def _generate_indices(self, restore: bool = False) -> Tensor | None:
        if self.index is None or not restore:
            return self.index
        return torch.argsort(self.index, dim=-1)


def check_flex_shape(seq_len: int, world_size: int) -> None:
    """torch's CP flex mask needs whole blocks per rank: ``L % (W * 128) == 0``."""
    if world_size == 1:
        return
    block = FLEX_BLOCK_SIZE
    why = f"context_parallel_degree x {block} ({world_size} x {block})"
    context = (
        "for flex attention under context parallelism "
        "(model.attention_backend = 'sdpa' takes other lengths)"
    )
    check_divisible(seq_len, [(world_size * block, why)], context)


def flex_document_mask(
    row_doc: Tensor, *, index: Tensor | None = None, mesh: DeviceMesh | None = None
) -> BlockMask:
    """The causal document ``BlockMask`` of ``row_doc [B, L]`` (``routing.row_document_index``:
    per-row document index, on the device the mask is for).

    Without ``mesh`` (or with a one-rank mesh) it covers all ``L`` queries. With a CP mesh of
    W ranks it covers this rank's ``L / W`` queries against the ``L`` all-gathered keys, both in
    the order ``index`` (the layout's rearrange index, None = contiguous) puts the tokens.
    """
    global _compiled_create_block_mask
    bsz, seqlen = row_doc.shape
    mask_mod = document_mask_mod(row_doc)
    world = 1 if mesh is None else mesh.size()
    if world == 1:
        # Compiled: eager create_block_mask materialises the dense L x L mask.
        if _compiled_create_block_mask is None:
            _compiled_create_block_mask = torch.compile(create_block_mask)
        return _compiled_create_block_mask(
            mask_mod, bsz, None, seqlen, seqlen, device=row_doc.device
        )
    check_flex_shape(seqlen, world)
    assert mesh is not None
    return _create_cp_block_mask(
        mask_mod, bsz, 1, seqlen, seqlen, device_mesh=mesh, load_balancer=LayoutOrder(index)
    )
