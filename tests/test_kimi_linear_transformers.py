"""Kimi Linear against transformers' own ``KimiLinearForCausalLM``: a folder written by its
``save_pretrained`` (random weights at the recipe's debug sizes, no network) is read through the
recipe's state-dict adapter into ``KimiLinearModel``, and both forwards compare in float32 on
CPU: one document, and packed documents (the recipe's document masking against transformers
run on each document alone).

transformers is a test-only dependency (the ``dev`` extra). On CPU its KDA and conv would go to
fla-core's Triton kernels (fla is installed for the recipe), which need a GPU: the tests point
its module-level kernels back at transformers' own PyTorch implementations.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
import torch

from torchtitan_cp import compat

compat.apply()

import transformers.models.kimi_linear.modeling_kimi_linear as hf_modeling  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from torchtitan.distributed.utils import set_spmd_backend  # noqa: E402
from transformers import KimiLinearConfig, KimiLinearForCausalLM  # noqa: E402

from tests.helpers import unwrapped  # noqa: E402
from torchtitan_cp.models.kimi_linear import hf  # noqa: E402
from torchtitan_cp.models.kimi_linear.model import KimiLinearModel, kimi_linear_config  # noqa: E402

set_spmd_backend("partial_dtensor")

# The recipe's debug flavor as transformers' config (KDA, KDA, KDA, MLA; first layer dense).
DEBUG = dict(
    vocab_size=1024,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=32,
    q_lora_rank=None,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    num_local_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    linear_head_dim=16,
    linear_num_heads=4,
    pad_token_id=None,
    bos_token_id=None,
    eos_token_id=None,
    layer_types=["linear_attention"] * 3 + ["full_attention"],
    mlp_layer_types=["dense"] + ["sparse"] * 3,
)
# float32, two implementations (different kernels and summation orders), logits of magnitude
# ~0.75: measured max |diff| 5.7e-7 (one document and packed); the bound leaves headroom. With
# F.normalize in place of fla's q/k norm (the recipe's default KDA) the diff is ~6e-2.
LOGITS_ATOL = 5e-6


def torch_reference_kernels() -> contextlib.AbstractContextManager[None]:
    """transformers' PyTorch KDA and conv instead of fla's Triton kernels (GPU only)."""
    names = (
        "chunk_kimi_delta_attention",
        "recurrent_kimi_delta_attention",
        "causal_conv1d_fn",
        "causal_conv1d_update",
    )
    return unwrapped(hf_modeling, names)


def _hf_model(seed: int = 0) -> KimiLinearForCausalLM:
    torch.manual_seed(seed)
    model = KimiLinearForCausalLM(KimiLinearConfig(**DEBUG)).eval()
    with torch.no_grad():  # non-trivial values where transformers' init leaves zeros or ones
        for name, p in model.named_parameters():
            if name.endswith(("layernorm.weight", "o_norm.weight", "norm.weight")):
                p.uniform_(0.5, 1.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.uniform_(-0.05, 0.05)
    return model


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("kimi_linear_hf")
    _hf_model().save_pretrained(path)
    return path


def _recipe_model(folder: Path) -> KimiLinearModel:
    cfg = kimi_linear_config("debug")
    prefix = hf.check_hf_folder(folder, cfg)
    model = cfg.build().eval()
    adapter = hf.KimiLinearStateDictAdapter(cfg, None, dense_prefix=prefix)
    sd = adapter.from_hf(load_file(str(folder / "model.safetensors")))
    model.load_state_dict(sd, strict=False)  # tokens_per_expert_E: a non-persistent counter
    missing = set(model.state_dict()) - set(sd)
    assert not missing, f"not read from the HF folder: {sorted(missing)}"
    return model


def _hf_logits(model: KimiLinearForCausalLM, tokens: torch.Tensor) -> torch.Tensor:
    with torch_reference_kernels(), torch.no_grad():
        return model(input_ids=tokens, use_cache=False).logits


def test_adapter_round_trip(hf_folder):
    """to_hf(from_hf(folder)) is the folder's state dict, names and values."""
    cfg = kimi_linear_config("debug")
    on_disk = load_file(str(hf_folder / "model.safetensors"))
    adapter = hf.KimiLinearStateDictAdapter(cfg, None, dense_prefix="block_sparse_moe")
    back = adapter.to_hf(adapter.from_hf(on_disk))
    assert set(back) == set(on_disk)
    for k, v in on_disk.items():
        assert torch.equal(back[k], v), k


def test_folder_config_is_the_flavor(hf_folder):
    """save_pretrained's config.json resolves to the debug flavor's fields, and the folder's
    dense layer is under block_sparse_moe (transformers renames every .mlp. on save)."""
    cfg = kimi_linear_config("debug")
    assert hf.config_mismatch(json.loads((hf_folder / "config.json").read_text()), cfg) is None
    assert hf.check_hf_folder(hf_folder, cfg) == "block_sparse_moe"


@pytest.mark.parametrize("lengths", [(96,), (40, 1, 55)], ids=["one_document", "packed_documents"])
def test_logits_equal_transformers(hf_folder, lengths):
    """float32 logits of the recipe's model = transformers' on the same weights, per document
    (the packed row is one stream with document masking; transformers runs each alone)."""
    ref = _hf_model()
    model = _recipe_model(hf_folder)
    g = torch.Generator().manual_seed(1)
    docs = [torch.randint(0, DEBUG["vocab_size"], (1, n), generator=g) for n in lengths]
    tokens = torch.cat(docs, dim=1)
    positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    with torch.no_grad():
        got = model(tokens, positions)
    want = torch.cat([_hf_logits(ref, d) for d in docs], dim=1)
    err = (got - want).abs().max().item()
    print(f"max |logits diff| {err:.3g} (|logits| max {want.abs().max().item():.3g})")
    assert err < LOGITS_ATOL


def _load_through_torchtitan(model: KimiLinearModel, path: Path, prefix: str) -> None:
    """torchtitan's CheckpointManager.dcp_load(from_hf=True) on a manager holding ``model``:
    the path ``--checkpoint.initial_load_in_hf`` takes (the adapter's to_hf names must be the
    folder's own, or DCP finds nothing to read)."""
    import types

    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.checkpointer.base import ModelWrapper

    wrapper = ModelWrapper(model)
    adapter = hf.KimiLinearStateDictAdapter(model.config, str(path), dense_prefix=prefix)
    manager = types.SimpleNamespace(sd_adapter=adapter, states={"model": wrapper})
    CheckpointManager.dcp_load(  # pyrefly: ignore[bad-argument-type]
        manager, wrapper.state_dict(), checkpoint_id=str(path), from_hf=True, from_quantized=False
    )


def test_hf_folder_loads_through_torchtitan(hf_folder):
    """A save_pretrained folder read by torchtitan's HF checkpoint load gives the same logits
    as transformers' model."""
    cfg = kimi_linear_config("debug")
    prefix = hf.check_hf_folder(hf_folder, cfg)
    torch.manual_seed(5)
    model = cfg.build()
    model.init_states()
    tokens = torch.randint(0, DEBUG["vocab_size"], (1, 64))
    with torch.no_grad():
        before = model(tokens)
    _load_through_torchtitan(model, hf_folder, prefix)
    model.eval()
    with torch.no_grad():
        got = model(tokens)
    want = _hf_logits(_hf_model(), tokens)
    assert (before - want).abs().max() > 1e-3  # the load changed the model
    assert (got - want).abs().max() < LOGITS_ATOL


@pytest.mark.parametrize(
    "edit, message",
    [
        ({"hidden_size": 32}, "config.json: hidden_size is 32 but the model flavor has 64"),
        ({"layer_types": ["linear_attention"] * 4}, "layer_types is ['linear_attention', "),
        ({"num_experts": 16}, "num_experts is 16 but the model flavor has 8"),
        ({"model_type": "qwen3_5"}, "model_type is 'qwen3_5' but the model flavor is Kimi"),
    ],
)
def test_config_mismatch_names_the_first_field(hf_folder, tmp_path, edit, message):
    """A folder whose config.json builds another model: one line naming the key and both
    values (transformers' on-disk alias, e.g. num_experts for num_local_experts)."""
    import shutil

    folder = tmp_path / "hf"
    shutil.copytree(hf_folder, folder)
    data = json.loads((folder / "config.json").read_text())
    data.update(edit)
    (folder / "config.json").write_text(json.dumps(data))
    with pytest.raises(ValueError) as e:
        hf.check_hf_folder(folder, kimi_linear_config("debug"))
    assert message in str(e.value) and "\n" not in str(e.value)


def test_missing_or_truncated_safetensors_are_named(hf_folder, tmp_path):
    import shutil

    folder = tmp_path / "hf"
    shutil.copytree(hf_folder, folder)
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="model.safetensors"):
        hf.check_hf_folder(folder, kimi_linear_config("debug"))
    weights.unlink()
    with pytest.raises(ValueError, match=r"no \*\.safetensors weights"):
        hf.check_hf_folder(folder, kimi_linear_config("debug"))


def test_export_loads_in_transformers_with_equal_logits(tmp_path):
    """The recipe's HF export (``hf.write_hf_folder``, what ``scripts/export_hf.py`` writes):
    transformers' ``from_pretrained`` reads it with no missing or unexpected weights and its
    logits equal the recipe's; the recipe's folder check accepts it (dense layer under mlp.)."""
    cfg = kimi_linear_config("debug")
    torch.manual_seed(3)
    model = cfg.build()
    model.init_states()
    with torch.no_grad():  # a nonzero expert bias, as after training
        for m in model.modules():
            if getattr(m, "expert_bias_E", None) is not None:
                m.expert_bias_E.uniform_(-0.05, 0.05)
    model.eval()
    folder = hf.write_hf_folder(model, cfg, tmp_path / "hf", tokenizer_dir=None)
    assert hf.check_hf_folder(folder, cfg) == "mlp"
    ref, info = KimiLinearForCausalLM.from_pretrained(str(folder), output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    tokens = torch.randint(0, DEBUG["vocab_size"], (1, 80))
    with torch.no_grad():
        got = model(tokens)
    assert (got - _hf_logits(ref.eval(), tokens)).abs().max() < LOGITS_ATOL


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_export_script_output_runs_in_transformers_eager_and_sdpa(tmp_path, capsys, attention):
    """``scripts/export_hf.py`` on a Kimi Linear step of the debug flavor (4 MLA heads, not the
    48B flavor's 32): transformers runs the export with either attention and its logits equal
    the recipe's. Before, config.json had no num_key_value_heads, transformers took its default
    of 32 and made 4 // 32 = 0 key/value groups: eager attention crashed ("The size of tensor
    a (4) must match the size of tensor b (0) at non-singleton dimension 1"); sdpa happened to
    skip the repeat."""
    import torch.distributed.checkpoint as dcp

    from tests.test_export_hf import _export_main
    from torchtitan_cp.models import recipe_model_spec
    from torchtitan_cp.run.manifest import write_manifest
    from torchtitan_cp.train import load_config

    argv = ["--config_file", "configs/kimi_linear_debug_cpu.toml"]
    torch.manual_seed(4)
    model = recipe_model_spec(load_config(argv).model).model.build()
    model.init_states()
    with torch.no_grad():  # a nonzero expert bias, as after training
        for m in model.modules():
            if getattr(m, "expert_bias_E", None) is not None:
                m.expert_bias_E.uniform_(-0.05, 0.05)
    step = tmp_path / "checkpoint" / "step-1"
    dcp.save(
        {k: v.detach().clone() for k, v in model.state_dict().items()}, checkpoint_id=str(step)
    )
    write_manifest(str(step), step=1, run_id="r")
    out = tmp_path / "hf"
    assert _export_main()([*argv, "--checkpoint", str(step), "--out", str(out)]) == 0, (
        capsys.readouterr().err
    )
    config = json.loads((out / "config.json").read_text())
    assert config["num_attention_heads"] == config["num_key_value_heads"] == 4
    ref = KimiLinearForCausalLM.from_pretrained(str(out), attn_implementation=attention).eval()
    assert ref.config._attn_implementation == attention
    tokens = torch.randint(
        0, config["vocab_size"], (1, 72), generator=torch.Generator().manual_seed(2)
    )
    with torch.no_grad():
        got = model.eval()(tokens)
    err = (got - _hf_logits(ref, tokens)).abs().max().item()
    print(f"{attention}: max |logits diff| {err:.3g}")
    assert err < LOGITS_ATOL


def test_a_folder_transformers_would_group_wrongly_is_refused_on_import(hf_folder, tmp_path):
    """The folder check compares what the export writes: a config.json without
    num_key_value_heads (the old export's) makes transformers group 4 heads by its default of
    32, so the import names it; null is num_attention_heads, as transformers reads it."""
    import shutil

    folder = tmp_path / "hf"
    shutil.copytree(hf_folder, folder)
    data = json.loads((folder / "config.json").read_text())
    cfg = kimi_linear_config("debug")
    for value, ok in ((None, True), (2, False)):
        (folder / "config.json").write_text(json.dumps({**data, "num_key_value_heads": value}))
        assert (
            hf.config_mismatch(json.loads((folder / "config.json").read_text()), cfg) is None
        ) is ok
    del data["num_key_value_heads"]
    (folder / "config.json").write_text(json.dumps(data))
    with pytest.raises(ValueError) as e:
        hf.check_hf_folder(folder, cfg)
    assert str(e.value) == (
        f"{folder}/config.json: num_key_value_heads is absent, so transformers uses 32, but "
        "the model flavor has 4"
    )
