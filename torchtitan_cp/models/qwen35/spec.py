"""The ``ModelSpec`` of a Qwen3.5 flavor (the model config, parallelize and HF state-dict
adapter) and Qwen3.5's entry of ``models.recipe.MODELS``."""

from __future__ import annotations

from typing import Any

from torchtitan.models.qwen3_5 import Qwen35StateDictAdapter
from torchtitan.protocols.model_spec import ModelSpec

from torchtitan_cp.models.blocks.spec import HFFolders, RecipeModel, recipe_spec
from torchtitan_cp.models.qwen35.hf import check_hf_folder, write_hf_folder
from torchtitan_cp.models.qwen35.model import check_qwen35_parallelism, qwen35_config
from torchtitan_cp.models.qwen35.parallelize import parallelize_qwen35, pipeline_qwen35
from torchtitan_cp.models.qwen35.stages import stage_plan

__all__ = ["MODEL", "qwen35_model_spec"]


def qwen35_model_spec(flavor: str, **kwargs: Any) -> ModelSpec:
    """``ModelSpec`` for torchtitan's Qwen3.5 ``flavor`` through this recipe (kwargs: see
    ``qwen35_config``), with torchtitan's ``Qwen35StateDictAdapter`` for HF checkpoints and its
    MoE load-balancing hook (the expert bias update of the MoE flavors; a no-op for dense ones)."""
    return recipe_spec(
        "qwen3_5",
        flavor,
        qwen35_config(flavor, **kwargs),
        parallelize_qwen35,
        moe=True,
        state_dict_adapter=Qwen35StateDictAdapter,
        pipelining_fn=pipeline_qwen35,
    )


def check_run(cfg: Any, config: Any) -> None:
    """A ValueError naming the key where Qwen3.5 ``cfg`` cannot run with the run's
    parallelism (``check_qwen35_parallelism``)."""
    check_qwen35_parallelism(cfg, config.parallelism)


MODEL = RecipeModel(
    spec=qwen35_model_spec,
    settable=(
        "n_layers",
        "vision",
        "vocab_size",
        "attention_backend",
        "attention_cp",
        "enable_weight_tying",
    ),
    check=check_run,
    hf=HFFolders(check=check_hf_folder, write=write_hf_folder),
    stage_plan=stage_plan,
)
"""Qwen3.5 in ``MODELS``: its flavor fixes the architecture but for the keys listed."""
