"""``[model]``: the recipe's model section, generated from ``HybridDecoder.Config``, the
registry of the models it can name (``MODELS``) and the ``ModelSpec`` it names.

Its keys are the four that choose a model (``name``, ``flavor``, ``n_layers``, ``vision``) plus
every field of ``HybridDecoder.Config`` (unset = the flavor's value), so a field added to the
decoder or to a layer kind's options (``models.hybrid.layers.LayerOptions``) is settable from
TOML and the command line with no second declaration here. ``linear_attention_backend`` is the
one exception: ``[linear_attention] backend`` sets it.

``MODELS`` maps each ``[model] name`` to its package's ``RecipeModel`` (``models.blocks.spec``):
the spec builder, the keys it takes, its check against the run's configuration and its HF
folders. The trainer's checks and the HF export look models up there; a new model is its
package and one line here. An entry is imported when its name is used (Qwen3.5 needs torch
>= 2.14, the hybrid decoder 2.11).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import textwrap
import typing
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from torchtitan.protocols.model_spec import ModelSpec
from typing_extensions import Doc

from torchtitan_cp import compat
from torchtitan_cp.models.blocks.spec import RecipeModel
from torchtitan_cp.models.hybrid.decoder import HybridDecoder

__all__ = [
    "MODELS",
    "ModelRecipe",
    "choice_text",
    "model_names",
    "recipe_model",
    "recipe_model_spec",
]

MODELS: dict[str, str] = {
    "hybrid": "torchtitan_cp.models.hybrid.flavors:MODEL",
    "qwen3_5": "torchtitan_cp.models.qwen35.spec:MODEL",
    "kimi_linear": "torchtitan_cp.models.kimi_linear.spec:MODEL",
}
"""``[model] name`` -> ``"module:ATTR"``, the model package's ``RecipeModel``."""

ModelName = Literal[tuple(MODELS)]  # pyrefly: ignore[invalid-literal]


def choice_text(names: list[str]) -> str:
    """``'a', 'b' or 'c'``: the names as a message lists them."""
    quoted = [repr(n) for n in names]
    return quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"


def recipe_model(name: str) -> RecipeModel:
    """The registered model ``name`` (``MODELS``); a ValueError naming ``model.name`` else."""
    if name not in MODELS:
        raise ValueError(f"unknown model.name {name!r}; choose {choice_text(list(MODELS))}")
    module, attr = MODELS[name].split(":")
    entry = getattr(importlib.import_module(module), attr)
    assert isinstance(entry, RecipeModel), f"{MODELS[name]} is not a RecipeModel"
    return entry


def model_names(where: typing.Callable[[RecipeModel], bool]) -> list[str]:
    """The registered models, in ``MODELS`` order, whose entry satisfies ``where`` (for
    messages); a model this torch cannot import is left out."""
    names = []
    for name in MODELS:
        try:
            entry = recipe_model(name)
        except compat.TorchVersionError:
            continue
        if where(entry):
            names.append(name)
    return names


def _decoder_fields() -> set[str]:
    return {f.name for f in dataclasses.fields(HybridDecoder.Config)}


# Decoder fields set elsewhere (torchtitan's own, or another config section).
_NOT_IN_RECIPE = ("param_init", "sharding_config", "linear_attention_backend")


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of the class ``cls`` (the string literal that follows its
    annotation, where ``--help`` reads it), from the class's own source."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0]
    assert isinstance(body, ast.ClassDef)
    docs = {}
    for node, after in zip(body.body, body.body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = inspect.cleandoc(after.value.value)
    return docs


def _with_decoder_fields(cls: type) -> type:
    """Add every ``HybridDecoder.Config`` field (but ``_NOT_IN_RECIPE``) to the class ``cls``
    before ``@dataclass`` reads it: optional and unset (None: the flavor's value), or, for a
    nested options dataclass, that dataclass at its defaults. Each keeps the decoder field's
    docstring (``Doc``, which ``--help`` shows)."""
    hints = typing.get_type_hints(HybridDecoder.Config)
    docs = field_docs(HybridDecoder.Config)
    for f in dataclasses.fields(HybridDecoder.Config):
        if f.name in _NOT_IN_RECIPE:
            continue
        tp, doc = hints[f.name], docs.get(f.name, "")
        if dataclasses.is_dataclass(tp):
            cls.__annotations__[f.name] = Annotated[tp, Doc(doc)]
            setattr(cls, f.name, dataclasses.field(default_factory=tp))
        else:
            cls.__annotations__[f.name] = Annotated[tp | None, Doc(f"{doc} Unset: the flavor's.")]
            setattr(cls, f.name, None)
    return cls


@dataclass(kw_only=True, slots=True)
@_with_decoder_fields
class ModelRecipe:
    """``[model]``: which model to build (name, flavor; n_layers for qwen3_5 and kimi_linear,
    vision for qwen3_5 only)
    and any ``HybridDecoder.Config`` field (unset: the flavor's value)."""

    name: ModelName = "hybrid"
    """The model, a name of ``models/recipe.py``'s ``MODELS``: hybrid (the recipe's decoder,
    sized by the keys below), qwen3_5 (torchtitan's Qwen3.5), kimi_linear (Kimi Linear)."""
    flavor: str = "debug"
    """The model's size preset: hybrid debug, 150M, 1B; qwen3_5 debugmodel, 0.8B, ...
    (torchtitan's flavors); kimi_linear debug, 48B-A3B."""
    n_layers: int | None = None
    """qwen3_5 and kimi_linear: keep the flavor's first layers (its layer pattern is
    positional). Unset: all."""
    vision: bool = False
    """qwen3_5: keep the vision encoder (no context parallelism then)."""

    def overrides(self) -> dict[str, Any]:
        """The decoder fields this section sets: every key left unset is the flavor's (the four
        declared here pick the model rather than size it)."""
        decoder = _decoder_fields()
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
    """The ``ModelSpec`` that ``[model]`` names (``MODELS``), built by the model's package from
    its flavor and the keys set. A key that does not apply to the chosen model is a ValueError
    naming it."""
    entry = recipe_model(recipe.name)
    keys: dict[str, Any] = {}
    if recipe.n_layers is not None:
        keys["n_layers"] = recipe.n_layers
    if recipe.vision:
        keys["vision"] = recipe.vision
    overrides = recipe.overrides()
    decoder = _decoder_fields()
    for key in [*keys, *sorted(overrides)]:
        if entry.takes(key, decoder):
            continue
        if entry.settable is None:  # a decoder [model] sizes whole: the key picks a model
            where = choice_text(model_names(lambda m, key=key: m.takes(key, decoder)))
            raise ValueError(f"model.{key} applies to model.name = {where} only")
        raise ValueError(
            f"model.{key} does not apply to {recipe.name} (its flavor fixes the architecture; "
            f"settable: {', '.join(entry.settable)})"
        )
    return entry.spec(recipe.flavor, **keys, **overrides)
