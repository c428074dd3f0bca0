"""Host-metadata and device-readback routing train bit for bit the same (2 gloo ranks).

Three AdamW steps of the debug model under CP=2, seed 42, deterministic algorithms: outputs,
loss, grad norm, every gradient and every updated parameter must be identical between the two
routing sources, for a KDA and a GDN pattern and every load balancer.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed
from tests.helpers import positions_from_lengths

STEPS = 3


def _train(pattern: str, balancer: str, source: str) -> list[dict]:
    from torchtitan_cp.models import model_config
    from torchtitan_cp.models.sequence import SequencePreprocessor
    from torchtitan_cp.routing.host_metadata import HostMetadata

    torch.use_deterministic_algorithms(True)
    torch.manual_seed(42)
    model = model_config("debug", layer_pattern=pattern, vocab_size=257).build()
    model.init_states()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    pre = SequencePreprocessor(
        device="cpu",
        cp_group=dist.group.WORLD,
        load_balancer=balancer,
        routing_source=source,
        ptrr_block_size=16,
    )
    history = []
    gen = torch.Generator().manual_seed(7)
    for step in range(STEPS):
        lengths = torch.randint(1, 40, (8,), generator=gen).tolist()
        positions = positions_from_lengths(2, 64, lengths)
        tokens = torch.randint(0, 257, (2, 64), generator=gen)
        labels = torch.roll(tokens, -1, 1)
        inputs, labels, pos, ctx = pre(tokens, labels, positions, HostMetadata(positions.clone()))
        logits = model(inputs, pos, ctx)
        loss = (
            torch.nn.functional.cross_entropy(
                logits.flatten(0, 1), labels.flatten(), reduction="sum"
            )
            / labels.numel()
            / dist.get_world_size()
        )
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)  # CP ranks hold replicas: sum their gradient shares
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        history.append(
            {
                "step": step,
                "readbacks": pre.stats.take()["readbacks"],
                "logits": logits.detach().clone(),
                "loss": loss.detach().clone(),
                "grad_norm": norm.detach().clone(),
                "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
                "params": {n: p.detach().clone() for n, p in model.named_parameters()},
            }
        )
    return history


def _compare(rank: int, world: int, pattern: str) -> list[str]:
    problems = []
    for balancer in ("contiguous", "headtail", "ptrr"):
        host = _train(pattern, balancer, "host")
        readback = _train(pattern, balancer, "device_readback")
        for h, r in zip(host, readback, strict=True):
            where = f"{pattern}/{balancer}/step {h['step']}"
            if h["readbacks"] != 0 or r["readbacks"] == 0:
                problems.append(f"{where}: readbacks host={h['readbacks']} dev={r['readbacks']}")
            for key in ("logits", "loss", "grad_norm"):
                if not torch.equal(h[key], r[key]):
                    problems.append(f"{where}: {key} differs")
            for key in ("grads", "params"):
                for name, x in h[key].items():
                    if not torch.equal(x, r[key][name]):
                        problems.append(f"{where}: {key} {name} differs")
    return problems


@pytest.mark.slow
@pytest.mark.parametrize("pattern", ["KKA", "GGA"])
def test_host_and_readback_train_bitwise_identically(pattern):
    for problems in run_distributed(_compare, 2, pattern, timeout=600):
        assert not problems, problems[:10]
