"""Where a microbatch's CP layout comes from: the host metadata, or the device batch read back.

Both return the same ``Layout``: global document boundaries, every rank's fragments and the
rearrange index that shards the device batch. ``host_layout`` reads only CPU tensors: it runs
the load balancer (``routing.balancers``) on the CPU (PTRR from the host document boundaries).
``readback_layout`` is the legacy path: it reads the device positions and the device
load-balancer permutation back (one copy for all ranks), reporting each copy to ``on_readback``.
``documents_layout`` is the host path for documents given by their lengths (the routing CLI,
benchmarks, tests): any balancer of the registry, by its config name.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
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


def documents_layout(
    doc_lens: Sequence[int],
    world_size: int,
    load_balancer: str | LoadBalancer = "contiguous",
    *,
    seq_len: int | None = None,
    block_size: int = 128,
) -> Layout:
    """The layout of documents of ``doc_lens`` tokens packed, in order, into rows of ``seq_len``
    tokens (default: one row of all of them) and sharded over ``world_size`` CP ranks by
    ``load_balancer`` (a balancer or its config name in ``routing.balancers``; PTRR in blocks of
    ``block_size``), exactly as training's host source does (``host_layout`` of their
    positions). A document that crosses a row end goes on as a new document at the next row's
    start (every row start is a document start). ``sum(doc_lens)`` must fill whole rows."""
    lens = torch.as_tensor(list(doc_lens), dtype=torch.int64)
    total = int(lens.sum())
    row = total if seq_len is None else seq_len
    # Position of token t: its offset from the later of its document's start and its row's.
    tokens = torch.arange(total)
    starts = torch.repeat_interleave(torch.cumsum(lens, 0) - lens, lens)
    positions = (tokens - torch.maximum(starts, tokens - tokens % row)).view(total // row, row)
    return host_layout(
        positions,
        load_balancer=load_balancer,
        world_size=world_size,
        device="cpu",
        block_size=block_size,
    )


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
