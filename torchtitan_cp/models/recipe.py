"""``[model]``: the recipe's model section, generated from ``HybridDecoder.Config``, and the
``ModelSpec`` it names (the hybrid decoder, or torchtitan's Qwen3.5).

Its keys are the four that choose a model (``name``, ``flavor``, ``n_layers``, ``vision``) plus
every field of ``HybridDecoder.Config`` (unset = the flavor's value), so a field added to the
decoder or to a layer kind's options (``models.hybrid.layers.LayerOptions``) is settable from
TOML and the command line with no second declaration here. ``linear_attention_backend`` is the
one exception: ``[linear_attention] backend`` sets it.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any, Literal

from torchtitan.protocols.model_spec import ModelSpec

from torchtitan_cp.models.hybrid.decoder import HybridDecoder
from torchtitan_cp.models.hybrid.flavors import model_spec

__all__ = ["ModelRecipe", "recipe_model_spec"]

# Decoder fields set elsewhere (torchtitan's own, or another config section).
_NOT_IN_RECIPE = ("param_init", "sharding_config", "linear_attention_backend")


def _with_decoder_fields(cls: type) -> type:
    """Add every ``HybridDecoder.Config`` field (but ``_NOT_IN_RECIPE``) to the class ``cls``
    before ``@dataclass`` reads it: optional and unset (None: the flavor's value), or, for a
    nested options dataclass, that dataclass at its defaults."""
    hints = typing.get_type_hints(HybridDecoder.Config)
    for f in dataclasses.fields(HybridDecoder.Config):
        if f.name in _NOT_IN_RECIPE:
            continue
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            cls.__annotations__[f.name] = tp
            setattr(cls, f.name, dataclasses.field(default_factory=tp))
        else:
            cls.__annotations__[f.name] = tp | None
            setattr(cls, f.name, None)
    return cls


@dataclass(kw_only=True, slots=True)
@_with_decoder_fields
class ModelRecipe:
    """``[model]``: which model to build (name, flavor; n_layers for qwen3_5 and kimi_linear,
    vision for qwen3_5 only)
    and any ``HybridDecoder.Config`` field (unset: the flavor's value)."""

    name: Literal["hybrid", "qwen3_5", "kimi_linear"] = "hybrid"
    flavor: str = "debug"
    n_layers: int | None = None
    vision: bool = False

    def overrides(self) -> dict[str, Any]:
        """The decoder fields this section sets: every key left unset is the flavor's (the four
        declared here pick the model rather than size it)."""
        decoder = {f.name for f in dataclasses.fields(HybridDecoder.Config)}
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name not in decoder or value is None:
                continue
            if dataclasses.is_dataclass(value) and value == type(value)():
                continue  # nested options left at their defaults
            out[f.name] = value
        return out


def recipe_model_spec(recipe: Any) -> ModelSpec:
    """The ``ModelSpec`` that ``[model]`` names: the hybrid decoder, torchtitan's Qwen3.5 or
    Kimi Linear.
    A key that does not apply to the chosen model is a ValueError naming it."""
    overrides = recipe.overrides()
    if recipe.name == "hybrid":
        if recipe.n_layers is not None or recipe.vision:
            key = "n_layers" if recipe.n_layers is not None else "vision"
            where = "'qwen3_5' or 'kimi_linear'" if key == "n_layers" else "'qwen3_5'"
            raise ValueError(f"model.{key} applies to model.name = {where} only")
        return model_spec(recipe.flavor, **overrides)
    if recipe.name == "qwen3_5":
        from torchtitan_cp.models.qwen35.spec import qwen35_model_spec

        allowed = ("vocab_size", "attention_backend", "attention_cp", "enable_weight_tying")
        bad = sorted(set(overrides) - set(allowed))
        if bad:
            raise ValueError(
                f"model.{bad[0]} does not apply to qwen3_5 (its flavor fixes the architecture; "
                f"settable: n_layers, vision, {', '.join(allowed)})"
            )
        return qwen35_model_spec(
            recipe.flavor, n_layers=recipe.n_layers, vision=recipe.vision, **overrides
        )
    if recipe.name == "kimi_linear":
        from torchtitan_cp.models.kimi_linear.spec import kimi_linear_model_spec

        allowed = ("vocab_size", "attention_backend", "attention_cp")
        bad = sorted(set(overrides) - set(allowed))
        if recipe.vision or bad:
            key = "vision" if recipe.vision else bad[0]
            raise ValueError(
                f"model.{key} does not apply to kimi_linear (its flavor fixes the architecture; "
                f"settable: n_layers, {', '.join(allowed)})"
            )
        return kimi_linear_model_spec(recipe.flavor, n_layers=recipe.n_layers, **overrides)
    raise ValueError(
        f"unknown model.name {recipe.name!r}; choose 'hybrid', 'qwen3_5' or 'kimi_linear'"
    )
