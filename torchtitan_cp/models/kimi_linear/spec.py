"""The ``ModelSpec`` of a Kimi Linear flavor (the model config, parallelize and HF adapter) and
Kimi Linear's entry of ``models.recipe.MODELS``."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from torchtitan.protocols.model_spec import ModelSpec

from torchtitan_cp.models.blocks.spec import HFFolders, RecipeModel, recipe_spec
from torchtitan_cp.models.kimi_linear.hf import (
    KimiLinearStateDictAdapter,
    check_hf_folder,
    write_hf_folder,
)
from torchtitan_cp.models.kimi_linear.model import check_kimi_linear_parallelism, kimi_linear_config
from torchtitan_cp.models.kimi_linear.parallelize import (
    parallelize_kimi_linear,
    pipeline_kimi_linear,
)
from torchtitan_cp.models.kimi_linear.stages import stage_plan

__all__ = ["MODEL", "kimi_linear_model_spec"]


def kimi_linear_model_spec(flavor: str, **kwargs: Any) -> ModelSpec:
    """``ModelSpec`` for Kimi Linear ``flavor`` (kwargs: see ``kimi_linear_config``), with the
    recipe's ``KimiLinearStateDictAdapter`` for HF checkpoints (published dense-layer names;
    ``read_hf_folder`` swaps in the HF folder's own, ``hf.folder_dense_prefix``) and torchtitan's
    MoE load-balancing hook (the expert bias update)."""
    return recipe_spec(
        "kimi_linear",
        flavor,
        kimi_linear_config(flavor, **kwargs),
        parallelize_kimi_linear,
        moe=True,
        state_dict_adapter=KimiLinearStateDictAdapter,
        pipelining_fn=pipeline_kimi_linear,
    )


def check_run(cfg: Any, config: Any) -> None:
    """A ValueError naming the key where Kimi Linear ``cfg`` cannot run with the run's
    ``config``: its parallelism (``check_kimi_linear_parallelism``) and compile."""
    check_kimi_linear_parallelism(cfg, config.parallelism)
    if config.compile.enable and "model" in config.compile.components:
        raise ValueError(
            "compile.enable is not supported for model.name = 'kimi_linear' yet (torch's "
            "grouped matmul of its float32 experts has no float32 fake kernel, so the MoE "
            "blocks do not trace; bfloat16 is not checked); set it false"
        )


def read_hf_folder(spec: ModelSpec, path: str) -> ModelSpec:
    """Check the HF folder ``path`` for ``spec``'s model; the spec whose adapter reads the names
    that folder uses for its dense feed-forward."""
    prefix = check_hf_folder(path, spec.model)
    assert spec.state_dict_adapter is not None
    # pyrefly: ignore[unexpected-keyword]  (Kimi's adapter takes it; typed as the base)
    adapter = functools.partial(spec.state_dict_adapter, dense_prefix=prefix)
    # pyrefly: ignore[bad-argument-type]  (a partial of the adapter class builds it)
    return dataclasses.replace(spec, state_dict_adapter=adapter)


MODEL = RecipeModel(
    spec=kimi_linear_model_spec,
    settable=("n_layers", "vocab_size", "attention_backend", "attention_cp"),
    check=check_run,
    hf=HFFolders(check=check_hf_folder, write=write_hf_folder, reader=read_hf_folder),
    stage_plan=stage_plan,
)
"""Kimi Linear in ``MODELS``: its flavor fixes the architecture but for the keys listed."""
