"""PTRR from document boundaries equals torch's ``_PTRRLoadBalancer`` on the dense mask.

The PTRR balancer (``routing.balancers.PTRR``) never builds a ``BlockMask``: it reads each query
block's work from where its document starts. Here torch's balancer on the dense causal document
mask (flex's eager ``create_block_mask``, ``tests.helpers.dense_document_block_mask``) is the
oracle, over 1,000+ random layouts: 1 to 8 rows, 1 to 300 documents, documents down to 1 token,
block sizes 16 to 256, 2 to 16 ranks; both of the balancer's inputs (the host's ``cu_seqlens`` and
the positions alone, the readback path's) must give the oracle's index exactly.

The oracle costs O(B·L²), so the bulk uses rows of at most 256 tokens (two groups 512), batched: layouts
with one (block size, ranks, L) are stacked as rows of one dense mask. torch schedules every row
on its own (its counts and its sort are per row), so each layout's rows of the stacked index are
that layout's own; ``test_larger_layouts_one_by_one`` checks a handful of larger ones unstacked.
"""

from __future__ import annotations

import random

import pytest
import torch
from torch.distributed.tensor.experimental._context_parallel._load_balancer import (
    _PTRRLoadBalancer,
)

from tests.helpers import dense_document_block_mask, positions_from_lengths
from torchtitan_cp.routing import (
    cu_seqlens_tensor_from_positions,
    get_balancer,
    host_layout,
    readback_layout,
)


def random_positions(rng: random.Random, bsz: int, seqlen: int, docs: int) -> torch.Tensor:
    """``[bsz, seqlen]`` positions with ``docs`` documents (at least one per row: a row start
    starts one) cut at random points of the flattened stream, so lengths go down to 1 token.
    A quarter of the layouts number tokens inside a document arbitrarily (only the zeros mark
    documents, as for the mask)."""
    total = bsz * seqlen
    row_starts = set(range(0, total, seqlen))
    extra = max(0, min(docs, total) - len(row_starts))
    cuts = sorted(row_starts | set(rng.sample(range(1, total), extra)))
    starts = torch.zeros(total, dtype=torch.bool)
    starts[torch.tensor(cuts)] = True
    col = torch.arange(total)
    pos = col - torch.where(starts, col, 0).cummax(0).values
    if rng.random() < 0.25:
        noise = torch.randint(1, 1000, (total,), generator=torch.Generator().manual_seed(len(cuts)))
        pos = torch.where(pos == 0, 0, noise)
    return pos.view(bsz, seqlen)


def _layouts(seed: int, shapes: list[tuple[int, int, int]], groups: int, per_group: int):
    """``shapes`` (block, ranks, L), then random ones with L <= 192 up to ``groups`` in all,
    ``per_group`` layouts each; yields ``(block, world, [positions of each layout])``."""
    rng = random.Random(seed)
    shapes, max_len = list(shapes), 192
    while len(shapes) < groups:
        block = rng.randint(16, max_len // 2)
        world = rng.randint(2, min(16, max_len // block))
        seqlen = block * world * rng.randint(1, max_len // (block * world))
        shapes.append((block, world, seqlen))
    for block, world, seqlen in shapes[:groups]:
        layouts = []
        for _ in range(per_group):
            bsz = rng.randint(1, 8)
            cap = min(300, bsz * seqlen)  # few documents as often as many
            docs = rng.choice([rng.randint(1, cap), int(cap ** rng.random())])
            layouts.append(random_positions(rng, bsz, seqlen, docs))
        yield block, world, layouts


def _check(block: int, world: int, positions: torch.Tensor, expected: torch.Tensor) -> None:
    lb = get_balancer("ptrr", ptrr_block_size=block)
    cu = cu_seqlens_tensor_from_positions(positions)
    host = lb.indices(positions, world, "cpu", cu_seqlens=cu)
    readback = lb.indices(positions, world, "cpu")  # from the positions alone
    assert host is not None and readback is not None
    assert host.dtype == torch.int64 and host.shape == positions.shape
    assert torch.equal(host, expected), (block, world, positions.shape, cu.numel() - 1)
    assert torch.equal(readback, expected), (block, world, positions.shape, cu.numel() - 1)


def test_equals_torchs_ptrr_on_the_dense_mask():
    checked = 0
    groups = [
        # the extremes: smallest blocks with most ranks, largest blocks, most blocks per rank
        *_layouts(17, [(16, 16, 256), (128, 2, 256), (16, 2, 256)], groups=24, per_group=42),
        *_layouts(18, [(256, 2, 512), (32, 16, 512)], groups=2, per_group=6),
    ]
    for block, world, layouts in groups:
        stacked = torch.cat(layouts)
        expected = _PTRRLoadBalancer(dense_document_block_mask(stacked, block), world)
        expected = expected._generate_indices()
        row = 0
        for positions in layouts:
            bsz = positions.shape[0]
            _check(block, world, positions, expected[row : row + bsz])
            row += bsz
            checked += 1
    assert checked >= 1000


@pytest.mark.parametrize(
    "block, world, bsz, seqlen, docs",
    [
        (256, 16, 1, 4096, 300),
        (16, 16, 1, 2048, 300),
        (128, 8, 2, 2048, 40),
        (48, 3, 2, 1440, 1),
        (256, 4, 1, 2048, 2048),
        (200, 5, 1, 3000, 17),
    ],
)
def test_larger_layouts_one_by_one(block, world, bsz, seqlen, docs):
    positions = random_positions(random.Random(seqlen + docs), bsz, seqlen, docs)
    expected = _PTRRLoadBalancer(dense_document_block_mask(positions, block), world)
    _check(block, world, positions, expected._generate_indices())


def test_torchs_documented_example():
    # _PTRRLoadBalancer's docstring: 16 blocks, documents of 4, 8 and 4 blocks, 2 ranks.
    positions = positions_from_lengths(1, 16, [4, 8, 4])
    index = get_balancer("ptrr", ptrr_block_size=1).indices(positions, 2, "cpu")
    assert index is not None
    assert index.tolist() == [[2, 3, 5, 6, 8, 11, 12, 13, 0, 1, 4, 7, 9, 10, 14, 15]]


def test_no_block_mask_is_built(monkeypatch):
    """The host and readback layouts of PTRR at 8 x 16384 tokens never call flex's mask
    builder (which the balancer called before, evaluating all L x L pairs)."""
    import torch.nn.attention.flex_attention as flex

    def refuse(*args, **kwargs):
        raise AssertionError("PTRR built a BlockMask")

    monkeypatch.setattr(flex, "create_block_mask", refuse)
    monkeypatch.setattr(flex, "create_mask", refuse)
    positions = random_positions(random.Random(0), 8, 16384, 300)
    host = host_layout(positions, load_balancer="ptrr", world_size=8, device="cpu")
    back = readback_layout(positions, (8, 16384), load_balancer="ptrr", world_size=8)
    assert host.fragments == back.fragments
    assert host.index is not None and back.index is not None
    assert torch.equal(host.index, back.index)
