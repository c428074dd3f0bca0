"""The ``ModelSpec`` of a Kimi Linear flavor: the model config, parallelize and HF adapter."""

from __future__ import annotations

from typing import Any

from torchtitan.protocols.model_spec import ModelSpec

from torchtitan_cp.models.blocks.spec import recipe_spec
from torchtitan_cp.models.kimi_linear.hf import KimiLinearStateDictAdapter
from torchtitan_cp.models.kimi_linear.model import kimi_linear_config
from torchtitan_cp.models.kimi_linear.parallelize import parallelize_kimi_linear

__all__ = ["kimi_linear_model_spec"]


def kimi_linear_model_spec(flavor: str, **kwargs: Any) -> ModelSpec:
    """``ModelSpec`` for Kimi Linear ``flavor`` (kwargs: see ``kimi_linear_config``), with the
    recipe's ``KimiLinearStateDictAdapter`` for HF checkpoints (published dense-layer names;
    the config check swaps in the HF folder's own, ``hf.folder_dense_prefix``) and torchtitan's
    MoE load-balancing hook (the expert bias update)."""
    return recipe_spec(
        "kimi_linear", flavor, kimi_linear_config(flavor, **kwargs), parallelize_kimi_linear,
        moe=True, state_dict_adapter=KimiLinearStateDictAdapter,
    )  # fmt: skip
