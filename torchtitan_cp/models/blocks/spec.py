"""The ``ModelSpec`` every model of this recipe hands torchtitan's trainer (the hybrid decoder,
Qwen3.5, Kimi Linear): what differs between them is the model config, the parallelize
function and, for models with HF checkpoints and MoE layers, the state-dict adapter and the
expert-bias hook. And what the recipe knows of a model beside its spec (``RecipeModel``, one
entry of ``models.recipe.MODELS``, written by the model's package): the ``[model]`` keys it
takes, its check against the run's configuration, and its Hugging Face folders."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchtitan.protocols.model_spec import ModelSpec

__all__ = ["HFFolders", "RecipeModel", "recipe_spec"]


@dataclass(frozen=True)
class HFFolders:
    """How a model reads and writes Hugging Face folders (its package's ``hf.py``)."""

    check: Callable[[str | Path, Any], Any]
    """``check(path, model_cfg)``: a one-line ValueError when the folder cannot hold weights for
    the model (its config.json, its safetensors files)."""
    write: Callable[..., Path]
    """``write(model, model_cfg, path, *, tokenizer_dir)``: the model's weights, config.json and
    the tokenizer files of ``tokenizer_dir`` as a folder transformers reads."""
    reader: Callable[[ModelSpec, str], ModelSpec] | None = None
    """``reader(spec, path)``: checks the folder and returns the spec whose state-dict adapter
    reads it (a folder's own tensor names); None: ``check``, and the spec as it is."""

    def read(self, spec: ModelSpec, path: str) -> ModelSpec:
        """The spec that loads the HF folder ``path`` into ``spec``'s model, once the folder is
        checked (``checkpoint.initial_load_in_hf``)."""
        if self.reader is not None:
            return self.reader(spec, path)
        self.check(path, spec.model)
        return spec


def _no_run_check(model_cfg: Any, config: Any) -> None:
    """A model every run configuration that passes the common checks can train."""


@dataclass(frozen=True)
class RecipeModel:
    """One entry of ``models.recipe.MODELS``: what the recipe knows of a model, all of it from
    the model's own package (its ``spec.py`` or ``flavors.py``). The registry's key is the
    model's ``[model] name``."""

    spec: Callable[..., ModelSpec]
    """``spec(flavor, **keys)``: torchtitan's ``ModelSpec`` of ``flavor`` with the ``[model]``
    keys that were set (``settable``)."""
    settable: tuple[str, ...] | None = None
    """The ``[model]`` keys besides ``name`` and ``flavor`` that this model takes, in the order
    its errors list them (its flavor fixes the rest of the architecture); None: every field of
    the hybrid decoder's config (``[model]`` sizes the whole model)."""
    check: Callable[[Any, Any], None] = _no_run_check
    """``check(model_cfg, config)``: a ValueError naming the key where the model cannot run
    with the run's configuration (parallelism degrees, compile, ...)."""
    hf: HFFolders | None = None
    """Its Hugging Face folders (``checkpoint.initial_load_in_hf``, ``python -m
    torchtitan_cp.export_hf``); None: the model has none."""
    stage_plan: Callable[[Any, int, int, str], Any] | None = None
    """``stage_plan(model_cfg, n_stages, seq_len, split)``: where its pipeline stages fall
    (``blocks.pipeline.StagePlan``; ``split``: ``parallelism.pipeline_parallel_split``), for
    the config check and ``--check``; None: the model has no pipeline parallelism."""

    def takes(self, key: str, decoder_fields: set[str]) -> bool:
        """Whether ``[model] key`` applies to this model."""
        return key in self.settable if self.settable is not None else key in decoder_fields


def recipe_spec(
    name: str,
    flavor: str,
    model: Any,
    parallelize_fn: Callable[..., Any],
    *,
    moe: bool = False,
    state_dict_adapter: Any = None,
    pipelining_fn: Callable[..., Any] | None = None,
) -> ModelSpec:
    """torchtitan's ``ModelSpec`` of model ``name`` / ``flavor`` with config ``model``.

    ``pipelining_fn``: how the model is split into pipeline stages (``blocks.pipeline``);
    None: the model has no pipeline parallelism (the config check refuses
    ``pipeline_parallel_degree`` > 1). ``moe``: the model has MoE routers whose
    aux-free expert bias (HF's ``e_score_correction_bias``) is trained as DeepSeek-V3's, by
    torchtitan's step pre-hook that moves it by the sign of each expert's load (without it the
    bias never moves; a no-op for a flavor without MoE layers)."""
    hook = None
    if moe:
        # imported here: torchtitan's optimizer module is not needed to build the hybrid's spec
        from torchtitan.components.optimizer import register_moe_load_balancing_hook

        hook = register_moe_load_balancing_hook
    return ModelSpec(
        name=name,
        flavor=flavor,
        model=model,
        parallelize_fn=parallelize_fn,
        pipelining_fn=pipelining_fn,
        post_optimizer_build_fn=hook,
        state_dict_adapter=state_dict_adapter,
    )
