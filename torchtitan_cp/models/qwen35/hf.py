"""Hugging Face Qwen3.5 folders: write one from a model, check one against a flavor.

A folder holds ``config.json``, safetensors (one file, or shards listed in
``model.safetensors.index.json``) and the tokenizer files. Weights are converted by torchtitan's
``Qwen35StateDictAdapter`` (HF names ``model.language_model.*``, ``model.visual.*``); loading for
training goes through torchtitan's checkpoint loading (``[checkpoint] initial_load_path`` +
``initial_load_in_hf``), which ``check_hf_folder`` guards with one-line errors before any
process group starts.

``config.json`` comes in the layouts transformers reads: the multimodal ``qwen3_5`` config (the
language model under ``text_config``, ``tie_word_embeddings`` at the top level, as the
published checkpoints and ``Qwen3_5ForConditionalGeneration.save_pretrained`` write it) or a
flat ``qwen3_5_text`` config; RoPE settings inside ``rope_parameters`` (transformers >= 5),
inside the legacy ``rope_scaling`` (which then wins, as in transformers), or as top-level keys.
``read_text_config`` resolves each field the way transformers 5.23 does, defaults included.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from torchtitan_cp.models.hf_folder import (
    check_tensors,
    checked_weight_files,
    declared_dtype,
    expected_tensors,
    folder_config,
    write_hf_files,
)
from torchtitan_cp.models.hf_folder import (
    json_kind as _kind,
)
from torchtitan_cp.models.hf_folder import (
    same_value as _same,
)
from torchtitan_cp.models.hf_folder import (
    tensor_names as _tensor_names,
)

LANGUAGE_MODEL = "model.language_model."  # the weights' prefix in the published layout

# transformers 5.23.0's Qwen3_5TextConfig / Qwen3_5MoeTextConfig defaults for fields a
# config.json may omit (tests/test_qwen35_transformers.py checks them against transformers).
TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 248320, "hidden_size": 4096, "intermediate_size": 12288,
    "num_hidden_layers": 32, "num_attention_heads": 16, "num_key_value_heads": 4,
    "hidden_act": "silu", "rms_norm_eps": 1e-6, "attention_bias": False, "head_dim": 256,
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "tie_word_embeddings": False,
}  # fmt: skip # a table, laid out by hand to read across
MOE_DEFAULTS: dict[str, Any] = {
    "num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512, "hidden_size": 2048,
}  # fmt: skip # a table, laid out by hand to read across
ROPE_DEFAULTS: dict[str, Any] = {
    "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
    "mrope_section": [11, 11, 10],
}  # fmt: skip # a table, laid out by hand to read across
FULL_ATTENTION_INTERVAL = 4  # transformers' layer_types default: every 4th layer full attention
VISION_DEFAULTS: dict[str, Any] = {
    "depth": 27, "hidden_size": 1152, "hidden_act": "gelu_pytorch_tanh",
    "intermediate_size": 4304, "num_heads": 16, "in_channels": 3, "patch_size": 16,
    "spatial_merge_size": 2, "temporal_patch_size": 2, "out_hidden_size": 3584,
    "num_position_embeddings": 2304,
}  # fmt: skip # a table, laid out by hand to read across
_ROPE_KEYS = ("rope_type", "rope_theta", "partial_rotary_factor", "mrope_section")
_HINTS = {
    "tie_word_embeddings": " (set [model] enable_weight_tying to match)",
    "vocab_size": " (set [model] vocab_size to match)",
    "num_hidden_layers": " ([model] n_layers keeps the flavor's first layers)",
}


@dataclass(frozen=True)
class HFValue:
    """One ``config.json`` field as transformers resolves it."""

    value: Any
    where: str
    """Its key path (``text_config.rope_parameters.rope_theta``), or ``... (absent)``."""


def _is_moe(cfg: Any) -> bool:
    return any(getattr(lay, "moe", None) is not None for lay in cfg.layers)


def hf_text_config(cfg: Any) -> dict[str, Any]:
    """The language-model fields of HF's Qwen3.5 ``config.json`` that ``cfg`` (a
    ``Qwen35Model.Config``) fixes, in the order they are checked. RoPE fields are listed flat
    (``rope_type``, ``rope_theta``, ``partial_rotary_factor``, ``mrope_section``); attention
    fields only when the stack has an attention layer, GatedDeltaNet fields only with one."""
    from torchtitan_cp.models.qwen35.model import layer_types

    out: dict[str, Any] = {
        "hidden_size": cfg.dim,
        "num_hidden_layers": len(cfg.layers),
        "layer_types": layer_types(cfg),
        "vocab_size": cfg.vocab_size,
    }
    moe = next((lay.moe for lay in cfg.layers if getattr(lay, "moe", None) is not None), None)
    if moe is not None:
        out.update(
            num_experts=moe.num_experts,
            num_experts_per_tok=moe.router.top_k,
            moe_intermediate_size=moe.routed_experts.inner_experts.hidden_dim,
            shared_expert_intermediate_size=moe.shared_experts.w1.out_features,
        )
    else:
        out["intermediate_size"] = cfg.layers[0].feed_forward.w1.out_features
    # torchtitan's FFN is SwiGLU and the GatedDeltaNet conv and output gate use SiLU: HF's
    # hidden_act drives all three.
    out.update(hidden_act="silu", rms_norm_eps=cfg.norm.eps)
    attn = cfg.first_attention
    if attn is not None:
        rope = attn.rope
        out.update(
            num_attention_heads=attn.n_heads,
            num_key_value_heads=attn.n_kv_heads,
            head_dim=attn.head_dim,
            attention_bias=bool(attn.wq.bias),
            rope_type="default" if rope.scaling == "none" else rope.scaling,
            rope_theta=float(rope.theta),
            partial_rotary_factor=attn.rotary_dim / attn.head_dim,
            mrope_section=list(rope.mrope_section),
        )
    dn = next((lay.delta_net for lay in cfg.layers if lay.delta_net is not None), None)
    if dn is not None:
        out.update(
            linear_num_key_heads=dn.in_proj_q.out_features // dn.key_head_dim,
            linear_num_value_heads=dn.in_proj_v.out_features // dn.value_head_dim,
            linear_key_head_dim=dn.key_head_dim,
            linear_value_head_dim=dn.value_head_dim,
            linear_conv_kernel_dim=dn.conv_kernel_size,
        )
    out["tie_word_embeddings"] = bool(cfg.enable_weight_tying)
    return out


def hf_vision_config(cfg: Any) -> dict[str, Any] | None:
    """HF's ``vision_config`` fields for ``cfg.vision_encoder`` (None for a text-only model)."""
    v = cfg.vision_encoder
    if v is None:
        return None
    return {
        "depth": v.num_layers, "hidden_size": v.dim, "hidden_act": "gelu_pytorch_tanh",
        "intermediate_size": v.block.mlp.fc1.out_features, "num_heads": v.num_heads,
        "in_channels": v.in_channels, "patch_size": v.patch_size,
        "spatial_merge_size": v.spatial_merge_size, "temporal_patch_size": v.temporal_patch_size,
        "out_hidden_size": v.merger.fc2.out_features,
        "num_position_embeddings": v.num_position_embeddings,
    }  # fmt: skip # a table, laid out by hand to read across


def hf_config(cfg: Any) -> dict[str, Any]:
    """A ``config.json`` that transformers reads back to ``cfg``'s model.

    Text-only models (the recipe's default, and the only kind CP trains) are declared text-only
    (``Qwen3_5ForCausalLM``, flat ``qwen3_5_text``): their folder holds no vision weights, and
    a multimodal declaration would make transformers build a randomly initialised vision tower
    with only a warning. transformers maps the weights' ``model.language_model.`` prefix onto
    that class. Models with ``[model] vision = true`` are declared
    ``Qwen3_5ForConditionalGeneration`` with their ``vision_config``."""
    fields = hf_text_config(cfg)
    moe = _is_moe(cfg)
    family = "qwen3_5_moe" if moe else "qwen3_5"
    text = {k: v for k, v in fields.items() if k not in _ROPE_KEYS}
    if "rope_theta" in fields:
        # torchtitan's MRoPE interleaves the T/H/W sections as HF's Qwen3.5 does.
        text["rope_parameters"] = {
            **{k: fields[k] for k in _ROPE_KEYS}, "mrope_interleaved": True
        }  # fmt: skip # a table, laid out by hand to read across
    text.update(model_type=f"{family}_text", dtype="float32")
    vision = hf_vision_config(cfg)
    if vision is None:
        return {"architectures": ["Qwen3_5MoeForCausalLM" if moe else "Qwen3_5ForCausalLM"], **text}
    vision.update(
        model_type=f"{family}_vision",
        rope_parameters={
            "rope_type": "axial",
            "rope_theta": float(cfg.vision_encoder.rotary_pos_emb.theta),
        },
    )
    return {
        "architectures": [
            "Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"
        ],
        "model_type": family,
        "tie_word_embeddings": text.pop("tie_word_embeddings"),
        "text_config": text,
        "vision_config": vision,
        "dtype": "float32",
    }


def _multimodal(hf: dict[str, Any]) -> bool:
    return isinstance(hf.get("text_config"), dict) or hf.get("model_type") in (
        "qwen3_5",
        "qwen3_5_moe",
    )


def shape_problem(hf: dict[str, Any]) -> str | None:
    """A field of ``config.json`` whose JSON type no reader can use (``text_config`` or the
    RoPE settings not an object), named with its key path; None when the shapes are right."""
    if _multimodal(hf) and "text_config" in hf and not isinstance(hf["text_config"], dict):
        return f"text_config is {_kind(hf['text_config'])}, not an object of language-model fields"
    multimodal = _multimodal(hf)
    text = hf["text_config"] if multimodal and isinstance(hf.get("text_config"), dict) else hf
    pre = "text_config." if multimodal else ""
    for name in ("rope_scaling", "rope_parameters"):
        rope = text.get(name)
        if rope is not None and not isinstance(rope, dict):
            return (
                f"{pre}{name} is {_kind(rope)}, not an object of RoPE settings (rope_type, "
                "rope_theta, partial_rotary_factor, ...)"
            )
        per_type = rope.get("full_attention") if isinstance(rope, dict) else None
        if per_type is not None and not isinstance(per_type, dict):
            return (
                f"{pre}{name}.full_attention is {_kind(per_type)}, not an object of RoPE settings"
            )
    return None


def _field(d: dict[str, Any], key: str, prefix: str, default: Any) -> HFValue:
    if key in d:
        return HFValue(d[key], prefix + key)
    return HFValue(default, prefix + key + " (absent)")


def read_text_config(hf: dict[str, Any]) -> dict[str, HFValue]:
    """Every language-model field of ``hf`` (a parsed ``config.json``) that ``hf_text_config``
    lists, resolved as transformers 5.23 resolves it: ``text_config`` when the config is
    multimodal (``tie_word_embeddings`` then from the top level, the flag
    ``Qwen3_5ForConditionalGeneration`` reads), RoPE from ``rope_scaling`` or else
    ``rope_parameters``, then the top-level ``rope_theta`` / ``partial_rotary_factor``, then
    transformers' defaults; ``layer_types`` from ``full_attention_interval`` when absent."""
    multimodal = _multimodal(hf)
    sub = hf.get("text_config")
    text = (sub if isinstance(sub, dict) else {}) if multimodal else hf
    pre = "text_config." if multimodal else ""
    moe = "moe" in str(hf.get("model_type", "")) or "moe" in str(text.get("model_type", ""))
    out: dict[str, HFValue] = {}
    for key, default in {**TEXT_DEFAULTS, **(MOE_DEFAULTS if moe else {})}.items():
        if key == "tie_word_embeddings" and multimodal:
            out[key] = _field(hf, key, "", default)
        else:
            out[key] = _field(text, key, pre, default)
    n = out["num_hidden_layers"].value
    if "layer_types" in text or not isinstance(n, int):
        out["layer_types"] = _field(text, "layer_types", pre, None)
    else:
        every = text.get("full_attention_interval", FULL_ATTENTION_INTERVAL)
        types = ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n)]
        out["layer_types"] = HFValue(types, pre + "layer_types (absent)")
    rope, at = {}, pre + "rope_parameters"
    for name in ("rope_scaling", "rope_parameters"):  # transformers: rope_scaling or ...
        if isinstance(text.get(name), dict) and text[name]:
            rope, at = text[name], pre + name
            break
    if isinstance(rope.get("full_attention"), dict):  # RoPE per layer type
        rope, at = rope["full_attention"], at + ".full_attention"
    for key in _ROPE_KEYS:
        if key in rope:
            out[key] = HFValue(rope[key], f"{at}.{key}")
        elif key == "rope_type" and "type" in rope:
            out[key] = HFValue(rope["type"], f"{at}.type")
        elif key in ("rope_theta", "partial_rotary_factor") and key in text:
            out[key] = HFValue(text[key], pre + key)
        else:
            out[key] = HFValue(ROPE_DEFAULTS[key], f"{at}.{key} (absent)")
    return out


def _mismatch(got: HFValue, want: Any, hint: str = "") -> str:
    if got.where.endswith(" (absent)"):
        return (
            f"{got.where[: -len(' (absent)')]} is absent, so transformers uses {got.value!r}, but "
            f"the model flavor has {want!r}{hint}"
        )
    return f"{got.where} is {got.value!r} but the model flavor has {want!r}{hint}"


def config_mismatch(hf: dict[str, Any], cfg: Any) -> str | None:
    """The first field of ``hf`` (a parsed ``config.json``) that builds a different model than
    ``cfg``, as one line (None when every field agrees): the model type, the language-model
    fields in ``hf_text_config`` order, then (with ``[model] vision = true``) the vision
    tower's."""
    moe = _is_moe(cfg)
    kinds = ("qwen3_5_moe", "qwen3_5_moe_text") if moe else ("qwen3_5", "qwen3_5_text")
    multimodal = _multimodal(hf)
    sub = hf.get("text_config")
    sub_kind = sub.get("model_type") if isinstance(sub, dict) else None
    for where, kind in (("model_type", hf.get("model_type")), ("text_config.model_type", sub_kind)):
        if kind is not None and kind not in kinds:
            return (
                f"{where} is {kind!r} but the model flavor is a Qwen3.5 "
                f"{'MoE' if moe else 'dense'} model ({' or '.join(map(repr, kinds))})"
            )
    have = read_text_config(hf)
    for key, want in hf_text_config(cfg).items():
        if not _same(have[key].value, want):
            return _mismatch(have[key], want, _HINTS.get(key, ""))
    vision = hf_vision_config(cfg)
    if vision is not None:
        if not multimodal:
            return (
                "a text-only config (no vision_config) but [model] vision = true builds the "
                "vision tower; set model.vision = false"
            )
        vc = hf.get("vision_config") or {}
        for key, want in vision.items():
            got = _field(vc, key, "vision_config.", VISION_DEFAULTS[key])
            if not _same(got.value, want):
                return _mismatch(got, want)
    return None


def write_hf_folder(
    model: torch.nn.Module, cfg: Any, path: str | Path, *, tokenizer_dir: str | Path | None
) -> Path:
    """Write ``model``'s weights (HF names via ``Qwen35StateDictAdapter.to_hf``) as
    ``model.safetensors``, ``config.json`` and the tokenizer files of ``tokenizer_dir``."""
    from torchtitan.models.qwen3_5 import Qwen35StateDictAdapter

    return write_hf_files(
        model, Qwen35StateDictAdapter(cfg, None), hf_config(cfg), path, tokenizer_dir=tokenizer_dir
    )


def check_hf_folder(path: str | Path, cfg: Any) -> None:
    """A one-line ValueError when ``path`` cannot hold weights for ``cfg``: no config.json, a
    field that builds a different model (``config_mismatch``: the first one), safetensors
    shards that are missing or cut short, or a tensor the model reads that is missing, of
    another shape, or stored in a dtype that is not floating (``hf_folder.check_tensors``)."""
    from torchtitan.models.qwen3_5 import Qwen35StateDictAdapter

    root, cfg_file, hf = folder_config(path, "Qwen3.5")
    problem = shape_problem(hf) or config_mismatch(hf, cfg)
    if problem is not None:
        raise ValueError(f"{cfg_file}: {problem}")
    declared = declared_dtype(hf, cfg_file)
    files, weight_map = checked_weight_files(root)
    names = list(weight_map) if weight_map is not None else _tensor_names(files[0])
    if any(n.startswith(("model.layers.", "model.embed_tokens.")) for n in names) and not any(
        n.startswith(LANGUAGE_MODEL) for n in names
    ):
        raise ValueError(
            f"{root}: weights named model.layers.* (transformers' Qwen3_5ForCausalLM layout); "
            f"the recipe loads the published Qwen3_5ForConditionalGeneration layout "
            f"{LANGUAGE_MODEL}* (torchtitan's Qwen35StateDictAdapter)"
        )
    expected = expected_tensors(cfg, Qwen35StateDictAdapter(cfg, None))
    check_tensors(root, files, expected, declared=declared)
