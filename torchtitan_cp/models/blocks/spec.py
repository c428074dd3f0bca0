"""The ``ModelSpec`` every model of this recipe hands torchtitan's trainer (the hybrid decoder,
Qwen3.5, Kimi Linear): what differs between them is the model config, the parallelize
function and, for models with HF checkpoints and MoE layers, the state-dict adapter and the
expert-bias hook."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torchtitan.protocols.model_spec import ModelSpec

__all__ = ["recipe_spec"]


def recipe_spec(
    name: str,
    flavor: str,
    model: Any,
    parallelize_fn: Callable[..., Any],
    *,
    moe: bool = False,
    state_dict_adapter: Any = None,
) -> ModelSpec:
    """torchtitan's ``ModelSpec`` of model ``name`` / ``flavor`` with config ``model``.

    No pipelining (``pipelining_fn`` None: no model here is split into stages; the config check
    refuses ``pipeline_parallel_degree`` > 1). ``moe``: the model has MoE routers whose
    aux-free expert bias (HF's ``e_score_correction_bias``) is trained as DeepSeek-V3's, by
    torchtitan's step pre-hook that moves it by the sign of each expert's load (without it the
    bias never moves; a no-op for a flavor without MoE layers)."""
    hook = None
    if moe:
        # imported here: torchtitan's optimizer module is not needed to build the hybrid's spec
        from torchtitan.components.optimizer import register_moe_load_balancing_hook

        hook = register_moe_load_balancing_hook
    return ModelSpec(
        name=name, flavor=flavor, model=model, parallelize_fn=parallelize_fn, pipelining_fn=None,
        post_optimizer_build_fn=hook, state_dict_adapter=state_dict_adapter,
    )  # fmt: skip
