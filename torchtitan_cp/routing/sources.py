"""Where a microbatch's CP layout comes from: the host metadata, or the device batch read back.

Both return the same ``Layout``: global document boundaries, every rank's fragments and the
rearrange index that shards the device batch. ``host_layout`` reads only CPU tensors: it runs
the load balancer (``routing.balancers``) on the CPU (PTRR from the host document boundaries).
``readback_layout`` is the legacy path: it reads the device positions and the device
load-balancer permutation back (one copy for all ranks), reporting each copy to ``on_readback``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from .balancers import LoadBalancer, get_balancer
from .layouts import FragmentTable, cu_seqlens_tensor_from_positions, fragments_from_indices


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


def _fragments(index: Tensor | None, world: int, bsz: int, seqlen: int) -> FragmentTable:
    frag_index = torch.arange(seqlen).unsqueeze(0) if index is None else index
    return fragments_from_indices(frag_index, world, bsz, seqlen)


def _fixed_layout(
    balancer: LoadBalancer, bsz: int, seqlen: int, world_size: int
) -> tuple[tuple[tuple[tuple[int, int], ...], ...], Tensor | None]:
    """Fragments and index of a balancer whose order ignores the documents: the same for every
    microbatch of one shape, so computed once (from a stand-in of that shape) and memoised on
    the balancer itself (int keys: cheaper per microbatch than hashing the balancer)."""
    memo = balancer.__dict__.setdefault("_fixed_layouts", {})  # frozen: not a field
    key = (bsz, seqlen, world_size)
    hit = memo.get(key)
    if hit is None:
        index = balancer.indices(torch.zeros(1, seqlen, dtype=torch.int64), world_size, "cpu")
        table = _fragments(index, world_size, bsz, seqlen)
        if len(memo) >= 32:
            memo.clear()
        hit = memo[key] = (tuple(tuple(frags) for frags in table), index)
    return hit


def host_layout(
    positions: Tensor,
    *,
    cu_seqlens: Tensor | None = None,
    load_balancer: str | LoadBalancer,
    world_size: int,
    device: torch.device | str,
    block_size: int = 128,
) -> Layout:
    """Layout from the host positions ``[B, L]`` (CPU); the device index is copied H2D.
    ``cu_seqlens``, when the caller already derived it from these positions, is reused.
    ``load_balancer``: a balancer or its config name (``block_size`` = ``ptrr_block_size``)."""
    balancer = get_balancer(load_balancer, ptrr_block_size=block_size)
    bsz, seqlen = positions.shape
    cu = cu_seqlens if cu_seqlens is not None else cu_seqlens_tensor_from_positions(positions)
    if balancer.depends_on_documents:
        index = balancer.indices(positions, world_size, "cpu", cu_seqlens=cu)
        fragments = _fragments(index, world_size, bsz, seqlen)
    else:
        frozen, index = _fixed_layout(balancer, bsz, seqlen, world_size)
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
    load_balancer: str | LoadBalancer,
    world_size: int,
    block_size: int = 128,
    on_readback: Callable[[Tensor], None] = lambda t: None,
) -> Layout:
    """Layout from the device batch: positions and the balancer's permutation are read back.

    Without positions every row is one document. ``on_readback`` sees each tensor copied to
    the host (the permutation of all ranks is copied once, not once per rank).
    """
    balancer = get_balancer(load_balancer, ptrr_block_size=block_size)
    bsz, seqlen = shape

    def readback(t: Tensor) -> Tensor:
        on_readback(t)
        return t.cpu()

    if positions is None:  # one document per row, on the host: nothing to read back
        cu = torch.arange(0, bsz * seqlen + 1, seqlen)
        index = balancer.indices(
            torch.arange(seqlen).expand(bsz, seqlen), world_size, "cpu", cu_seqlens=cu
        )
        return Layout(cu, _fragments(index, world_size, bsz, seqlen), index)
    cu = cu_seqlens_tensor_from_positions(readback(positions))
    index = balancer.indices(positions, world_size, positions.device)
    host_index = readback(index) if index is not None else None
    return Layout(cu, _fragments(host_index, world_size, bsz, seqlen), index)
