"""torchtitan's Qwen3.5 through this recipe (single process): the model spec from ``[model]``,
config errors, and CP=1 forward/backward against torchtitan's own Qwen3.5 path.

torchtitan's GatedDeltaNet kernels and varlen conv are fla-core Triton (CUDA only), so the
upstream side runs torchtitan's model, masks (``get_attention_masks`` from device positions)
and every module unchanged except the three kernel calls, which are replaced by per-document
loops written here: the gated delta rule token by token (``tests/reference.py``, with FLA's
in-kernel q/k L2 norm), the depthwise causal conv, and causal softmax attention.
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import random_batch
from tests.reference import conv_reference, delta_rule_reference, seq_bounds
from torchtitan_cp import compat

if compat.torch_release(torch.__version__) < compat.TRAINER_TORCH_FLOOR:
    # e.g. the GPU image's torch 2.11: torchtitan's qwen3_5 package needs 2.14 to import.
    pytest.skip("Qwen3.5 needs torch >= 2.14", allow_module_level=True)
compat.apply()

from torchtitan.distributed.utils import set_spmd_backend  # noqa: E402

from torchtitan_cp.models import recipe_model_spec  # noqa: E402
from torchtitan_cp.models.qwen35.model import (  # noqa: E402
    Qwen35TextModel,
    fla_l2norm,
    layer_types,
    qwen35_config,
)
from torchtitan_cp.models.recipe import ModelRecipe  # noqa: E402
from torchtitan_cp.models.sequence import SequencePreprocessor  # noqa: E402
from torchtitan_cp.routing.host_metadata import HostMetadata  # noqa: E402
from torchtitan_cp.trainer.config import ConfigError  # noqa: E402

set_spmd_backend("partial_dtensor")  # the recipe's default (trainer sets it from the config)

VOCAB = 97


def make_batch(seed: int, bsz: int, seqlen: int, vocab: int = VOCAB):
    """Tokens, positions (random documents, some one token long), next-token labels."""
    return random_batch(seed, bsz, seqlen, vocab, one_token_share=0.15)


# ----------------------------------------------------------------------------- upstream + refs


def _ref_kernel(self, q, k, v, g, beta, *, cu_seqlens=None, cu_seqlens_cpu=None):
    """Upstream GatedDeltaKernel(use_qk_l2norm_in_kernel=True) as a per-token loop."""
    l2 = lambda x: x / torch.sqrt(x.double().pow(2).sum(-1, keepdim=True) + 1e-6)  # noqa: E731
    o, _ = delta_rule_reference(l2(q), l2(k), v, g, beta, kind="gdn", cu_seqlens=cu_seqlens)
    return o.to(v.dtype)


def _ref_conv(self, x, conv, cu_seqlens=None, cu_seqlens_cpu=None):
    return conv_reference(x, conv.weight.squeeze(1), cu_seqlens=cu_seqlens).to(x.dtype)


class _RefAttention(torch.nn.Module):
    """Causal softmax attention document by document over upstream's VarlenMetadata."""

    def forward(self, q, k, v, *, attention_masks, scale=None, enable_gqa=False, **_):
        bsz, seqlen = q.shape[:2]
        qf, kf, vf = (x.reshape(bsz * seqlen, *x.shape[2:]) for x in (q, k, v))
        out = torch.empty_like(qf)
        rep = q.shape[2] // k.shape[2]
        for a, b in seq_bounds(attention_masks.cu_seq_q, bsz * seqlen):
            qs = qf[a:b].transpose(0, 1)
            ks = kf[a:b].repeat_interleave(rep, 1).transpose(0, 1)
            vs = vf[a:b].repeat_interleave(rep, 1).transpose(0, 1)
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale)
            out[a:b] = o.transpose(0, 1)
        return out.reshape(q.shape)


def upstream_model(n_layers: int):
    """torchtitan's own Qwen35Model (debugmodel, vision encoder included, varlen masks) with
    only its three kernel calls replaced by the references above."""
    from torchtitan.models.qwen3_5 import qwen3_5_configs
    from torchtitan.models.qwen3_5.model import GatedDeltaNet, Qwen35Attention

    cfg = qwen3_5_configs["debugmodel"](attn_backend="varlen")
    cfg.layers = cfg.layers[:n_layers]
    cfg.vocab_size = VOCAB
    cfg.tok_embeddings.num_embeddings = VOCAB
    cfg.lm_head.out_features = VOCAB
    model = cfg.build()
    for m in model.modules():
        if isinstance(m, GatedDeltaNet):
            m.kernel.forward = types.MethodType(_ref_kernel, m.kernel)
            m._causal_conv = types.MethodType(_ref_conv, m)
        if isinstance(m, Qwen35Attention):
            m.inner_attention = _RefAttention()
    return model


def recipe_model(n_layers: int, dtype=torch.float64) -> Qwen35TextModel:
    torch.manual_seed(0)
    model = qwen35_config(
        "debugmodel",
        n_layers=n_layers,
        vocab_size=VOCAB,
        attention_backend="sdpa",
        linear_attention_backend="torch",
    ).build()
    model.init_states()
    return model.to(dtype)


def _loss(logits, labels):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def upstream_backward(theirs, tokens, positions, labels) -> torch.Tensor:
    """Upstream's Qwen3.5 ``theirs`` on the packed batch (its own masks from ``positions``, no
    image or video tokens), its loss backward; its logits."""
    masks = theirs.get_attention_masks(positions)  # upstream: nonzero + .tolist() per row
    logits = theirs(
        tokens,
        attention_masks=masks,
        positions=positions,
        special_tokens={"image_id": -1, "video_id": -1},
    )
    _loss(logits, labels).backward()
    return logits


@pytest.mark.parametrize("bsz, seqlen", [(2, 48), (1, 80)])
def test_cp1_matches_upstream_qwen35_with_reference_kernels(bsz, seqlen):
    """This recipe's Qwen3.5 (host routing, recipe kernels) == torchtitan's Qwen3.5 path with
    per-document reference kernels: logits and every gradient within 1e-10 (float64)."""
    ours = recipe_model(4)
    theirs = upstream_model(4).double()
    missing, unexpected = theirs.load_state_dict(ours.state_dict(), strict=False)
    assert not unexpected and all(k.startswith("vision_encoder.") for k in missing)
    assert layer_types(ours.config) == ["linear_attention"] * 3 + ["full_attention"]

    tokens, positions, labels = make_batch(3, bsz, seqlen)
    seq = SequencePreprocessor(device="cpu", cp_group=None, load_balancer="headtail")
    inp, lab, pos, ctx = seq(tokens, labels, positions, HostMetadata(positions.clone()))
    assert seq.stats.readbacks == 0
    logits = ours(inp, pos, ctx)
    _loss(logits, lab).backward()

    ref_logits = upstream_backward(theirs, tokens, positions, labels)

    assert (logits - ref_logits).abs().max() <= 1e-10
    ref_params = dict(theirs.named_parameters())
    for name, p in ours.named_parameters():
        assert p.grad is not None, name
        err = (p.grad - ref_params[name].grad).abs().max()
        assert err <= 1e-10, (name, float(err))


def test_fla_l2norm_is_the_in_kernel_norm():
    x = torch.randn(3, 5, 8, dtype=torch.float64)
    ref = x / torch.sqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6)
    assert torch.equal(fla_l2norm(x), ref.to(x.dtype)) or (fla_l2norm(x) - ref).abs().max() < 1e-15
    assert fla_l2norm(x.float()).dtype == torch.float32


def test_direct_call_without_context_uses_device_positions():
    model = recipe_model(4)
    tokens, positions, _ = make_batch(5, 2, 32)
    seq = SequencePreprocessor(device="cpu", cp_group=None, load_balancer="headtail")
    inp, _, pos, ctx = seq(tokens, tokens, positions, HostMetadata(positions.clone()))
    assert torch.equal(model(tokens, positions), model(inp, pos, ctx))


# ----------------------------------------------------------------------------- spec and errors


def test_recipe_selects_qwen35_from_model_name():
    spec = recipe_model_spec(ModelRecipe(name="qwen3_5", flavor="debugmodel", n_layers=4))
    assert spec.name == "qwen3_5" and spec.flavor == "debugmodel"
    assert isinstance(spec.model, Qwen35TextModel.Config)
    assert spec.model.vision_encoder is None and spec.model.conv_width == 4
    assert spec.state_dict_adapter is not None
    assert spec.state_dict_adapter.__name__ == "Qwen35StateDictAdapter"
    assert recipe_model_spec(ModelRecipe()).name == "hybrid"  # the default stays the hybrid
    big = recipe_model_spec(ModelRecipe(name="qwen3_5", flavor="0.8B")).model
    assert big.dim == 1024 and len(big.layers) == 24


def test_moe_specs_register_torchtitan_load_balancing_hook():
    # Upstream's Qwen3.5 spec trains the MoE routers' expert bias with this optimizer pre-hook;
    # the recipe's specs (Qwen3.5 and Kimi Linear) must keep it, or the bias never moves.
    from torchtitan.components.optimizer import register_moe_load_balancing_hook
    from torchtitan.models.qwen3_5 import model_registry

    upstream = model_registry("debugmodel_moe").post_optimizer_build_fn
    assert upstream is register_moe_load_balancing_hook
    for recipe in (
        ModelRecipe(name="qwen3_5", flavor="debugmodel_moe"),
        ModelRecipe(name="kimi_linear", flavor="debug"),
    ):
        assert recipe_model_spec(recipe).post_optimizer_build_fn is upstream, recipe.name


@pytest.mark.parametrize(
    "recipe, message",
    [
        (dict(flavor="debug"), "unknown model.flavor 'debug' for model.name 'qwen3_5'"),
        (dict(flavor="debugmodel", layer_pattern="KKA"), "model.layer_pattern does not apply"),
        (dict(flavor="debugmodel", n_layers=99), "model.n_layers must be in [1, 8]"),
    ],
)
def test_bad_qwen35_recipes_are_one_line_errors(recipe, message):
    with pytest.raises(ValueError) as e:
        recipe_model_spec(ModelRecipe(name="qwen3_5", **recipe))
    assert message in str(e.value) and "\n" not in str(e.value)


def test_moe_widths_that_tp_cannot_split_are_refused():
    """TP splits each routed expert's hidden units (EP off) and the shared expert's: a width
    the degree does not divide is one line naming the key; under EP x TP the routed experts
    stay whole, so only the shared expert's width counts."""
    import dataclasses

    from torchtitan_cp.models.qwen35.model import check_qwen35_parallelism

    cfg = qwen35_config("debugmodel_moe", n_layers=1)
    moe = cfg.layers[0].moe
    inner = dataclasses.replace(moe.routed_experts.inner_experts, hidden_dim=255)
    moe.routed_experts = dataclasses.replace(moe.routed_experts, inner_experts=inner)

    def parallelism(tp: int, ep: int) -> types.SimpleNamespace:
        return types.SimpleNamespace(
            context_parallel_degree=1, tensor_parallel_degree=tp, expert_parallel_degree=ep
        )

    with pytest.raises(ValueError) as e:
        check_qwen35_parallelism(cfg, parallelism(2, 1))
    msg = str(e.value)
    assert "tensor_parallel_degree = 2 does not divide the 255 routed expert hidden units" in msg
    assert "use a degree in [1, 3, 5, 15, 17, 51, 85, 255]" in msg and "\n" not in msg
    check_qwen35_parallelism(cfg, parallelism(2, 2))  # EP x TP: experts whole
    check_qwen35_parallelism(cfg, parallelism(1, 1))


def test_hybrid_rejects_qwen_only_keys():
    with pytest.raises(ValueError, match="model.n_layers applies to model.name = 'qwen3_5'"):
        recipe_model_spec(ModelRecipe(n_layers=2))


def test_vision_under_cp_is_a_config_error():
    from torchtitan_cp.train import load_config

    argv = [
        "--config_file",
        "configs/qwen35_debug_cpu.toml",
        "--model.vision",
        "--parallelism.context_parallel_degree",
        "2",
    ]
    with pytest.raises(ConfigError) as e:
        load_config(argv)
    msg = str(e.value)
    assert "model.vision = true cannot run under context parallelism" in msg and "\n" not in msg
    cfg = load_config(["--config_file", "configs/qwen35_debug_cpu.toml"])
    assert cfg.model.name == "qwen3_5" and not cfg.model.vision


def test_compiled_blocks_match_eager_without_recompiles():
    """torchtitan's per-block compile (fullgraph, aot_eager) of the recipe's Qwen3.5 (GDN and
    attention blocks, capped routing): logits and every gradient equal eager's within 1e-6 over
    three document layouts, and after the first microbatch (one graph per block kind) nothing
    recompiles. The config check lets compile.enable through for qwen3_5."""
    import copy

    from torch._dynamo.testing import CompileCounterWithBackend

    from torchtitan_cp.train import load_config
    from torchtitan_cp.trainer.compile import routing_caps

    assert load_config(["--config_file", "configs/qwen35_debug_cpu.toml", "--compile.enable"])
    torch._dynamo.reset()
    compiled = recipe_model(4, torch.float32)
    eager = copy.deepcopy(compiled)
    counter = CompileCounterWithBackend("aot_eager")
    for block in compiled.layers.children():
        block.compile(backend=counter, fullgraph=True)
    caps = routing_caps(
        load_balancer="headtail",
        batch_size=2,
        seq_len=48,
        cp_degree=1,
        ptrr_block_size=128,
        max_subsequences=48,
    )
    seq = SequencePreprocessor(device="cpu", cp_group=None, load_balancer="headtail", caps=caps)
    for layout in range(3):
        tokens, positions, labels = make_batch(10 + layout, 2, 48)
        inp, lab, pos, ctx = seq(tokens, labels, positions, HostMetadata(positions.clone()))
        got, want = compiled(inp, pos, ctx), eager(inp, pos, ctx)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
        _loss(got, lab).backward()
        _loss(want, lab).backward()
        for (name, a), b in zip(compiled.named_parameters(), eager.parameters(), strict=True):
            torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=1e-6, msg=name)
        assert counter.frame_count == 2, f"layout {layout}: {counter.frame_count} frames"
