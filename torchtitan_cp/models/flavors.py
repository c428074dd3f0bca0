"""Model flavors (sizes) and the ``ModelSpec`` torchtitan's trainer consumes."""

from __future__ import annotations

import dataclasses
from typing import Any

from torchtitan.protocols.model_spec import ModelSpec

from torchtitan_cp.models.attention import check_attention_cp, resolve_attention_backend
from torchtitan_cp.models.decoder import HybridDecoder, parse_layer_pattern
from torchtitan_cp.models.layers import LAYERS

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
}  # fmt: skip


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
    for letter in dict.fromkeys(cfg.layer_pattern):  # each kind checks its own sizes
        LAYERS[letter].mixer(cfg, 0)
    if cfg.linear_attention_backend not in ("auto", "torch", "fla"):
        raise ValueError(
            "linear_attention backend must be 'auto', 'torch' or 'fla', "
            f"got {cfg.linear_attention_backend!r}"
        )
    resolve_attention_backend(cfg.attention_backend, "cpu")
    check_attention_cp(cfg.attention_cp)
    return cfg


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
        from torchtitan_cp.models.qwen35 import qwen35_model_spec

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


def model_spec(flavor: str, **overrides) -> ModelSpec:
    """The trainer's spec. Imports ``parallelize`` here, not at module load: it pulls
    torchtitan's FSDP module (torch >= 2.14), and the model itself runs on torch >= 2.11."""
    from torchtitan_cp.models.parallelize import parallelize_hybrid

    return ModelSpec(
        name="hybrid",
        flavor=flavor,
        model=model_config(flavor, **overrides),
        parallelize_fn=parallelize_hybrid,
        pipelining_fn=None,
        post_optimizer_build_fn=None,
        state_dict_adapter=None,
    )
