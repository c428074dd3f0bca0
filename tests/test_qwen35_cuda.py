"""CUDA only: this recipe's Qwen3.5 against torchtitan's own Qwen3.5 on its own fla/flex path
(scripts/gpu_check.sh runs this file; it skips on CPU and on a torch older than 2.14, where
torchtitan's qwen3_5 package cannot be imported)."""

from __future__ import annotations

import pytest
import torch

from tests.test_qwen35 import (  # skips this module below torch 2.14
    VOCAB,
    _loss,
    make_batch,
    upstream_backward,
)
from torchtitan_cp.models.qwen35.model import qwen35_config
from torchtitan_cp.models.sequence import SequencePreprocessor
from torchtitan_cp.routing.host_metadata import HostMetadata


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="upstream's Qwen3.5 kernels are CUDA-only"
)
def test_cp1_matches_upstream_qwen35_on_its_own_cuda_path():
    """On CUDA, upstream's own path runs: torchtitan's Qwen3.5 with its fla kernels and flex
    masks from device positions against this recipe's (fla backend, flex, host routing); float32,
    relative error of logits and every gradient within 1e-3 (different chunkings of the same
    fla kernels and flex blocks)."""
    from torchtitan.models.qwen3_5 import qwen3_5_configs

    from torchtitan_cp.ops.cp.recurrence import recurrence

    refused = recurrence("gdn").fla_refusal()
    if refused is not None:  # the GatedDeltaNets' backward on fla (fla #640)
        pytest.skip(f"fla refuses the GatedDeltaNet backward here: {refused}")
    dev = torch.device("cuda")
    torch.manual_seed(0)
    cfg = qwen35_config(
        "debugmodel",
        n_layers=4,
        vocab_size=VOCAB,
        attention_backend="flex",
        linear_attention_backend="fla",
    )
    with dev:
        ours = cfg.build()
        ours.init_states()
        up_cfg = qwen3_5_configs["debugmodel"](attn_backend="flex")
        up_cfg.layers = up_cfg.layers[:4]
        up_cfg.vocab_size = VOCAB
        up_cfg.tok_embeddings.num_embeddings = VOCAB
        up_cfg.lm_head.out_features = VOCAB
        theirs = up_cfg.build()
    theirs.load_state_dict(ours.state_dict(), strict=False)
    tokens, positions, labels = (t.to(dev) for t in make_batch(3, 2, 256))
    seq = SequencePreprocessor(
        device=dev, cp_group=None, load_balancer="headtail", flex_attention=True
    )
    host = HostMetadata(positions.cpu())
    inp, lab, pos, ctx = seq(tokens, labels, positions, host)
    logits = ours(inp, pos, ctx)
    _loss(logits, lab).backward()
    ref = upstream_backward(theirs, tokens, positions, labels)

    def rel(a, b):
        return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))

    assert rel(logits, ref) <= 1e-3
    ref_params = dict(theirs.named_parameters())
    for name, p in ours.named_parameters():
        assert rel(p.grad, ref_params[name].grad) <= 1e-3, name
