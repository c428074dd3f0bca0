"""The ``ModelSpec`` of a Qwen3.5 flavor: the model config, parallelize and HF state-dict adapter."""

from __future__ import annotations

from typing import Any

from torchtitan.components.optimizer import register_moe_load_balancing_hook
from torchtitan.models.qwen3_5 import Qwen35StateDictAdapter
from torchtitan.protocols.model_spec import ModelSpec

from torchtitan_cp.models.qwen35.model import qwen35_config
from torchtitan_cp.models.qwen35.parallelize import parallelize_qwen35

__all__ = ["qwen35_model_spec"]


def qwen35_model_spec(flavor: str, **kwargs: Any):
    """``ModelSpec`` for torchtitan's Qwen3.5 ``flavor`` through this recipe (kwargs: see
    ``qwen35_config``), with torchtitan's ``Qwen35StateDictAdapter`` for HF checkpoints and its
    MoE load-balancing hook (the expert bias update of the MoE flavors; a no-op for dense ones)."""
    return ModelSpec(
        name="qwen3_5",
        flavor=flavor,
        model=qwen35_config(flavor, **kwargs),
        parallelize_fn=parallelize_qwen35,
        pipelining_fn=None,
        # as upstream's qwen3_5 spec: without it the MoE routers' expert bias never moves
        post_optimizer_build_fn=register_moe_load_balancing_hook,
        state_dict_adapter=Qwen35StateDictAdapter,
    )
