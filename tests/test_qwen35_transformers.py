"""Real Qwen3.5 folders: written by transformers' own config classes and ``save_pretrained``
(random weights at the recipe's debug sizes, no network), checked and loaded through the recipe,
and compared with transformers' own forward; the recipe's export read back by transformers.

transformers is a test-only dependency (the ``dev`` extra). On CPU its Qwen3.5 would call
fla-core's Triton kernels (fla is installed for the recipe), which need a GPU: the tests
point its module-level kernels back at transformers' own PyTorch reference implementations.
"""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path

import pytest
import torch

from torchtitan_cp import compat

compat.apply()

import transformers.models.qwen3_5.modeling_qwen3_5 as hf_modeling  # noqa: E402
from torchtitan.distributed.utils import set_spmd_backend  # noqa: E402
from transformers import (  # noqa: E402
    AutoConfig,
    AutoModelForCausalLM,
    Qwen3_5Config,
    Qwen3_5ForCausalLM,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
    Qwen3_5VisionConfig,
)

from tests.helpers import unwrapped  # noqa: E402
from tests.test_qwen35_hf import _initial_hf_load, _load_through_torchtitan  # noqa: E402
from torchtitan_cp.models.qwen35 import hf  # noqa: E402
from torchtitan_cp.models.qwen35.model import qwen35_config  # noqa: E402

set_spmd_backend("partial_dtensor")

VOCAB = 4096  # the bundled tokenizer, as configs/qwen35_debug_cpu.toml
# torchtitan's debugmodel flavor, first 4 layers (3 GatedDeltaNet + 1 gated attention).
DEBUG_TEXT = dict(
    vocab_size=VOCAB,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 1e7,
        "partial_rotary_factor": 0.25,
        "mrope_section": [3, 3, 2],
        "mrope_interleaved": True,
    },
)
TINY_VISION = dict(depth=1, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=256)
# float32 forward of two implementations (different kernels and summation orders) on logits of
# magnitude ~2: measured max |diff| ~2.4e-6.
LOGITS_ATOL = 5e-5


def torch_reference_kernels() -> contextlib.AbstractContextManager[None]:
    """transformers' PyTorch delta rule and conv instead of fla's Triton kernels (GPU only)."""
    names = (
        "torch_chunk_gated_delta_rule",
        "torch_recurrent_gated_delta_rule",
        "causal_conv1d_fn",
        "causal_conv1d_update",
    )
    return unwrapped(hf_modeling, names)


@pytest.fixture(autouse=True)
def _torch_reference_kernels():
    with torch_reference_kernels():
        yield


def _cfg(tied: bool = False, vision: bool = False):
    return qwen35_config(
        "debugmodel",
        n_layers=4,
        vocab_size=VOCAB,
        attention_backend="sdpa",
        enable_weight_tying=tied,
        vision=vision,
    )


def _perturb(model: torch.nn.Module, seed: int) -> None:
    """Zero-initialised norms and biases would hide a mis-mapped key."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=g, dtype=p.dtype))


def _transformers_folder(
    path: Path, *, tied: bool = False, **text
) -> Qwen3_5ForConditionalGeneration:
    """A ``Qwen3_5ForConditionalGeneration`` (the published checkpoints' class) with random
    weights, written by its own ``save_pretrained``."""
    config = Qwen3_5Config(
        text_config={**DEBUG_TEXT, **text}, vision_config=TINY_VISION, tie_word_embeddings=tied
    )
    torch.manual_seed(0)
    model = Qwen3_5ForConditionalGeneration(config).eval()
    _perturb(model, 0)
    model.save_pretrained(path)
    return model


def _tokens(seed: int = 3) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 64), generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------- reading config.json


def test_defaults_are_transformers_defaults():
    """A field absent from config.json means transformers' default: the tables in hf.py are
    transformers 5.23's (a new transformers that changes one fails here)."""
    text, moe, vision = Qwen3_5TextConfig(), Qwen3_5MoeTextConfig(), Qwen3_5VisionConfig()
    assert {k: getattr(text, k) for k in hf.TEXT_DEFAULTS} == hf.TEXT_DEFAULTS
    assert {k: getattr(moe, k) for k in hf.MOE_DEFAULTS} == hf.MOE_DEFAULTS
    assert {k: getattr(vision, k) for k in hf.VISION_DEFAULTS} == hf.VISION_DEFAULTS
    rotary = hf_modeling.Qwen3_5TextRotaryEmbedding(text)
    assert {**text.rope_parameters, "mrope_section": rotary.mrope_section} == hf.ROPE_DEFAULTS
    assert text.layer_types[:4] == ["linear_attention"] * 3 + ["full_attention"]


def _layouts(tmp: Path) -> dict[str, dict]:
    """config.json files in every layout transformers reads."""
    Qwen3_5Config(text_config=DEBUG_TEXT, vision_config=TINY_VISION).save_pretrained(tmp / "vlm")
    Qwen3_5TextConfig(**DEBUG_TEXT).save_pretrained(tmp / "text")
    legacy = {k: v for k, v in DEBUG_TEXT.items() if k != "rope_parameters"}
    return {
        "save_pretrained-multimodal": json.loads((tmp / "vlm" / "config.json").read_text()),
        "save_pretrained-text": json.loads((tmp / "text" / "config.json").read_text()),
        # Qwen3-VL-era keys: theta and factor at the top, mrope in rope_scaling (legacy "type").
        "legacy-rope_scaling": {
            "model_type": "qwen3_5",
            "tie_word_embeddings": True,
            "text_config": {
                **legacy,
                "rope_theta": 5e6,
                "partial_rotary_factor": 0.5,
                "rope_scaling": {"type": "default", "mrope_section": [1, 2, 3]},
            },
        },  # fmt: skip # a table, laid out by hand to read across
        # rope_scaling wins over rope_parameters; the top-level theta fills it in.
        "both-rope-dicts": {
            "model_type": "qwen3_5_text",
            **legacy,
            "rope_theta": 3.0,
            "rope_parameters": {"rope_theta": 7.0},
            "rope_scaling": {"mrope_section": [4, 2, 2]},
        },  # fmt: skip # a table, laid out by hand to read across
        # text_config's own tie flag is not the one Qwen3_5ForConditionalGeneration reads.
        "nested-tie-only-in-text": {
            "model_type": "qwen3_5",
            "text_config": {**DEBUG_TEXT, "tie_word_embeddings": True},
        },
        "interval-no-layer-types": {
            "model_type": "qwen3_5_text",
            "num_hidden_layers": 6,
            "full_attention_interval": 3,
        },  # fmt: skip # a table, laid out by hand to read across
        "all-defaults": {"model_type": "qwen3_5_text"},
    }


def test_reads_every_layout_as_transformers_does(tmp_path):
    for name, config in _layouts(tmp_path).items():
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(config))
        top = AutoConfig.from_pretrained(folder)
        text = top.get_text_config()
        want = {k: getattr(text, k) for k in {**hf.TEXT_DEFAULTS, "layer_types": 0}}
        want["tie_word_embeddings"] = top.tie_word_embeddings  # the flag the model class reads
        rotary = hf_modeling.Qwen3_5TextRotaryEmbedding(text)
        want.update(
            {
                k: text.rope_parameters[k]
                for k in ("rope_type", "rope_theta", "partial_rotary_factor")
            }
        )
        want["mrope_section"] = rotary.mrope_section
        got = {k: v.value for k, v in hf.read_text_config(config).items() if k in want}
        assert got == want, name


# ------------------------------------------------------ transformers' folders, the recipe's model


@pytest.mark.parametrize("tied", [False, True])
def test_transformers_folder_loads_with_transformers_logits(tmp_path, tied):
    """A folder from ``Qwen3_5ForConditionalGeneration.save_pretrained`` passes the check and
    loads through torchtitan's HF checkpoint loading into the recipe's model, whose logits
    match transformers' forward on the same tokens (float32, max |diff| <= LOGITS_ATOL)."""
    theirs = _transformers_folder(tmp_path, tied=tied)
    cfg = _cfg(tied)
    hf.check_hf_folder(tmp_path, cfg)
    torch.manual_seed(1)
    ours = cfg.build()
    ours.init_states()
    tokens = _tokens()
    with torch.no_grad():
        want = theirs(input_ids=tokens).logits
        assert (ours(tokens) - want).abs().max() > 0.1  # not loaded yet: far off
        _load_through_torchtitan(ours, tmp_path)
        err = (ours(tokens) - want).abs().max().item()
    print(
        f"tied={tied}: max |logits - transformers| = {err:.2e} (logits up to "
        f"{want.abs().max():.2f})"
    )
    assert err <= LOGITS_ATOL


MISMATCHES = [
    # (text_config change, the start of the line naming it)
    ({"hidden_size": 128}, "text_config.hidden_size is 128 but the model flavor has 256"),
    ({"num_hidden_layers": 8}, "text_config.num_hidden_layers is 8 but"),
    (
        {"layer_types": ["linear_attention"] * 2 + ["full_attention"] * 2},
        "text_config.layer_types is ['linear_attention', 'linear_attention', 'full_attention'",
    ),
    ({"vocab_size": 5000}, "text_config.vocab_size is 5000 but the model flavor has 4096 (set"),
    ({"intermediate_size": 1024}, "text_config.intermediate_size is 1024 but"),
    ({"hidden_act": "gelu"}, "text_config.hidden_act is 'gelu' but the model flavor has 'silu'"),
    ({"rms_norm_eps": 1e-5}, "text_config.rms_norm_eps is 1e-05 but the model flavor has 1e-06"),
    ({"num_attention_heads": 8}, "text_config.num_attention_heads is 8 but"),
    ({"num_key_value_heads": 4}, "text_config.num_key_value_heads is 4 but"),
    ({"head_dim": 32}, "text_config.head_dim is 32 but"),
    ({"attention_bias": True}, "text_config.attention_bias is True but the model flavor has False"),
    (
        {
            "rope_parameters": {
                **DEBUG_TEXT["rope_parameters"],
                "rope_type": "linear",
                "factor": 2.0,
            }
        },
        "text_config.rope_parameters.rope_type is 'linear' but the model flavor has 'default'",
    ),
    (
        {"rope_parameters": {**DEBUG_TEXT["rope_parameters"], "rope_theta": 1e6}},
        "text_config.rope_parameters.rope_theta is 1000000.0 but the model flavor has 10000000.0",
    ),
    (
        {"rope_parameters": {**DEBUG_TEXT["rope_parameters"], "partial_rotary_factor": 0.5}},
        "text_config.rope_parameters.partial_rotary_factor is 0.5 but the model flavor has 0.25",
    ),
    (
        {"rope_parameters": {**DEBUG_TEXT["rope_parameters"], "mrope_section": [4, 2, 2]}},
        "text_config.rope_parameters.mrope_section is [4, 2, 2] but the model flavor has [3, 3, 2]",
    ),
    (
        {
            "rope_parameters": {
                "rope_type": "default",
                "partial_rotary_factor": 0.25,
                "mrope_section": [3, 3, 2],
            }
        },  # fmt: skip # a table, laid out by hand to read across
        "text_config.rope_parameters.rope_theta is absent, so transformers uses 10000.0, but the "
        "model flavor has 10000000.0",
    ),
    ({"linear_num_key_heads": 4}, "text_config.linear_num_key_heads is 4 but"),
    ({"linear_num_value_heads": 8}, "text_config.linear_num_value_heads is 8 but"),
    ({"linear_key_head_dim": 32}, "text_config.linear_key_head_dim is 32 but"),
    ({"linear_value_head_dim": 32}, "text_config.linear_value_head_dim is 32 but"),
    ({"linear_conv_kernel_dim": 2}, "text_config.linear_conv_kernel_dim is 2 but"),
    (
        {"tie": True},
        "tie_word_embeddings is True but the model flavor has False (set [model] "
        "enable_weight_tying to match)",
    ),
]


def test_each_mismatching_field_is_one_line(tmp_path):
    """Every field that changes the computation, changed alone in a real folder's config.json,
    is refused with one line naming it (where transformers reads it) and both values."""
    _transformers_folder(tmp_path)
    cfg_file = tmp_path / "config.json"
    good = json.loads(cfg_file.read_text())
    cfg = _cfg()
    hf.check_hf_folder(tmp_path, cfg)
    for change, needle in MISMATCHES:
        bad = json.loads(json.dumps(good))
        if "tie" in change:
            bad["tie_word_embeddings"] = True
        else:
            bad["text_config"].update(change)
        cfg_file.write_text(json.dumps(bad))
        with pytest.raises(ValueError) as e:
            hf.check_hf_folder(tmp_path, cfg)
        msg = str(e.value)
        assert msg.startswith(f"{cfg_file}: {needle}") and "\n" not in msg, (change, msg)
    bad = {**good, "model_type": "qwen3_next"}
    cfg_file.write_text(json.dumps(bad))
    with pytest.raises(ValueError, match=r"model_type is 'qwen3_next' but the model flavor is a "):
        hf.check_hf_folder(tmp_path, cfg)


def test_mismatch_is_refused_before_launch(tmp_path):
    """Through the configuration load that ``train.sh --check`` and every rank run."""
    from torchtitan_cp.train import load_config
    from torchtitan_cp.trainer.config import ConfigError

    _transformers_folder(
        tmp_path, rope_parameters={**DEBUG_TEXT["rope_parameters"], "rope_theta": 1e6}
    )
    with pytest.raises(ConfigError, match=r"rope_parameters.rope_theta is 1000000.0 but"):
        load_config(_initial_hf_load(tmp_path))


def test_text_layout_weights_are_refused_by_name(tmp_path):
    """``Qwen3_5ForCausalLM.save_pretrained`` names weights ``model.layers.*``; torchtitan's
    adapter reads the published layout ``model.language_model.*``: one line, not a DCP
    traceback at load time."""
    torch.manual_seed(0)
    Qwen3_5ForCausalLM(Qwen3_5TextConfig(**DEBUG_TEXT)).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"model\.layers\.\* .*model\.language_model\.\*") as e:
        hf.check_hf_folder(tmp_path, _cfg())
    assert "\n" not in str(e.value)


# ------------------------------------------------------ the recipe's export, read by transformers


@pytest.mark.parametrize("tied", [False, True])
def test_export_reads_back_in_transformers_with_the_same_logits(tmp_path, tied):
    """The text-only export (``Qwen3_5ForCausalLM``, ``qwen3_5_text``): ``from_pretrained``
    rebuilds the model with every weight from the folder (none missing, none left
    initialised) and its logits match the recipe's."""
    cfg = _cfg(tied)
    torch.manual_seed(0)
    ours = cfg.build()
    ours.init_states()
    _perturb(ours, 1)
    hf.write_hf_folder(ours, cfg, tmp_path, tokenizer_dir=None)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5ForCausalLM"] and "vision_config" not in config
    assert config["rope_parameters"]["mrope_section"] == [3, 3, 2]
    theirs, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert type(theirs) is Qwen3_5ForCausalLM
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    tokens = _tokens(5)
    with torch.no_grad():
        err = (ours(tokens) - theirs.eval()(input_ids=tokens).logits).abs().max().item()
    print(f"tied={tied}: export -> transformers, max |logits diff| = {err:.2e}")
    assert err <= LOGITS_ATOL
    hf.check_hf_folder(tmp_path, cfg)  # and the recipe reads its own export


def test_vision_export_declares_the_vision_tower(tmp_path):
    """With ``[model] vision = true`` the export is a ``Qwen3_5ForConditionalGeneration`` with
    its ``vision_config``: transformers loads every weight, vision tower included, unchanged."""
    from safetensors.torch import load_file

    cfg = _cfg(vision=True)
    torch.manual_seed(0)
    ours = cfg.build()
    ours.init_states()
    _perturb(ours, 2)
    hf.write_hf_folder(ours, cfg, tmp_path, tokenizer_dir=None)
    theirs, info = Qwen3_5ForConditionalGeneration.from_pretrained(
        tmp_path, output_loading_info=True
    )
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    written = load_file(str(tmp_path / "model.safetensors"))
    loaded = theirs.state_dict()
    assert any(k.startswith("model.visual.") for k in written)
    for key, tensor in written.items():
        assert torch.equal(loaded[key], tensor), key
    hf.check_hf_folder(tmp_path, cfg)
    with pytest.raises(ValueError, match="vision_config.depth is 1 but the model flavor has 4"):
        _transformers_folder(tmp_path / "t")
        hf.check_hf_folder(tmp_path / "t", cfg)


# ------------------------------------------------------------ through the public commands


@pytest.mark.slow
def test_readme_command_starts_from_a_transformers_folder(tmp_path):
    """README: ``./scripts/train.sh configs/qwen35_debug_cpu.toml --checkpoint.initial_load_path
    DIR ...`` from a ``save_pretrained`` folder, CP=2 on 2 ranks. Its ``lm_head`` is zeroed, so
    the first loss is ln(vocab) exactly when the folder's weights are in effect (a fresh start
    is not); the second step trains on. (The export back to transformers through
    ``scripts/export_hf.py``: tests/test_qwen35_hf.py, the slow round trip.)"""
    from tests.launch import read_metrics, train_sh

    folder = tmp_path / "hf"
    model = _transformers_folder(folder)
    with torch.no_grad():
        model.lm_head.weight.zero_()
    model.save_pretrained(folder)
    run = tmp_path / "run"
    train_sh(
        [
            "configs/qwen35_debug_cpu.toml",
            "--checkpoint.initial_load_path",
            str(folder),
            "--checkpoint.enable",
            "--checkpoint.initial_load_in_hf",
            "--checkpoint.initial_load_model_only",
            "--training.steps",
            "2",
            "--parallelism.context_parallel_degree",
            "2",
            "--validator.no-enable",
            "--metrics.no-enable-wandb",
            "--dump_folder",
            str(run),
        ]
    )
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == [1, 2]
    assert abs(rows[0]["loss"] - math.log(VOCAB)) < 1e-5, rows[0]["loss"]
    assert math.isfinite(rows[1]["loss"]) and rows[1]["loss"] != rows[0]["loss"]
