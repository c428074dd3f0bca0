"""torchtitan's Qwen3.5 under this recipe's context parallelism, on 2 and 3 gloo ranks.

Every rank builds the same model and batch. CP=W (loss summed over ranks, gradients
all-reduced) must equal CP=1 on the same ranks, for head-tail and PTRR layouts: loss within 1e-6
and every gradient within 1e-5 in float32. Float64 is as tight as the model allows: torchtitan's
``OffsetRMSNorm`` and ``RMSNormGated`` compute in float32 whatever the input dtype, so a float64
Qwen3.5 carries float32 rounding through every norm (loss within 1e-10, gradients within 1e-8
measured against gradients of order 1e-2). The host and readback routing sources must give
bitwise identical parameters over 3 AdamW steps, the host path with 0 readbacks.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.dist_utils import run_distributed

pytestmark = pytest.mark.slow

VOCAB = 97
# (loss, gradients); float64 is limited by upstream's float32 norms (see the module docstring)
TOL = {torch.float64: (1e-10, 1e-8), torch.float32: (1e-6, 1e-5)}


def _setup():
    from torchtitan_cp import compat

    compat.apply()
    from torchtitan.distributed.utils import set_spmd_backend

    set_spmd_backend("partial_dtensor")


def _model(dtype: torch.dtype):
    from tests.test_qwen35 import recipe_model

    return recipe_model(4, dtype)


def _batch(seed: int, bsz: int, seqlen: int):
    from tests.test_qwen35 import make_batch

    return make_batch(seed, bsz, seqlen)


def _loss_and_grads(model, sequence, tokens, positions, labels, total: int):
    from torchtitan_cp.routing.host_metadata import HostMetadata

    inp, lab, pos, ctx = sequence(tokens, labels, positions, HostMetadata(positions.clone()))
    logits = model(inp, pos, ctx)
    loss = (
        F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float()
            if logits.dtype != torch.float64
            else logits.reshape(-1, logits.shape[-1]),
            lab.reshape(-1),
            reduction="sum",
        )
        / total
    )
    model.zero_grad()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _cp_vs_unsharded(rank: int, world: int, balancer: str, bsz: int, seqlen: int):
    _setup()
    from torchtitan_cp.models.sequence import SequencePreprocessor

    tokens, positions, labels = _batch(11, bsz, seqlen)
    common = dict(device=torch.device("cpu"), load_balancer=balancer, ptrr_block_size=16)
    worst = {}
    for dtype in (torch.float64, torch.float32):
        model = _model(dtype)
        ref_seq = SequencePreprocessor(cp_group=None, **common)
        ref_loss, ref_grads = _loss_and_grads(
            model, ref_seq, tokens, positions, labels, tokens.numel()
        )
        cp_seq = SequencePreprocessor(cp_group=dist.group.WORLD, **common)
        loss, grads = _loss_and_grads(model, cp_seq, tokens, positions, labels, tokens.numel())
        assert cp_seq.stats.readbacks == 0
        dist.all_reduce(loss)
        loss_tol, grad_tol = TOL[dtype]
        err_loss = float((loss - ref_loss).abs())
        err_grad = 0.0
        for name, g in grads.items():
            dist.all_reduce(g)
            err = float((g - ref_grads[name]).abs().max())
            assert err <= grad_tol, (str(dtype), name, err)
            err_grad = max(err_grad, err)
        assert err_loss <= loss_tol, (str(dtype), err_loss)
        worst[str(dtype)] = (err_loss, err_grad)
    return worst


@pytest.mark.parametrize(
    "world, balancer, bsz, seqlen",
    [(2, "headtail", 2, 64), (3, "headtail", 1, 96), (2, "ptrr", 2, 64), (3, "ptrr", 1, 96)],
)
def test_qwen35_cp_equals_unsharded(world, balancer, bsz, seqlen):
    results = run_distributed(_cp_vs_unsharded, world, balancer, bsz, seqlen, timeout=300)
    print(f"world {world} {balancer}: worst (loss, grad) per dtype {results}")


def _adamw_steps(rank: int, world: int, source: str, balancer: str, model_fn=None):
    """3 AdamW steps at CP=world of ``model_fn()`` (default: Qwen3.5's debug layers, float32;
    a model of vocabulary ``VOCAB``); returns every parameter's bytes after each step and the
    routing readbacks."""
    _setup()
    from torchtitan_cp.models.sequence import SequencePreprocessor
    from torchtitan_cp.routing.host_metadata import HostMetadata

    model = model_fn() if model_fn is not None else _model(torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    seq = SequencePreprocessor(
        device=torch.device("cpu"),
        cp_group=dist.group.WORLD,
        load_balancer=balancer,
        routing_source=source,
        ptrr_block_size=16,
    )
    snapshots = []
    for step in range(3):
        tokens, positions, labels = _batch(20 + step, 2, 64)
        inp, lab, pos, ctx = seq(tokens, labels, positions, HostMetadata(positions.clone()))
        logits = model(inp, pos, ctx)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), lab.reshape(-1), reduction="sum")
        opt.zero_grad()
        (loss / tokens.numel()).backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)  # what FSDP's reduce-scatter over dp_shard x cp sums
        opt.step()
        snapshots.append(
            [p.detach().clone().view(torch.uint8).numpy().tobytes() for p in model.parameters()]
        )
    return snapshots, seq.stats.readbacks


@pytest.mark.parametrize("balancer", ["headtail", "ptrr"])
def test_qwen35_host_and_readback_are_bitwise_identical(balancer):
    host = run_distributed(_adamw_steps, 2, "host", balancer, timeout=300)
    readback = run_distributed(_adamw_steps, 2, "device_readback", balancer, timeout=300)
    for (h_snap, h_reads), (d_snap, d_reads) in zip(host, readback, strict=True):
        assert h_reads == 0 and d_reads > 0
        assert h_snap == d_snap
