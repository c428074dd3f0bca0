"""The model registry (``models.recipe.MODELS``): a model is its package and one line there,
and nothing else names it: the ``[model]`` keys, the trainer's checks and the HF folders are
looked up in its ``RecipeModel`` (docs/architecture.md, "Adding a model")."""

from __future__ import annotations

import pytest

from torchtitan_cp.models import recipe as recipe_mod
from torchtitan_cp.models.blocks.spec import RecipeModel
from torchtitan_cp.models.hybrid.flavors import model_spec
from torchtitan_cp.models.recipe import ModelRecipe, recipe_model_spec
from torchtitan_cp.trainer.config import ConfigError


def _tiny_spec(flavor: str, **keys):
    # A model of its own flavors, built here from the hybrid decoder's pieces.
    assert flavor == "two-layer"
    return model_spec("debug", layer_pattern="GA", **keys)


def _tiny_check(cfg, config) -> None:
    tp = config.parallelism.tensor_parallel_degree
    if tp > 1:
        raise ValueError(f"parallelism.tensor_parallel_degree = {tp}: tiny has no TP; set it to 1")


TINY = RecipeModel(spec=_tiny_spec, settable=("vocab_size",), check=_tiny_check)
"""A fourth model, registered below by one line."""


@pytest.fixture
def tiny(monkeypatch):
    monkeypatch.setitem(recipe_mod.MODELS, "tiny", f"{__name__}:TINY")


def test_a_new_model_is_one_registry_line(tiny):
    spec = recipe_model_spec(ModelRecipe(name="tiny", flavor="two-layer", vocab_size=97))
    assert spec.model.layer_pattern == "GA" and spec.model.vocab_size == 97
    with pytest.raises(
        ValueError,
        match=r"model.dim does not apply to tiny \(its flavor fixes "
        r"the architecture; settable: vocab_size\)",
    ):
        recipe_model_spec(ModelRecipe(name="tiny", flavor="two-layer", dim=32))
    # the models that take a key are read from the registry too
    with pytest.raises(
        ValueError,
        match=r"model.n_layers applies to model.name = 'qwen3_5' or "
        r"'kimi_linear' only",
    ):
        recipe_model_spec(ModelRecipe(n_layers=2))
    with pytest.raises(ValueError, match=r"choose 'hybrid', 'qwen3_5', 'kimi_linear' or 'tiny'"):
        recipe_model_spec(ModelRecipe(name="nope"))


def test_the_trainer_checks_a_new_model_by_its_entry(tiny):
    from torchtitan_cp.trainer.trainer import recipe_config
    from torchtitan_cp.trainer.validate import check_model

    config = recipe_config()
    config.model = ModelRecipe(name="tiny", flavor="two-layer")
    spec, flex = check_model(config)
    assert spec.model.layer_pattern == "GA" and flex is False
    config.parallelism.tensor_parallel_degree = 2
    with pytest.raises(ConfigError, match="tensor_parallel_degree = 2: tiny has no TP"):
        check_model(config)
