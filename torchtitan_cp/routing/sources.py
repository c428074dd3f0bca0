"""Where a microbatch's CP layout comes from: the host metadata, or the device batch read back.

Both return the same ``Layout``: global document boundaries, every rank's fragments and the
rearrange index that shards the device batch. ``host_layout`` reads only CPU tensors: it runs
torch's own load balancers on the CPU (PTRR on a block mask built from the CPU positions).
``readback_layout`` is the legacy path: it reads the device positions and the device
load-balancer permutation back (one copy for all ranks), reporting each copy to ``on_readback``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.distributed.tensor.experimental._context_parallel._load_balancer import (
    _HeadTailLoadBalancer,
    _PTRRLoadBalancer,
)

from .layouts import FragmentTable, cu_seqlens_tensor_from_positions, fragments_from_indices

LOAD_BALANCERS = ("contiguous", "headtail", "ptrr")


@dataclass(frozen=True)
class Layout:
    """One microbatch's CP layout.

    ``cu_seqlens``: ``[D + 1]`` int64 CPU, global document boundaries of the flattened rows.
    ``fragments``: every rank's fragments in span order.
    ``index``: ``[1 or B, L]`` int64 rearrange index on the batch's device (None = identity);
    rank r's tokens of a row are ``row[index[r·L/W : (r+1)·L/W]]``.
    """

    cu_seqlens: Tensor
    fragments: FragmentTable
    index: Tensor | None


def document_ids(positions: Tensor) -> Tensor:
    """Per-row document index ``[B, L]`` int32 of ``positions [B, L]`` (a document starts where
    ``positions == 0`` and at every row start), on ``positions.device``: no host copy."""
    starts = positions == 0
    starts[:, 0] = True
    return torch.cumsum(starts.to(torch.int32), dim=1) - 1


def document_mask_mod(doc_ids: Tensor):
    """flex ``mask_mod`` of the causal packed-document mask over ``doc_ids [B, L]``: query q of
    row b sees key kv iff ``kv <= q`` and both lie in the same document (global indices)."""

    def mask_mod(b, h, q, kv):
        return (q >= kv) & (doc_ids[b, q] == doc_ids[b, kv])

    return mask_mod


def document_block_mask(positions: Tensor, block_size: int = 128):
    """Causal packed-document ``BlockMask`` ``[B, 1, L, L]`` of ``positions [B, L]`` on
    ``positions.device``; PTRR's balancer reads only its per-block counts."""
    from torch.nn.attention.flex_attention import create_block_mask

    bsz, seqlen = positions.shape
    return create_block_mask(
        document_mask_mod(document_ids(positions)), bsz, None, seqlen, seqlen,
        device=positions.device, BLOCK_SIZE=block_size,
    )  # fmt: skip


def rearrange_indices(
    load_balancer: str,
    seq_len: int,
    world_size: int,
    positions: Tensor | None,
    device: torch.device | str,
    block_size: int = 128,
) -> Tensor | None:
    """torch's load-balancer rearrange index ``[1 or B, L]`` computed on ``device``."""
    if load_balancer not in LOAD_BALANCERS:
        raise ValueError(
            f"parallelism.context_parallel_load_balancer must be one of {LOAD_BALANCERS}, "
            f"got {load_balancer!r}"
        )
    if world_size == 1 or load_balancer == "contiguous":
        return None
    if load_balancer == "headtail":
        if seq_len % (2 * world_size):
            raise ValueError(
                f"training.seq_len ({seq_len}) must be divisible by 2 x "
                f"context_parallel_degree ({2 * world_size}) for the headtail load balancer"
            )
        return _HeadTailLoadBalancer(seq_len, world_size, device)._generate_indices()
    if positions is None:
        raise ValueError("the ptrr load balancer needs positions to build its block mask")
    if seq_len % (block_size * world_size):
        raise ValueError(
            f"training.seq_len ({seq_len}) must be divisible by ptrr_block_size x "
            f"context_parallel_degree ({block_size} x {world_size}) for the ptrr load balancer"
        )
    mask = document_block_mask(positions.to(device), block_size)
    return _PTRRLoadBalancer(mask, world_size)._generate_indices()


def _fragments(index: Tensor | None, world: int, bsz: int, seqlen: int) -> FragmentTable:
    frag_index = torch.arange(seqlen).unsqueeze(0) if index is None else index
    return fragments_from_indices(frag_index, world, bsz, seqlen)


@functools.lru_cache(maxsize=32)
def _fixed_layout(
    load_balancer: str, bsz: int, seqlen: int, world_size: int
) -> tuple[tuple[tuple[tuple[int, int], ...], ...], Tensor | None]:
    """Fragments and index of a balancer whose order ignores the documents (contiguous,
    head-tail): the same for every microbatch of one shape, so computed once."""
    index = rearrange_indices(load_balancer, seqlen, world_size, None, "cpu")
    table = _fragments(index, world_size, bsz, seqlen)
    return tuple(tuple(frags) for frags in table), index


def host_layout(
    positions: Tensor,
    *,
    cu_seqlens: Tensor | None = None,
    load_balancer: str,
    world_size: int,
    device: torch.device | str,
    block_size: int = 128,
) -> Layout:
    """Layout from the host positions ``[B, L]`` (CPU); the device index is copied H2D.
    ``cu_seqlens``, when the caller already derived it from these positions, is reused."""
    bsz, seqlen = positions.shape
    cu = cu_seqlens if cu_seqlens is not None else cu_seqlens_tensor_from_positions(positions)
    if load_balancer == "ptrr":  # its order follows the documents
        index = rearrange_indices(load_balancer, seqlen, world_size, positions, "cpu", block_size)
        fragments = _fragments(index, world_size, bsz, seqlen)
    else:
        frozen, index = _fixed_layout(load_balancer, bsz, seqlen, world_size)
        fragments = [list(frags) for frags in frozen]
    if index is not None:
        if torch.device(device).type == "cuda":
            index = index.pin_memory()
        index = index.to(device, non_blocking=True)
    return Layout(cu, fragments, index)


def readback_layout(
    positions: Tensor | None,
    shape: tuple[int, int],
    *,
    load_balancer: str,
    world_size: int,
    block_size: int = 128,
    on_readback: Callable[[Tensor], None] = lambda t: None,
) -> Layout:
    """Layout from the device batch: positions and the balancer's permutation are read back.

    Without positions every row is one document. ``on_readback`` sees each tensor copied to
    the host (the permutation of all ranks is copied once, not once per rank).
    """
    bsz, seqlen = shape

    def readback(t: Tensor) -> Tensor:
        on_readback(t)
        return t.cpu()

    if positions is None:
        cu = torch.arange(0, bsz * seqlen + 1, seqlen)
        device = "cpu"
    else:
        cu = cu_seqlens_tensor_from_positions(readback(positions))
        device = positions.device
    index = rearrange_indices(load_balancer, seqlen, world_size, positions, device, block_size)
    host_index = readback(index) if index is not None else None
    return Layout(cu, _fragments(host_index, world_size, bsz, seqlen), index)
