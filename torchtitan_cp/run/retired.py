"""Parameter names a layer no longer has, and why: a checkpoint that holds one is refused in one
line naming it and the change (``run.checkpoint.fit_problem``), never loaded around it.

Kept apart from ``run.checkpoint`` (which imports torchtitan's checkpoint manager): a layer
registers its retired names when it is imported, and importing a model stays light.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["retire_parameter", "retired_problem"]

_RETIRED: dict[str, str] = {}


def retire_parameter(suffix: str, why: str) -> None:
    """Register a parameter name no layer has any more: a flattened key ending in ``suffix``
    (e.g. ``mixer.in_proj.weight``); ``why`` says what it was and what replaced it."""
    _RETIRED[suffix] = why


def retired_problem(keys: Iterable[str]) -> str | None:
    """What refuses a checkpoint holding ``keys`` (the ones the model lacks): the first that
    ends in a retired name, with why; None if none does."""
    for key in keys:
        for suffix, why in _RETIRED.items():
            if key == suffix or key.endswith(f".{suffix}"):
                return f"its parameter {key} is {why}, and this recipe no longer reads it"
    return None
