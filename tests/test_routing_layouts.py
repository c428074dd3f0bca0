"""Fragment tables from load balancers, the text format and document boundaries."""

import pytest
import torch
from torch.distributed.tensor.experimental._context_parallel._load_balancer import (
    _HeadTailLoadBalancer,
)

from torchtitan_cp import routing


def _span_tokens(frags):
    return [t for a, b in frags for t in range(a, b)]


def _sharded_tokens(indices, world, batch, seq_len):
    """What each rank holds after index_select + Shard(1), as global token ids in local order."""
    ids = torch.arange(batch * seq_len).view(batch, seq_len)
    if indices.shape[0] == 1:
        ids = torch.index_select(ids, 1, indices[0])
    else:
        ids = torch.gather(ids, 1, indices)
    return [chunk.reshape(-1).tolist() for chunk in ids.chunk(world, dim=1)]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("batch", [1, 2, 3])
def test_headtail_matches_torch_balancer(world, batch):
    seq_len = 2 * world * 3
    table = routing.headtail_fragments(seq_len, batch, world)
    indices = _HeadTailLoadBalancer(seq_len, world, "cpu")._generate_indices()
    expected = _sharded_tokens(indices, world, batch, seq_len)
    assert [_span_tokens(f) for f in table] == expected
    if batch == 1:  # the classic head + tail pair per rank
        k = seq_len // (2 * world)
        assert all(
            f == [(r * k, (r + 1) * k), (seq_len - (r + 1) * k, seq_len - r * k)]
            or (r == world - 1 and f == [(r * k, seq_len - r * k)])
            for r, f in enumerate(table)
        )


def test_fragments_are_maximal_runs():
    table = routing.headtail_fragments(8, 1, 2)  # indices 0 1 6 7 | 2 3 4 5
    assert table == [[(0, 2), (6, 8)], [(2, 6)]]
    for frags in table:  # no two span-adjacent fragments continue each other
        assert all(b1 != a2 for (_, b1), (a2, _) in zip(frags, frags[1:]))


@pytest.mark.parametrize("world,batch", [(1, 1), (2, 2), (4, 3)])
def test_contiguous(world, batch):
    seq_len = 4 * world
    table = routing.contiguous_fragments(seq_len, batch, world)
    identity = torch.arange(seq_len).unsqueeze(0)
    assert [_span_tokens(f) for f in table] == _sharded_tokens(identity, world, batch, seq_len)
    if world > 1:
        c = seq_len // world
        assert table[1] == [(b * seq_len + c, b * seq_len + 2 * c) for b in range(batch)]


def test_per_row_indices():
    gen = torch.Generator().manual_seed(0)
    batch, seq_len, world = 3, 12, 3
    indices = torch.stack([torch.randperm(seq_len, generator=gen) for _ in range(batch)])
    table = routing.fragments_from_indices(indices, world, batch, seq_len)
    assert [_span_tokens(f) for f in table] == _sharded_tokens(indices, world, batch, seq_len)


def test_ptrr_layout():
    from torch.distributed.tensor.experimental._context_parallel._load_balancer import (
        _PTRRLoadBalancer,
    )
    from torch.nn.attention.flex_attention import create_block_mask

    seq_len, world = 256, 2
    docs = torch.tensor([0] * 150 + [1] * 50 + [2] * 56)

    def mask_mod(b, h, q, kv):
        return (docs[q] == docs[kv]) & (q >= kv)

    mask = create_block_mask(mask_mod, 1, 1, seq_len, seq_len, device="cpu", BLOCK_SIZE=16)
    indices = _PTRRLoadBalancer(mask, world)._generate_indices()
    table = routing.ptrr_fragments_from_indices(indices, world, 1, seq_len)
    assert [_span_tokens(f) for f in table] == _sharded_tokens(indices, world, 1, seq_len)


def test_divisibility_errors_name_the_numbers():
    # The balancer's own rule (routing.balancers), in config keys, with the nearest lengths.
    with pytest.raises(
        ValueError, match=r"seq_len \(10\) .*2 x context_parallel_degree \(4\).*8 or 16"
    ):
        routing.headtail_fragments(10, 1, 4)
    with pytest.raises(
        ValueError, match=r"seq_len \(10\) .*context_parallel_degree \(3\).*9 or 12"
    ):
        routing.contiguous_fragments(10, 1, 3)
    with pytest.raises(ValueError, match=r"shape"):
        routing.fragments_from_indices(torch.arange(8).view(1, 8), 2, 1, 6)
    with pytest.raises(ValueError, match=r"row 0 is not a permutation"):
        routing.fragments_from_indices(torch.zeros(1, 4, dtype=torch.long), 2, 1, 4)


def test_parse_and_format_round_trip():
    text = "0:96,288:384;96:192,192:288"
    table = routing.parse_fragments(text)
    assert table == [[(0, 96), (288, 384)], [(96, 192), (192, 288)]]
    assert routing.format_fragments(table) == text
    assert routing.parse_fragments("0:4;;4:8") == [[(0, 4)], [], [(4, 8)]]
    for bad in ("0:4;4-8", "0:4:5", "a:b"):
        with pytest.raises(ValueError, match="cannot parse fragment"):
            routing.parse_fragments(bad)


def test_cu_seqlens_from_positions():
    positions = torch.tensor([[0, 1, 2, 0, 1], [0, 0, 1, 2, 3]])
    assert routing.cu_seqlens_from_positions(positions) == [0, 3, 5, 6, 10]
    assert routing.cu_seqlens_tensor_from_positions(positions).tolist() == [0, 3, 5, 6, 10]
    # every row start is a document start even when the document runs on across rows
    assert routing.cu_seqlens_from_positions(torch.arange(4).repeat(2, 1)) == [0, 4, 8]


def test_cu_seqlens_from_positions_errors():
    with pytest.raises(ValueError, match="2-D"):
        routing.cu_seqlens_from_positions(torch.arange(4))
    with pytest.raises(ValueError, match="row 1 starts at position 5"):
        routing.cu_seqlens_from_positions(torch.tensor([[0, 1], [5, 6]]))
    with pytest.raises(ValueError, match="row 1 has negative position -1 at column 1"):
        routing.cu_seqlens_from_positions(torch.tensor([[0, 1], [0, -1]]))
