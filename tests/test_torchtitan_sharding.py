"""The host-derived CP layout shards a batch exactly like torchtitan's own CP input sharding.

torchtitan's ``cp_shard`` (the upstream device path: torch's load balancer + DTensor sharding on
the device batch) and our ``SequencePreprocessor`` (balancer run on the CPU positions) must give
every rank the same tokens, labels and positions, for head-tail and PTRR, B >= 1.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed
from tests.helpers import dense_document_block_mask, positions_from_lengths


def _compare(rank: int, world: int, balancer: str, bsz: int, seqlen: int) -> bool:
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.distributed.context_parallel.api import cp_shard

    from torchtitan_cp.models.sequence import SequencePreprocessor
    from torchtitan_cp.routing.host_metadata import HostMetadata

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    positions = positions_from_lengths(bsz, seqlen, [37, 5, 90, 1, 12, 64])
    tokens = torch.arange(bsz * seqlen).reshape(bsz, seqlen)
    labels = tokens + 1000
    block = 128  # torch shards a BlockMask only in whole 128-token blocks per rank
    masks = dense_document_block_mask(positions.clone(), block) if balancer == "ptrr" else None
    (t_ref, l_ref, p_ref), _ = cp_shard(mesh, (tokens, labels, positions), masks, balancer)
    pre = SequencePreprocessor(
        device="cpu", cp_group=dist.group.WORLD, load_balancer=balancer, ptrr_block_size=block
    )
    t, lab, pos, ctx = pre(tokens, labels, positions, HostMetadata(positions.clone()))
    assert pre.stats.readbacks == 0
    for ours, theirs, name in ((t, t_ref, "input"), (lab, l_ref, "labels"), (pos, p_ref, "pos")):
        assert torch.equal(ours, theirs), f"rank {rank}: {name} differs from torchtitan's shard"
    assert torch.equal(ctx.token_ids, t.reshape(-1))  # tokens are their own global ids here
    return True


@pytest.mark.slow
@pytest.mark.parametrize(
    "world, balancer, bsz, seqlen",
    [(2, "headtail", 2, 64), (4, "headtail", 1, 128), (2, "ptrr", 2, 256), (4, "ptrr", 1, 512)],
)
def test_host_layout_equals_torchtitan_device_sharding(world, balancer, bsz, seqlen):
    assert all(run_distributed(_compare, world, balancer, bsz, seqlen))
