"""Host-metadata routing vs the device-readback path: same layout, same tensors, no readback."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers import positions_from_lengths
from torchtitan_cp.models.sequence import SequencePreprocessor
from torchtitan_cp.routing import DeviceRouting
from torchtitan_cp.routing.host_metadata import HostMetadata

# Every tensor of DeviceRouting, so a new field is compared without editing this test.
ROUTING_FIELDS = tuple(f.name for f in dataclasses.fields(DeviceRouting) if f.type == "Tensor")


# What every preprocessor pair below shares unless a test says otherwise (CPU, no process group).
DEFAULTS = dict(device="cpu", cp_group=None, ptrr_block_size=4)


def preprocessors(rank: int, world: int, balancer: str, **options):
    """``(host, device_readback)``: one preprocessor per routing source, otherwise the same."""
    options = DEFAULTS | options
    return tuple(
        SequencePreprocessor(
            routing_source=source,
            load_balancer=balancer,
            cp_rank=rank,
            cp_world_size=world,
            **options,
        )
        for source in ("host", "device_readback")
    )


def run(pre, tokens, positions, host=True):
    meta = HostMetadata(positions.clone()) if host else None
    labels = tokens + 1
    return pre(tokens, labels, positions, meta)


def assert_same_context(a, b):
    for name in ROUTING_FIELDS:
        x, y = getattr(a.routing, name), getattr(b.routing, name)
        assert x.dtype == y.dtype and torch.equal(x, y), name
    assert len(ROUTING_FIELDS) == 20
    for name in ("rank", "world_size", "num_slots", "conv_history", "num_tokens", "chunk_size"):
        assert getattr(a.routing, name) == getattr(b.routing, name), name
    assert torch.equal(a.token_ids, b.token_ids) and torch.equal(a.doc_ids, b.doc_ids)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    world=st.sampled_from([2, 3, 4, 8]),
    balancer=st.sampled_from(["contiguous", "headtail", "ptrr"]),
    bsz=st.integers(1, 3),
    chunks=st.integers(1, 3),
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=12),
    data=st.data(),
)
def test_host_and_readback_build_identical_routing(world, balancer, bsz, chunks, lengths, data):
    unit = {"contiguous": world, "headtail": 2 * world, "ptrr": 4 * world}[balancer]
    seqlen = unit * chunks * (2 if world < 4 else 1)
    rank = data.draw(st.integers(0, world - 1))
    positions = positions_from_lengths(bsz, seqlen, lengths)
    tokens = torch.arange(bsz * seqlen).reshape(bsz, seqlen)
    host, readback = preprocessors(rank, world, balancer)
    out_h = run(host, tokens, positions)
    out_r = run(readback, tokens, positions)
    for x, y in zip(out_h[:3], out_r[:3], strict=True):
        assert torch.equal(x, y)
    assert_same_context(out_h[3], out_r[3])
    assert host.stats.readbacks == 0
    assert readback.stats.readbacks == (1 if balancer == "contiguous" else 2)
    # The local tokens are exactly the ones the routing says this rank holds.
    assert torch.equal(out_h[0].reshape(-1), out_h[3].token_ids)


@pytest.mark.parametrize("balancer", ["contiguous", "headtail", "ptrr"])
def test_host_path_reads_no_device_tensor(balancer):
    """Device copies on the meta device cannot be read: the host path never tries."""
    positions = positions_from_lengths(2, 32, [5, 11, 3, 20])
    tokens = torch.arange(64).reshape(2, 32)
    meta = {k: v.to("meta") for k, v in {"t": tokens, "p": positions}.items()}
    host, readback = preprocessors(1, 2, balancer, device="meta")
    inputs, labels, pos, ctx = host(meta["t"], meta["t"], meta["p"], HostMetadata(positions))
    assert inputs.device.type == "meta" and ctx.routing.cu_seqlens.device.type == "meta"
    assert host.stats.readbacks == 0
    with pytest.raises((NotImplementedError, RuntimeError)):
        readback(meta["t"], meta["t"], meta["p"], HostMetadata(positions))


def test_consecutive_microbatches_share_no_storage():
    positions = positions_from_lengths(2, 32, [7, 9])
    tokens = torch.arange(64).reshape(2, 32)
    host, _ = preprocessors(0, 2, "headtail")
    a, b = run(host, tokens, positions)[3], run(host, tokens, positions)[3]
    assert host.cache.stats()["hits"] == 1  # the same layout reuses the host plan ...
    ptrs_a = {getattr(a.routing, n).untyped_storage().data_ptr() for n in ROUTING_FIELDS}
    ptrs_a |= {a.token_ids.untyped_storage().data_ptr()}
    ptrs_b = {getattr(b.routing, n).untyped_storage().data_ptr() for n in ROUTING_FIELDS}
    ptrs_b |= {b.token_ids.untyped_storage().data_ptr()}
    assert not ptrs_a & ptrs_b  # ... but never the device tensors


def test_cache_keys_follow_layout_and_capacity():
    tokens = torch.arange(64).reshape(2, 32)
    host, _ = preprocessors(0, 2, "headtail", plan_cache_size=2)
    for lengths in ([5], [6], [7], [5], [7]):  # LRU: 5 is evicted by 7, 6 by the second 5
        run(host, tokens, positions_from_lengths(2, 32, lengths))
    assert host.cache.stats() == {
        "hits": 1, "misses": 4, "evictions": 2, "size": 2, "capacity": 2,
    }  # fmt: skip # a table, laid out by hand to read across


def test_missing_host_metadata_falls_back_once(caplog):
    host, _ = preprocessors(0, 2, "headtail")
    positions = positions_from_lengths(1, 16, [3, 13])
    tokens = torch.arange(16).reshape(1, 16)
    with caplog.at_level(logging.WARNING):
        run(host, tokens, positions, host=False)
        run(host, tokens, positions, host=False)
    warnings = [r for r in caplog.records if "falling back" in r.getMessage()]
    assert len(warnings) == 1
    assert host.stats.readbacks == 4 and host.stats.sources == {"device_readback"}


@pytest.mark.parametrize(
    "host_positions, message",
    [
        (torch.zeros(2, 16, dtype=torch.int64), r"host positions have shape \[2, 16\]"),
        (torch.arange(1, 33).reshape(1, 32), "row 0 starts at position 1"),
        (
            torch.cat([torch.arange(32), torch.tensor([0, -3] + [1] * 30)]).reshape(2, 32),
            "row 1 has negative position -3",
        ),
    ],
)
def test_bad_host_positions_name_the_problem(host_positions, message):
    host, _ = preprocessors(0, 2, "contiguous")
    tokens = torch.zeros(host_positions.shape[0], 32, dtype=torch.int64)
    if host_positions.shape[1] != 32:
        tokens = torch.zeros(1, 32, dtype=torch.int64)
    with pytest.raises(ValueError, match=message):
        host(tokens, tokens, None, HostMetadata(host_positions))


@pytest.mark.parametrize("per_row", [False, True])
def test_shard_rows_keeps_trailing_dims(per_row):
    """shard_rows on ``[B, L, ...]`` (logits, hidden states) picks the same tokens as on
    ``[B, L]``, with one shared order or one order per row (PTRR)."""
    from torchtitan_cp.models.sequence import shard_rows

    bsz, seqlen, world = 2, 8, 2
    gen = torch.Generator().manual_seed(0)
    rows = 2 if per_row else 1
    index = torch.stack([torch.randperm(seqlen, generator=gen) for _ in range(rows)])
    x = torch.arange(bsz * seqlen).reshape(bsz, seqlen)
    feats = torch.stack([x, -x], dim=-1).unsqueeze(-1)  # [B, L, 2, 1]
    for rank in range(world):
        flat = shard_rows(x, index, rank, world)
        assert torch.equal(shard_rows(feats, index, rank, world)[..., 0, 0], flat)
        assert torch.equal(shard_rows(feats, index, rank, world)[..., 1, 0], -flat)
        mine = index[:, rank * seqlen // world : (rank + 1) * seqlen // world]
        assert torch.equal(flat, torch.gather(x, 1, mine.expand(bsz, -1)))
