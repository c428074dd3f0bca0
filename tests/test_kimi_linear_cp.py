"""Kimi Linear under this recipe's context parallelism, on 2 gloo ranks.

Every rank builds the same float32 model and batch. CP=2 (loss summed over ranks, gradients
all-reduced) must equal CP=1 on the same ranks for the head-tail and contiguous layouts: the
KDA layers run the recipe's CP driver and conv halo (host routing, 0 readbacks), the MLA layers
the recipe's attention CP path: on sdpa's all-gather path each token's compressed latent
travels (``LatentGatherMLA``: 40 numbers per token at the debug sizes, where K/V would be 160),
with pass-KV the expanded K/V. On flex (forward only: CPU flex has no backward) the latent
travels too and the logits equal the unsharded sdpa model's.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.dist_utils import run_distributed

pytestmark = pytest.mark.slow

VOCAB = 97  # as tests/test_qwen35_cp.py, whose AdamW steps the bitwise test reuses
LOSS_TOL, GRAD_TOL = 1e-5, 1e-5  # float32


def _setup():
    from torchtitan_cp import compat

    compat.apply()
    from torchtitan.distributed.utils import set_spmd_backend

    set_spmd_backend("partial_dtensor")


def _model(attention_cp: str = "all_gather"):
    from torchtitan_cp.models.kimi_linear.model import kimi_linear_config

    torch.manual_seed(0)
    model = kimi_linear_config(
        "debug",
        vocab_size=VOCAB,
        attention_backend="sdpa",
        linear_attention_backend="torch",
        attention_cp=attention_cp,
    ).build()
    model.init_states()
    return model


def _loss_and_grads(model, sequence, tokens, positions, labels):
    from torchtitan_cp.routing.host_metadata import HostMetadata

    inp, lab, pos, ctx = sequence(tokens, labels, positions, HostMetadata(positions.clone()))
    logits = model(inp, pos, ctx)
    loss = (
        F.cross_entropy(logits.reshape(-1, VOCAB), lab.reshape(-1), reduction="sum")
        / tokens.numel()
    )
    model.zero_grad()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _cp_vs_unsharded(
    rank: int, world: int, balancer: str, attention_cp: str, bsz: int, seqlen: int
):
    _setup()
    from tests.helpers import random_batch
    from torchtitan_cp.models.sequence import SequencePreprocessor

    tokens, positions, labels = random_batch(11, bsz, seqlen, VOCAB, one_token_share=0.15)
    common = dict(device=torch.device("cpu"), load_balancer=balancer, attention_cp=attention_cp)
    model = _model(attention_cp)
    ref_loss, ref_grads = _loss_and_grads(
        model, SequencePreprocessor(cp_group=None, **common), tokens, positions, labels
    )
    cp_seq = SequencePreprocessor(cp_group=dist.group.WORLD, **common)
    import torchtitan_cp.ops.attention.sdpa as sdpa

    gathered = []  # numbers per token of every differentiable all-gather of the sdpa path
    plain = sdpa.all_gather_autograd
    sdpa.all_gather_autograd = lambda x, g: gathered.append(x[0].numel()) or plain(x, g)
    try:
        loss, grads = _loss_and_grads(model, cp_seq, tokens, positions, labels)
    finally:
        sdpa.all_gather_autograd = plain
    if attention_cp == "all_gather":  # MLA's latent (32) + rope key (8), not 4 x (24 + 16) K/V
        assert gathered == [40], gathered
    assert cp_seq.stats.readbacks == 0
    dist.all_reduce(loss)
    err_grad = 0.0
    for name, g in grads.items():
        dist.all_reduce(g)
        err = float((g - ref_grads[name]).abs().max())
        assert err <= GRAD_TOL, (name, err)
        err_grad = max(err_grad, err)
    err_loss = float((loss - ref_loss).abs())
    assert err_loss <= LOSS_TOL, err_loss
    return err_loss, err_grad


@pytest.mark.parametrize(
    "balancer, attention_cp",
    [("headtail", "all_gather"), ("contiguous", "all_gather"), ("headtail", "pass_kv")],
)
def test_kimi_linear_cp_equals_unsharded(balancer, attention_cp):
    results = run_distributed(_cp_vs_unsharded, 2, balancer, attention_cp, 2, 64, timeout=300)
    print(f"{balancer} {attention_cp}: worst (loss, grad) per rank {results}")


def test_kimi_linear_host_and_readback_are_bitwise_identical():
    """3 AdamW steps at CP=2 (head-tail): the host and device-readback routing sources give
    bitwise identical parameters, the host path with 0 readbacks."""
    from tests.test_qwen35_cp import _adamw_steps

    host = run_distributed(_adamw_steps, 2, "host", "headtail", _model, timeout=300)
    readback = run_distributed(_adamw_steps, 2, "device_readback", "headtail", _model, timeout=300)
    for (h_snap, h_reads), (d_snap, d_reads) in zip(host, readback, strict=True):
        assert h_reads == 0 and d_reads > 0
        assert h_snap == d_snap


def _flex_latent_forward(rank: int, world: int, bsz: int, seqlen: int):
    """Logits of the flex model under CP (latent gathered, this rank's BlockMask) against the
    unsharded sdpa model's rows this rank owns, per layout; numbers gathered per token."""
    _setup()
    import torchtitan_cp.models.kimi_linear.model as kimi
    from tests.helpers import random_batch
    from tests.test_cp_flex_attention import _logits
    from torchtitan_cp.models.sequence import SequencePreprocessor, shard_rows
    from torchtitan_cp.routing import host_layout

    tokens, positions, labels = random_batch(2, bsz, seqlen, VOCAB)
    sdpa = _model()
    torch.manual_seed(0)
    flex = kimi.kimi_linear_config(
        "debug", vocab_size=VOCAB, attention_backend="flex", linear_attention_backend="torch"
    ).build()
    flex.load_state_dict(sdpa.state_dict())
    gathered = []
    plain = kimi.all_gather_autograd
    kimi.all_gather_autograd = lambda x, g: gathered.append(x[0, 0].numel()) or plain(x, g)
    worst = {}
    try:
        for balancer in ("headtail", "contiguous"):
            common = dict(device=torch.device("cpu"), load_balancer=balancer)
            ref, _ = _logits(
                sdpa, SequencePreprocessor(cp_group=None, **common), tokens, positions, labels, True
            )
            seq = SequencePreprocessor(cp_group=dist.group.WORLD, flex_attention=True, **common)
            out, ctx = _logits(flex, seq, tokens, positions, labels, True)
            assert ctx.block_mask is not None and seq.stats.readbacks == 0
            layout = host_layout(
                positions, load_balancer=balancer, world_size=world, device="cpu", block_size=128
            )
            worst[balancer] = float((out - shard_rows(ref, layout.index, rank, world)).abs().max())
    finally:
        kimi.all_gather_autograd = plain
    assert gathered == [40, 40], gathered  # one MLA layer per layout: latent 32 + rope key 8
    return worst


def test_kimi_linear_flex_gathers_the_latent():
    """Flex MLA under CP=2 (head-tail, contiguous; 2 x 256 tokens, whole 128-token mask blocks
    per rank): each token's 40-number latent is gathered, not its 160 K/V numbers, and the
    logits equal the unsharded sdpa model's within 2e-5 (flex and sdpa accumulate
    differently)."""
    for worst in run_distributed(_flex_latent_forward, 2, 2, 256, timeout=300):
        print("kimi_linear flex latent CP: worst |logits - unsharded|", worst)
        assert all(err <= 2e-5 for err in worst.values()), worst
