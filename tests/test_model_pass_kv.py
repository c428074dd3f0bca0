"""Whole models with pass-KV attention under CP equal the unsharded models (float64, one spawn
of 2 gloo ranks, head-tail and PTRR): the hybrid ``KGKA`` decoder (loss and every
gradient within 1e-10) and Qwen3.5's debug flavor (loss within 1e-10, gradients within 1e-8:
its norms compute in float32, see tests/test_qwen35_cp.py)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.dist_utils import run_distributed
from tests.helpers import random_batch

TOL = {"hybrid": (1e-10, 1e-10), "qwen3_5": (1e-10, 1e-8)}  # (loss, gradients)
LAYOUTS = [(2, "headtail", 2, 64), (2, "ptrr", 1, 96)]  # (CP, balancer, rows, row length)


def _model(name: str):
    if name == "hybrid":
        from torchtitan_cp.models import model_config

        torch.manual_seed(0)
        cfg = model_config("debug", layer_pattern="KGKA", vocab_size=97, attention_cp="pass_kv")
        model = cfg.build()
        model.init_states()
        return model.double()
    from torchtitan_cp import compat

    compat.apply()
    from torchtitan.distributed.utils import set_spmd_backend

    from torchtitan_cp.models.qwen35.model import qwen35_config

    set_spmd_backend("partial_dtensor")
    torch.manual_seed(0)
    model = qwen35_config(
        "debugmodel",
        n_layers=4,
        vocab_size=97,
        attention_backend="sdpa",
        linear_attention_backend="torch",
        attention_cp="pass_kv",
    ).build()
    model.init_states()
    return model.double()


def _loss_and_grads(model, sequence, tokens, positions, labels):
    from torchtitan_cp.routing.host_metadata import HostMetadata

    inp, lab, pos, ctx = sequence(tokens, labels, positions, HostMetadata(positions.clone()))
    logits = model(inp, pos, ctx)
    logits = logits.reshape(-1, logits.shape[-1])
    loss = F.cross_entropy(logits, lab.reshape(-1), reduction="sum") / tokens.numel()
    model.zero_grad()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _worker(rank: int, world: int) -> dict[str, tuple[float, float]]:
    from torchtitan_cp.models.sequence import SequencePreprocessor

    worst = {}
    for name in ("hybrid", "qwen3_5"):
        model = _model(name)
        for seed, (cp, balancer, bsz, seqlen) in enumerate(LAYOUTS):
            group = dist.group.WORLD
            tokens, positions, labels = random_batch(seed, bsz, seqlen, 97)
            common = dict(
                device=torch.device("cpu"),
                load_balancer=balancer,
                ptrr_block_size=16,
                attention_cp="pass_kv",
            )
            ref = SequencePreprocessor(cp_group=None, **common)
            ref_loss, ref_grads = _loss_and_grads(model, ref, tokens, positions, labels)
            seq = SequencePreprocessor(cp_group=group, **common)
            loss, grads = _loss_and_grads(model, seq, tokens, positions, labels)
            assert seq.pass_kv and seq.stats.readbacks == 0
            dist.all_reduce(loss, group=group)
            err_grad = 0.0
            for g in grads.values():
                dist.all_reduce(g, group=group)
            for n, g in grads.items():
                err_grad = max(err_grad, float((g - ref_grads[n]).abs().max()))
            err = (float((loss - ref_loss).abs()), err_grad)
            assert err[0] <= TOL[name][0] and err[1] <= TOL[name][1], (name, cp, balancer, err)
            worst[f"{name} CP={cp} {balancer}"] = err
            assert cp == world
    return worst


@pytest.mark.slow
def test_models_with_pass_kv_equal_unsharded():
    results = run_distributed(_worker, 2, timeout=300)
    print(f"worst (loss, grad): {results[0]}")
