"""Kimi Linear through the recipe: ``[model] name = "kimi_linear"`` picks its spec, the flavors
have the published sizes, and what is not built yet is a one-line config error naming the key
(logits against transformers: tests/test_kimi_linear_transformers.py)."""

from __future__ import annotations

import pytest
import torch

from torchtitan_cp import compat

compat.apply()

from torchtitan_cp.models import recipe_model_spec  # noqa: E402
from torchtitan_cp.models.kimi_linear.model import (  # noqa: E402
    KimiLinearModel,
    kimi_linear_config,
    layer_types,
)
from torchtitan_cp.models.mixers.delta_net import KDAMixer  # noqa: E402
from torchtitan_cp.models.recipe import ModelRecipe  # noqa: E402
from torchtitan_cp.trainer.config import ConfigError  # noqa: E402

CONFIG = "configs/kimi_linear_debug_cpu.toml"


def test_recipe_selects_kimi_linear_from_model_name():
    spec = recipe_model_spec(ModelRecipe(name="kimi_linear", flavor="debug", vocab_size=4096))
    assert spec.name == "kimi_linear" and isinstance(spec.model, KimiLinearModel.Config)
    assert spec.model.vocab_size == 4096 and spec.model.conv_width == 4
    assert layer_types(spec.model) == ["linear_attention"] * 3 + ["full_attention"]
    kda = spec.model.layers[0].kda
    assert isinstance(kda, KDAMixer.Config)
    assert kda.qk_norm == "fla" and not kda.output_gate_bias  # Kimi's variant of the mixer
    assert spec.model.layers[0].moe is None and spec.model.layers[1].moe is not None
    assert spec.state_dict_adapter.__name__ == "KimiLinearStateDictAdapter"


def test_48b_flavor_has_the_published_sizes():
    """27 layers, MLA at 4, 8, ..., 24, 27 (1-indexed: the published config.json's
    linear_attn_config.full_attn_layers), 256 experts top-8 + 1 shared: 49.1e9
    parameters counted on the meta device (published: "48B total")."""
    cfg = kimi_linear_config("48B-A3B")
    types = layer_types(cfg)
    assert len(types) == 27 and [i + 1 for i, t in enumerate(types) if t == "full_attention"] == [
        4, 8, 12, 16, 20, 24, 27,
    ]  # fmt: skip # a table, laid out by hand to read across
    with torch.device("meta"):
        model = cfg.build()
    n, _ = cfg.get_nparams_and_flops(model, 4096)
    assert 48e9 < n < 50e9


@pytest.mark.parametrize(
    "recipe, message",
    [
        (
            dict(flavor="debugmodel"),
            "unknown model.flavor 'debugmodel' for model.name 'kimi_linear'",
        ),
        (dict(flavor="debug", layer_pattern="KKA"), "model.layer_pattern does not apply to kimi"),
        (dict(flavor="debug", n_layers=9), "model.n_layers must be in [1, 4]"),
        (dict(flavor="debug", vision=True), "model.vision does not apply to kimi_linear"),
    ],
)
def test_bad_kimi_linear_recipes_are_one_line_errors(recipe, message):
    with pytest.raises(ValueError) as e:
        recipe_model_spec(ModelRecipe(name="kimi_linear", **recipe))
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--parallelism.tensor_parallel_degree", "2"],
            "parallelism.tensor_parallel_degree = 2 is not supported for model.name = "
            "'kimi_linear' yet",
        ),
        (
            ["--parallelism.expert_parallel_degree", "3"],
            "parallelism.expert_parallel_degree = 3 does not divide the 8 experts of kimi_linear",
        ),
        (["--compile.enable"], "compile.enable is not supported for model.name = 'kimi_linear'"),
    ],
)
def test_what_is_not_built_is_refused_in_one_line(argv, message):
    from torchtitan_cp.train import load_config

    with pytest.raises(ConfigError) as e:
        load_config(["--config_file", CONFIG, *argv])
    assert message in str(e.value) and "\n" not in str(e.value)
    assert load_config(["--config_file", CONFIG]).model.name == "kimi_linear"
    cp = load_config(["--config_file", CONFIG, "--parallelism.context_parallel_degree", "2"])
    assert cp.parallelism.context_parallel_degree == 2  # CP runs (tests/test_kimi_linear_cp.py)
    ep = load_config(
        [
            "--config_file",
            CONFIG,
            "--parallelism.context_parallel_degree",
            "2",
            "--parallelism.expert_parallel_degree",
            "2",
        ]
    )
    assert ep.parallelism.expert_parallel_degree == 2  # EP runs (tests/test_kimi_linear_train.py)


def test_hf_folder_of_another_size_is_one_line_before_launch(tmp_path):
    """``--checkpoint.initial_load_in_hf`` from a Kimi Linear folder of another vocabulary: the
    config check names the field and both values (the CLI exits 2 with it)."""
    from torchtitan_cp.models.kimi_linear import hf
    from torchtitan_cp.train import load_config

    cfg = kimi_linear_config("debug")  # vocabulary 1024; the config file's is 4096
    model = cfg.build()
    model.init_states()
    folder = hf.write_hf_folder(model, cfg, tmp_path / "hf", tokenizer_dir=None)
    argv = [
        "--config_file",
        CONFIG,
        "--checkpoint.enable",
        "--checkpoint.initial_load_in_hf",
        "--checkpoint.initial_load_path",
        str(folder),
    ]
    with pytest.raises(ConfigError) as e:
        load_config(argv)
    msg = str(e.value)
    assert "config.json: vocab_size is 1024 but the model flavor has 4096" in msg
    assert "\n" not in msg
    spec = recipe_model_spec(ModelRecipe(name="kimi_linear", flavor="debug"))
    assert hf.check_hf_folder(folder, spec.model) == "mlp"  # the export's published layout
