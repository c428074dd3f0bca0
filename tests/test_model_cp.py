"""The whole hybrid model under context parallelism equals the unsharded model (float64).

Every rank builds the same float64 model and batch; the CP=W loss (sum over ranks) and
gradients (all-reduced) must equal the CP=1 ones for every layout torch's balancers produce.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed
from tests.helpers import random_batch

TOL = 1e-10  # float64


def loss_and_grads(model, sequence, tokens, positions, labels, host):
    from torchtitan_cp.routing.host_metadata import HostMetadata

    meta = HostMetadata(positions.clone()) if host else None
    inp, lab, pos, ctx = sequence(tokens, labels, positions, meta)
    logits = model(inp, pos, ctx)
    loss = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), lab.reshape(-1), reduction="sum"
    )
    model.zero_grad()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _cp_model(rank: int, world: int, pattern: str, balancer: str, bsz: int, seqlen: int):
    from torchtitan_cp.models import model_config
    from torchtitan_cp.models.sequence import SequencePreprocessor

    torch.manual_seed(0)
    with torch.device("cpu"):
        model = model_config("debug", layer_pattern=pattern, vocab_size=97).build()
    model.init_states()
    model = model.double()
    tokens, positions, labels = random_batch(1, bsz, seqlen, 97)
    common = dict(device=torch.device("cpu"), load_balancer=balancer, ptrr_block_size=16)
    ref_seq = SequencePreprocessor(cp_group=None, **common)
    ref_loss, ref_grads = loss_and_grads(model, ref_seq, tokens, positions, labels, True)
    cp_seq = SequencePreprocessor(cp_group=dist.group.WORLD, **common)
    loss, grads = loss_and_grads(model, cp_seq, tokens, positions, labels, True)
    dist.all_reduce(loss)
    worst = {"loss": float((loss - ref_loss).abs())}
    for name, g in grads.items():
        dist.all_reduce(g)
        worst[name] = float((g - ref_grads[name]).abs().max())
    return worst


@pytest.mark.slow
@pytest.mark.parametrize(
    "world, pattern, balancer, bsz, seqlen",
    [
        (2, "KGA", "headtail", 2, 64),
        (2, "GKA", "contiguous", 1, 96),
        (3, "KA", "headtail", 2, 48),
        (2, "GA", "ptrr", 2, 64),
        (4, "KG", "headtail", 1, 64),
    ],
)
def test_whole_model_cp_equals_unsharded(world, pattern, balancer, bsz, seqlen):
    results = run_distributed(_cp_model, world, pattern, balancer, bsz, seqlen)
    for worst in results:
        bad = {k: v for k, v in worst.items() if v > TOL}
        assert not bad, bad
