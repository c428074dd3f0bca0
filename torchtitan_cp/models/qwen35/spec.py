"""The ``ModelSpec`` of a Qwen3.5 flavor: the model config, parallelize and HF state-dict adapter."""

from __future__ import annotations

from typing import Any

from torchtitan.models.qwen3_5 import Qwen35StateDictAdapter
from torchtitan.protocols.model_spec import ModelSpec

from torchtitan_cp.models.blocks.spec import recipe_spec
from torchtitan_cp.models.qwen35.model import qwen35_config
from torchtitan_cp.models.qwen35.parallelize import parallelize_qwen35

__all__ = ["qwen35_model_spec"]


def qwen35_model_spec(flavor: str, **kwargs: Any) -> ModelSpec:
    """``ModelSpec`` for torchtitan's Qwen3.5 ``flavor`` through this recipe (kwargs: see
    ``qwen35_config``), with torchtitan's ``Qwen35StateDictAdapter`` for HF checkpoints and its
    MoE load-balancing hook (the expert bias update of the MoE flavors; a no-op for dense ones)."""
    return recipe_spec(
        "qwen3_5", flavor, qwen35_config(flavor, **kwargs), parallelize_qwen35,
        moe=True, state_dict_adapter=Qwen35StateDictAdapter,
    )  # fmt: skip
