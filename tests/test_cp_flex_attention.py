"""Softmax attention on the flex backend: torchtitan's FlexAttention and CP path.

On CUDA ``[model] attention_backend = "auto"`` runs flex attention with the microbatch's document
``BlockMask``; under CP the layer goes through torchtitan's ``apply_cp_to_forward`` (K/V
all-gather) and the mask covers this rank's queries (``ops.flex_document_mask``, sharded by the
same layout index as the batch). Flex has a CPU forward but no CPU backward, so here:

* forward, on 2, 3 and 4 gloo ranks: the whole model (flex) under CP equals the unsharded model on
  the sdpa backend, for contiguous, head-tail and PTRR, with host and readback routing (bitwise
  equal to each other);
* the sharded mask itself equals the rows of the dense document mask this rank's queries own;
* bad inputs and configs are clear errors.

The CUDA tests (forward and gradients against sdpa) skip without a GPU.
Tolerance (float32 max abs, flex vs sdpa accumulate differently): 2e-5.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed
from tests.helpers import random_batch

TOL = 2e-5  # float32
BALANCERS = ("contiguous", "headtail", "ptrr")


def _model(backend: str, pattern: str = "KA", **sizes: int):
    from torchtitan_cp.models import model_config

    torch.manual_seed(0)
    with torch.device("cpu"):
        model = model_config(
            "debug", layer_pattern=pattern, vocab_size=97, attention_backend=backend, **sizes
        ).build()
    model.init_states()
    return model


def _logits(model, sequence, tokens, positions, labels, host: bool):
    from torchtitan_cp.routing.host_metadata import HostMetadata

    meta = HostMetadata(positions.clone()) if host else None
    inp, _, pos, ctx = sequence(tokens, labels, positions, meta)
    with torch.no_grad():
        return model(inp, pos, ctx), ctx


def _cp_flex_forward(rank: int, world: int, bsz: int, seqlen: int):
    from torch.distributed.device_mesh import DeviceMesh

    from torchtitan_cp.models.blocks.flex import apply_flex_context_parallel
    from torchtitan_cp.models.sequence import SequencePreprocessor, shard_rows
    from torchtitan_cp.routing import host_layout

    tokens, positions, labels = random_batch(2, bsz, seqlen, 97)
    sdpa, flex = _model("sdpa"), _model("flex")
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    cp = dict(device=torch.device("cpu"), load_balancer="headtail", flex_attention=True)
    with pytest.raises(RuntimeError, match="apply_flex_context_parallel"):
        seq = SequencePreprocessor(cp_group=dist.group.WORLD, **cp)
        _logits(flex, seq, tokens, positions, labels, True)  # K/V not gathered yet
    assert apply_flex_context_parallel(flex, mesh) == 1
    # sdpa layers gather K/V themselves
    assert apply_flex_context_parallel(sdpa, mesh) == 0
    worst = {}
    for balancer in BALANCERS:
        common = dict(device=torch.device("cpu"), load_balancer=balancer, ptrr_block_size=128)
        ref_seq = SequencePreprocessor(cp_group=None, **common)
        ref, _ = _logits(sdpa, ref_seq, tokens, positions, labels, True)
        outs = {}
        for source in ("host", "device_readback"):
            seq = SequencePreprocessor(
                cp_group=dist.group.WORLD, routing_source=source, flex_attention=True, **common
            )
            outs[source], ctx = _logits(flex, seq, tokens, positions, labels, source == "host")
            assert ctx.block_mask is not None
            assert ctx.block_mask.seq_lengths == (seqlen // world, seqlen)
        layout = host_layout(
            positions, load_balancer=balancer, world_size=world, device="cpu", block_size=128
        )
        mine = shard_rows(ref, layout.index, rank, world)
        worst[f"{balancer}/flex-vs-sdpa"] = float((outs["host"] - mine).abs().max())
        worst[f"{balancer}/host-vs-readback"] = float(
            (outs["host"] != outs["device_readback"]).sum()
        )
    return worst


@pytest.mark.slow
@pytest.mark.parametrize("world, bsz, seqlen", [(2, 2, 256), (3, 1, 384), (4, 1, 512)])
def test_flex_cp_forward_equals_unsharded_sdpa(world: int, bsz: int, seqlen: int) -> None:
    for worst in run_distributed(_cp_flex_forward, world, bsz, seqlen, timeout=400.0):
        for key, value in worst.items():
            limit = 0 if key.endswith("host-vs-readback") else TOL
            assert value <= limit, (key, value, worst)


def test_direct_call_builds_its_flex_mask() -> None:
    """A model call without a SequenceContext derives the flex mask from the positions."""
    tokens, positions, _ = random_batch(3, 2, 192, 97)
    with torch.no_grad():
        ref = _model("sdpa", "AKA")(tokens, positions)
        out = _model("flex", "AKA")(tokens, positions)
    assert float((out - ref).abs().max()) <= TOL


def test_flex_without_a_block_mask_is_a_clear_error() -> None:
    from torchtitan_cp.models.sequence import SequencePreprocessor

    tokens, positions, labels = random_batch(3, 1, 128, 97)
    seq = SequencePreprocessor(device="cpu", cp_group=None, load_balancer="contiguous")
    with pytest.raises(ValueError, match="needs a SequenceContext with a document block_mask"):
        _logits(_model("flex"), seq, tokens, positions, labels, True)


def test_backend_resolution_and_shape_errors() -> None:
    from torchtitan_cp.models import model_config
    from torchtitan_cp.models.blocks.flex import resolve_attention_backend
    from torchtitan_cp.ops import check_flex_shape

    assert resolve_attention_backend("auto", "cuda") == "flex"
    assert resolve_attention_backend("auto", "cpu") == "sdpa"
    assert resolve_attention_backend("flex", "cpu") == "flex"
    assert not model_config("debug", layer_pattern="KG").uses_flex_attention("cuda")
    assert model_config("debug", layer_pattern="KA").uses_flex_attention("cuda")
    with pytest.raises(ValueError, match="model.attention_backend must be one of"):
        model_config("debug", attention_backend="ring")
    check_flex_shape(512, 4)
    check_flex_shape(300, 1)  # unsharded flex pads its last block
    with pytest.raises(
        ValueError,
        match=r"training.seq_len \(384\) must be divisible by "
        r"context_parallel_degree x 128 \(2 x 128\).*'sdpa'.*: use 256 or 512",
    ):
        check_flex_shape(384, 2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flex backward needs CUDA")
def test_flex_matches_sdpa_on_cuda_forward_and_backward() -> None:
    """torchtitan's compiled flex kernel against the sdpa backend: loss and every gradient."""
    from torchtitan_cp.models.sequence import SequencePreprocessor

    torch.backends.cuda.matmul.allow_tf32 = False
    tokens, positions, labels = (t.cuda() for t in random_batch(4, 2, 512, 97))
    results = []
    for backend in ("sdpa", "flex"):
        # head_dim 64: the fla shapes of the GPU check's correctness part (one compile for both).
        model = _model(backend, "KAGA", head_dim=64).cuda()
        seq = SequencePreprocessor(
            device="cuda",
            cp_group=None,
            load_balancer="contiguous",
            flex_attention=backend == "flex",
        )
        from torchtitan_cp.routing.host_metadata import HostMetadata

        inp, lab, pos, ctx = seq(tokens, labels, positions, HostMetadata(positions.cpu()))
        logits = model(inp, pos, ctx)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), lab.flatten())
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (ref_loss, ref_grads), (loss, grads) = results
    assert float((loss - ref_loss).abs()) <= 1e-4
    worst = {n: float((g - ref_grads[n]).abs().max()) for n, g in grads.items()}
    assert max(worst.values()) <= 1e-4, worst
