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
from typing import Any, Literal

from torchtitan.protocols.model_spec import ModelSpec

from torchtitan_cp.models.hybrid.decoder import HybridDecoder
from torchtitan_cp.models.hybrid.flavors import model_spec

__all__ = ["ModelRecipe", "recipe_model_spec"]

# Keys of [model] that pick the model rather than size it.
_CHOOSERS = ("name", "flavor", "n_layers", "vision")
# Decoder fields set elsewhere (torchtitan's own, or another config section).
_NOT_IN_RECIPE = ("param_init", "sharding_config", "linear_attention_backend")


def _overrides(self: Any) -> dict[str, Any]:
    """The decoder fields this section sets: every key left unset is the flavor's."""
    out = {}
    for f in dataclasses.fields(self):
        value = getattr(self, f.name)
        if f.name in _CHOOSERS or value is None:
            continue
        if dataclasses.is_dataclass(value) and value == type(value)():
            continue  # nested options left at their defaults
        out[f.name] = value
    return out


def _build() -> type:
    hints = typing.get_type_hints(HybridDecoder.Config)
    fields: list[tuple[str, Any, Any]] = [
        ("name", Literal["hybrid", "qwen3_5"], dataclasses.field(default="hybrid")),
        ("flavor", str, dataclasses.field(default="debug")),
        ("n_layers", int | None, dataclasses.field(default=None)),
        ("vision", bool, dataclasses.field(default=False)),
    ]
    for f in dataclasses.fields(HybridDecoder.Config):
        if f.name in _NOT_IN_RECIPE:
            continue
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            fields.append((f.name, tp, dataclasses.field(default_factory=tp)))
        else:
            fields.append((f.name, typing.Optional[tp], dataclasses.field(default=None)))  # noqa: UP045
    cls = dataclasses.make_dataclass(
        "ModelRecipe",
        fields,
        namespace={"overrides": _overrides, "__module__": __name__},
        kw_only=True,
        slots=True,
    )
    cls.__doc__ = (
        "``[model]``: which model to build (name, flavor; n_layers and vision for qwen3_5 "
        "only) and any ``HybridDecoder.Config`` field (unset: the flavor's value)."
    )
    return cls


ModelRecipe = _build()


def recipe_model_spec(recipe: Any) -> ModelSpec:
    """The ``ModelSpec`` that ``[model]`` names: the hybrid decoder or torchtitan's Qwen3.5.
    A key that does not apply to the chosen model is a ValueError naming it."""
    overrides = recipe.overrides()
    if recipe.name == "hybrid":
        if recipe.n_layers is not None or recipe.vision:
            key = "n_layers" if recipe.n_layers is not None else "vision"
            raise ValueError(f"model.{key} applies to model.name = 'qwen3_5' only")
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
    raise ValueError(f"unknown model.name {recipe.name!r}; choose 'hybrid' or 'qwen3_5'")
