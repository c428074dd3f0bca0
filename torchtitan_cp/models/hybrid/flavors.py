"""Model flavors (sizes), the ``ModelSpec`` torchtitan's trainer consumes and the hybrid
decoder's entry of ``models.recipe.MODELS``."""

from __future__ import annotations

import dataclasses
from typing import Any

from torchtitan.protocols.model_spec import ModelSpec

from torchtitan_cp.models.blocks.attention_cp import check_attention_cp
from torchtitan_cp.models.blocks.flex import resolve_attention_backend
from torchtitan_cp.models.blocks.spec import RecipeModel, recipe_spec
from torchtitan_cp.models.hybrid.decoder import HybridDecoder, parse_layer_pattern
from torchtitan_cp.models.hybrid.layers import LAYERS, check_backend, check_tensor_parallel
from torchtitan_cp.models.hybrid.stages import stage_plan

# Sizes only; the layer pattern comes from config. Parameter counts are for the default
# pattern of each flavor and the bundled tokenizer's vocabulary where it applies.
FLAVORS: dict[str, dict] = {
    # ~1 s per 2-rank CPU step at seq_len 256: for tests and the embedded default.
    "debug": dict(
        vocab_size=4096, dim=64, layer_pattern="KGKA", n_heads=2, head_dim=32,
        attn_n_heads=4, attn_n_kv_heads=2, attn_head_dim=16, ffn_hidden_dim=192,
        max_seq_len=8192,
    ),
    # ~150M parameters with a 32k vocabulary (12 layers, 3:1 linear to softmax attention).
    "150M": dict(
        vocab_size=32000, dim=768, layer_pattern="KKKAKKKAKKKA", n_heads=6, head_dim=128,
        attn_n_heads=12, attn_n_kv_heads=4, attn_head_dim=64, ffn_hidden_dim=2304,
        max_seq_len=131072,
    ),
    # ~1B parameters with a 128k vocabulary (20 layers, 3:1 linear to softmax attention).
    "1B": dict(
        vocab_size=128256, dim=1792, layer_pattern="KKKAKKKAKKKAKKKAKKKA", n_heads=14,
        head_dim=128, attn_n_heads=14, attn_n_kv_heads=2, attn_head_dim=128,
        ffn_hidden_dim=4864, max_seq_len=131072, enable_weight_tying=True,
    ),
}  # fmt: skip # a table, laid out by hand to read across


def model_config(flavor: str, **overrides) -> HybridDecoder.Config:
    """The flavor's config with ``overrides`` (any ``HybridDecoder.Config`` field) applied."""
    if flavor not in FLAVORS:
        raise ValueError(f"unknown model.flavor {flavor!r}; choose one of {sorted(FLAVORS)}")
    fields = {f.name for f in dataclasses.fields(HybridDecoder.Config)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(f"unknown model key(s) {', '.join(unknown)}")
    cfg = HybridDecoder.Config(**{**FLAVORS[flavor], **overrides})
    parse_layer_pattern(cfg.layer_pattern)
    if cfg.linear_attention_backend not in ("auto", "torch", "fla"):
        raise ValueError(
            "linear_attention backend must be 'auto', 'torch' or 'fla', "
            f"got {cfg.linear_attention_backend!r}"
        )
    check_backend(cfg.layer_pattern, cfg.linear_attention_backend)
    for letter in dict.fromkeys(cfg.layer_pattern):  # each kind checks its own sizes
        LAYERS[letter].build(cfg, 0)
    resolve_attention_backend(cfg.attention_backend, "cpu")
    check_attention_cp(cfg.attention_cp)
    return cfg


def model_spec(flavor: str, **overrides) -> ModelSpec:
    """The trainer's spec. Imports ``parallelize`` here, not at module load: it pulls
    torchtitan's FSDP module (torch >= 2.14), and the model itself runs on torch >= 2.11."""
    from torchtitan_cp.models.hybrid.parallelize import parallelize_hybrid, pipeline_hybrid

    cfg = model_config(flavor, **overrides)
    return recipe_spec("hybrid", flavor, cfg, parallelize_hybrid, pipelining_fn=pipeline_hybrid)


def check_run(cfg: HybridDecoder.Config, config: Any) -> None:
    """A ValueError naming the key where the hybrid decoder ``cfg`` cannot run with the run's
    ``config``: a linear-attention backend a kind of the pattern lacks, a head count TP does
    not divide, weight tying under TP, expert parallelism (it has no experts)."""
    par = config.parallelism
    check_backend(cfg.layer_pattern, config.linear_attention.backend)
    check_tensor_parallel(cfg, par.tensor_parallel_degree)
    if cfg.enable_weight_tying and par.tensor_parallel_degree > 1:
        raise ValueError(
            "model.enable_weight_tying cannot be combined with parallelism."
            "tensor_parallel_degree > 1 (the embedding is row-sharded, the LM head "
            "column-sharded); set one of them off"
        )
    if par.expert_parallel_degree > 1:
        raise ValueError(
            f"parallelism.expert_parallel_degree = {par.expert_parallel_degree}: the hybrid "
            "decoder has no experts; set it to 1"
        )


MODEL = RecipeModel(spec=model_spec, check=check_run, stage_plan=stage_plan)
"""The hybrid decoder in ``MODELS``: ``[model]`` sets any field of its config."""
