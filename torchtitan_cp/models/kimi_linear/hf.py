"""Hugging Face Kimi Linear folders: the state-dict adapter and the folder check.

Weights on disk use the layout of Moonshot's published checkpoints, which transformers'
``save_pretrained`` also writes (its load-time conversion undone): per layer
``self_attn.*`` (KDA: ``q/k/v_conv1d`` ``[C, 1, W]`` each, ``f_a_proj``, ``f_b_proj``,
``dt_bias``, ``A_log`` ``[1, 1, H, 1]``, ``b_proj``, ``g_a_proj``, ``g_b_proj``, ``o_norm``,
``o_proj``; MLA: ``q_proj``, ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``,
``o_proj``), the MoE under ``block_sparse_moe.`` (``gate.weight``,
``gate.e_score_correction_bias``, ``experts.{j}.w1/w2/w3.weight``,
``shared_experts.{gate,up,down}_proj``), the dense feed-forward under ``mlp.`` (published) or
``block_sparse_moe.`` (``save_pretrained``: it renames every ``.mlp.``), which
``dense_prefix`` chooses and ``folder_dense_prefix`` reads from a folder.

``config.json`` is read as transformers 5.23's ``KimiLinearConfig`` reads it (its key aliases,
the checkpoint's ``linear_attn_config`` block, ``first_k_dense_replace``, its defaults), with
no import of transformers (a dev dependency only).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import torch
from torchtitan.protocols.state_dict_adapter import StateDictAdapter

from torchtitan_cp.models.hf_folder import (
    INDEX,
    check_tensors,
    checked_weight_files,
    declared_dtype,
    expected_tensors,
    folder_config,
    read_index,
    same_value,
    tensor_names,
    write_hf_files,
)

__all__ = [
    "KimiLinearStateDictAdapter",
    "check_hf_folder",
    "config_mismatch",
    "folder_dense_prefix",
    "hf_config",
    "read_config",
    "write_hf_folder",
]

DensePrefix = Literal["mlp", "block_sparse_moe"]

# Renames one to one: recipe suffix (under layers.{i}.) -> HF suffix (under model.layers.{i}.)
_KDA = {
    "kda.q_proj.weight": "self_attn.q_proj.weight",
    "kda.k_proj.weight": "self_attn.k_proj.weight",
    "kda.v_proj.weight": "self_attn.v_proj.weight",
    "kda.f_a_proj.weight": "self_attn.f_a_proj.weight",
    "kda.f_b_proj.weight": "self_attn.f_b_proj.weight",
    "kda.dt_bias": "self_attn.dt_bias",
    "kda.b_proj.weight": "self_attn.b_proj.weight",
    "kda.g_a_proj.weight": "self_attn.g_a_proj.weight",
    "kda.g_b_proj.weight": "self_attn.g_b_proj.weight",
    "kda.o_norm.weight": "self_attn.o_norm.weight",
    "kda.o_proj.weight": "self_attn.o_proj.weight",
}
_MLA = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wq_a.weight": "self_attn.q_a_proj.weight",
    "attention.q_norm.weight": "self_attn.q_a_layernorm.weight",
    "attention.wq_b.weight": "self_attn.q_b_proj.weight",
    "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attention.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
}
_FFN = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}  # torchtitan SwiGLU -> HF
_MOE = {
    "moe.router.gate.weight": "block_sparse_moe.gate.weight",
    "moe.expert_bias_E": "block_sparse_moe.gate.e_score_correction_bias",
    **{
        f"moe.shared_experts.{t}.weight": f"block_sparse_moe.shared_experts.{h}.weight"
        for t, h in _FFN.items()
    },
}
_TOP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
}
_NORMS = {
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_EXPERT = {"w1_EFD": "w1", "w2_EDF": "w2", "w3_EFD": "w3"}
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_HF_EXPERT = re.compile(r"^block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight$")


def _layer_items(
    state: dict[str, Any],
    top: dict[str, str],
    layer: re.Pattern[str],
    out: dict[str, Any],
    unknown: str,
) -> Iterator[tuple[str, Any, str, str]]:
    """``(key, value, layer index, suffix)`` of each entry of ``state`` that ``layer`` matches,
    in order; an entry named in ``top`` goes to ``out`` under its new name on the way, any other
    raises ``KeyError(unknown.format(key))``."""
    for key, value in state.items():
        if key in top:
            out[top[key]] = value
            continue
        m = layer.match(key)
        if m is None:
            raise KeyError(unknown.format(key))
        i, rest = m.groups()
        yield key, value, i, rest


class KimiLinearStateDictAdapter(StateDictAdapter):
    """Recipe (``KimiLinearModel``) <-> HF (published Kimi Linear) state dicts.

    Renames, plus three re-layouts: the KDA conv ``[3C, W]`` <-> ``q/k/v_conv1d`` ``[C, 1, W]``
    each; ``A_log`` ``[H]`` <-> ``[1, 1, H, 1]``; the experts' ``[E, F, D]`` stacks <->
    per-expert ``[F, D]`` matrices. ``dense_prefix`` names the dense feed-forward's HF prefix
    (see module docstring); ``from_hf`` reads either."""

    def __init__(
        self,
        model_config: Any,
        hf_assets_path: str | None,
        dense_prefix: DensePrefix = "mlp",
    ) -> None:
        super().__init__(model_config, hf_assets_path)
        self.dense_prefix = dense_prefix

    def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        unknown = "no HF name for {!r}"
        for key, value, i, rest in _layer_items(state_dict, _TOP, _LAYER, out, unknown):
            pre = f"model.layers.{i}."
            if rest == "kda.qkv_conv.weight":
                for name, part in zip("qkv", value.chunk(3, dim=0), strict=True):
                    out[f"{pre}self_attn.{name}_conv1d.weight"] = part.unsqueeze(1)
            elif rest == "kda.A_log":
                out[pre + "self_attn.A_log"] = value.view(1, 1, -1, 1)
            elif rest.startswith("moe.routed_experts.inner_experts."):
                name = _EXPERT[rest.rsplit(".", 1)[1]]
                for j in range(value.shape[0]):
                    out[f"{pre}block_sparse_moe.experts.{j}.{name}.weight"] = value[j]
            elif rest.startswith("feed_forward."):
                t = rest.split(".")[1]
                out[f"{pre}{self.dense_prefix}.{_FFN[t]}.weight"] = value
            else:
                hf = _KDA.get(rest) or _MLA.get(rest) or _MOE.get(rest) or _NORMS.get(rest)
                if hf is None:
                    raise KeyError(unknown.format(key))
                out[pre + hf] = value
        return out

    def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
        inverse = {v: k for table in (_KDA, _MLA, _MOE, _NORMS) for k, v in table.items()}
        ffn = {h: t for t, h in _FFN.items()}
        out: dict[str, Any] = {}
        convs: dict[str, dict[str, Any]] = {}
        experts: dict[str, dict[str, dict[int, Any]]] = {}
        top = {v: k for k, v in _TOP.items()}
        kda_layers = {
            str(i)
            # pyrefly: ignore[missing-attribute]  (the Kimi decoder's config, typed as its base)
            for i, lay in enumerate(self.model_config.layers)
            if lay.kda is not None
        }
        unknown = "{!r} is not a Kimi Linear text-model weight"
        for key, value, i, rest in _layer_items(hf_state_dict, top, _HF_LAYER, out, unknown):
            pre = f"layers.{i}."
            conv = re.fullmatch(r"self_attn\.([qkv])_conv1d\.weight", rest)
            expert = _HF_EXPERT.match(rest)
            dense = re.fullmatch(r"(?:mlp|block_sparse_moe)\.(gate|up|down)_proj\.weight", rest)
            if conv:
                convs.setdefault(i, {})[conv.group(1)] = value
            elif rest == "self_attn.A_log":
                out[pre + "kda.A_log"] = value.reshape(-1)
            elif expert:
                j, w = expert.groups()
                experts.setdefault(i, {}).setdefault(w, {})[int(j)] = value
            elif dense:
                out[f"{pre}feed_forward.{ffn[dense.group(1) + '_proj']}.weight"] = value
            elif rest.startswith("self_attn.") and i in kda_layers and rest in _KDA.values():
                out[pre + {v: k for k, v in _KDA.items()}[rest]] = value
            elif rest in inverse:
                out[pre + inverse[rest]] = value
            else:
                raise KeyError(f"{key!r}: no recipe name for it")
        for i, parts in convs.items():
            out[f"layers.{i}.kda.qkv_conv.weight"] = torch.cat(
                [parts[c].squeeze(1) for c in "qkv"], dim=0
            )
        recipe = {v: k for k, v in _EXPERT.items()}
        for i, by_name in experts.items():
            for w, mats in by_name.items():
                stacked = torch.stack([mats[j] for j in range(len(mats))])
                out[f"layers.{i}.moe.routed_experts.inner_experts.{recipe[w]}"] = stacked
        return out


# transformers 5.23.0's KimiLinearConfig: defaults of the fields a config.json may omit, and
# the aliases it accepts (attribute_map: the key on disk -> the field it sets).
DEFAULTS: dict[str, Any] = {
    "vocab_size": 163840, "hidden_size": 2304, "intermediate_size": 9216,
    "moe_intermediate_size": 1024, "num_hidden_layers": 27, "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "n_shared_experts": 1, "routed_scaling_factor": 2.446, "kv_lora_rank": 512,
    "q_lora_rank": None, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
    "n_group": 1, "topk_group": 1, "num_experts_per_tok": 8, "norm_topk_prob": True,
    "hidden_act": "silu", "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
    "attention_bias": False, "num_local_experts": 256, "linear_head_dim": 128,
    "linear_num_heads": 32, "linear_conv_kernel_dim": 4,
}  # fmt: skip # a table, laid out by hand to read across
ALIASES: dict[str, str] = {
    "norm_topk_prob": "moe_renormalize", "n_group": "num_expert_group",
    "num_local_experts": "num_experts", "num_experts_per_tok": "num_experts_per_token",
    "n_shared_experts": "num_shared_experts",
}  # fmt: skip # a table, laid out by hand to read across
_LINEAR = {
    "linear_head_dim": "head_dim",
    "linear_num_heads": "num_heads",
    "linear_conv_kernel_dim": "short_conv_kernel_size",
}


def _get(hf: dict[str, Any], field: str) -> tuple[Any, str]:
    """(value, where) of one ``KimiLinearConfig`` field as transformers resolves it."""
    if field in _LINEAR and isinstance(hf.get("linear_attn_config"), dict):
        sub = hf["linear_attn_config"]
        if _LINEAR[field] in sub:  # the checkpoint's block wins, as in __post_init__
            return sub[_LINEAR[field]], f"linear_attn_config.{_LINEAR[field]}"
    for key in (field, ALIASES.get(field)):
        if key is not None and key in hf:
            return hf[key], key
    return DEFAULTS[field], f"{field} (absent)"


def read_config(hf: dict[str, Any]) -> dict[str, tuple[Any, str]]:
    """Every field ``hf_fields`` lists, from a parsed ``config.json``: ``{field: (value,
    where)}``; ``layer_types`` and ``mlp_layer_types`` derived as transformers does when absent
    (``linear_attn_config.full_attn_layers`` / ``kda_layers``, 1-indexed, or every 4th layer
    from the 5th; ``first_k_dense_replace``, default 1)."""
    out = {f: _get(hf, f) for f in DEFAULTS}
    if out["num_key_value_heads"][0] is None:  # transformers: then num_attention_heads
        out["num_key_value_heads"] = (out["num_attention_heads"][0], "num_key_value_heads")
    n = out["num_hidden_layers"][0]
    la = hf.get("linear_attn_config") if isinstance(hf.get("linear_attn_config"), dict) else {}
    if "layer_types" in hf:
        out["layer_types"] = (hf["layer_types"], "layer_types")
    elif isinstance(n, int) and "full_attn_layers" in la and "kda_layers" in la:
        types: list[Any] = [None] * n
        for i in la["full_attn_layers"]:
            types[i - 1] = "full_attention"
        for i in la["kda_layers"]:
            types[i - 1] = "linear_attention"
        out["layer_types"] = (types, "linear_attn_config.full_attn_layers")
    elif isinstance(n, int):
        types = ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(n)]
        out["layer_types"] = (types, "layer_types (absent)")
    if "mlp_layer_types" in hf:
        out["mlp_layer_types"] = (hf["mlp_layer_types"], "mlp_layer_types")
    elif isinstance(n, int):
        k = hf.get("first_k_dense_replace", 1)
        where = "first_k_dense_replace" + ("" if "first_k_dense_replace" in hf else " (absent)")
        out["mlp_layer_types"] = (["dense" if i < k else "sparse" for i in range(n)], where)
    return out


def hf_fields(cfg: Any) -> dict[str, Any]:
    """The ``KimiLinearConfig`` fields that ``cfg`` (a ``KimiLinearModel.Config``) fixes, in
    the order the folder check compares them."""
    from torchtitan_cp.models.kimi_linear.model import layer_types

    mla = cfg.first_attention
    kda = next((lay.kda for lay in cfg.layers if lay.kda is not None), None)
    moe = next((lay.moe for lay in cfg.layers if lay.moe is not None), None)
    dense = next((lay.feed_forward for lay in cfg.layers if lay.feed_forward is not None), None)
    out: dict[str, Any] = {
        "hidden_size": cfg.dim,
        "num_hidden_layers": len(cfg.layers),
        "layer_types": layer_types(cfg),
        "mlp_layer_types": ["sparse" if lay.moe is not None else "dense" for lay in cfg.layers],
        "vocab_size": cfg.vocab_size,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.norm.eps,
        "tie_word_embeddings": bool(cfg.enable_weight_tying),
    }
    if dense is not None:
        out["intermediate_size"] = dense.w1.out_features
    if mla is not None:
        # MLA expands its latent into one key and one value head per query head: transformers
        # groups query heads by num_attention_heads // num_key_value_heads (eager attention
        # repeats K/V that often), whose default of 32 matches the 48B flavor only.
        out.update(
            num_attention_heads=mla.n_heads,
            num_key_value_heads=mla.n_heads,
            q_lora_rank=mla.q_lora_rank or None,
            kv_lora_rank=mla.kv_lora_rank,
            qk_nope_head_dim=mla.qk_nope_head_dim,
            qk_rope_head_dim=mla.qk_rope_head_dim,
            v_head_dim=mla.v_head_dim,
            attention_bias=False,
        )
    if kda is not None:
        out.update(
            linear_num_heads=kda.n_heads,
            linear_head_dim=kda.head_dim,
            linear_conv_kernel_dim=kda.conv_width,
        )
    if moe is not None:
        r = moe.router
        out.update(
            num_local_experts=moe.num_experts,
            num_experts_per_tok=r.top_k,
            moe_intermediate_size=moe.routed_experts.inner_experts.hidden_dim,
            n_shared_experts=moe.shared_experts.w1.out_features
            // moe.routed_experts.inner_experts.hidden_dim,
            n_group=r.num_expert_groups or 1,
            topk_group=r.num_limited_groups or 1,
            norm_topk_prob=r.route_norm,
            routed_scaling_factor=r.route_scale,
        )
    return out


def hf_config(cfg: Any) -> dict[str, Any]:
    """A ``config.json`` that transformers reads back to ``cfg``'s model."""
    fields = hf_fields(cfg)
    # The recipe trains without dropout; pad_token_id's default (163839) would be the
    # embedding's padding row, past the end of a smaller vocabulary.
    fields.update(
        architectures=["KimiLinearForCausalLM"],
        model_type="kimi_linear",
        dtype="float32",
        attention_dropout=0.0,
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=None,
    )
    return fields


def config_mismatch(hf: dict[str, Any], cfg: Any) -> str | None:
    """The first field of ``hf`` (a parsed ``config.json``) that builds a different model than
    ``cfg``, as one line naming the key and both values; None when every field agrees."""
    kind = hf.get("model_type")
    if kind is not None and kind not in ("kimi_linear", "kimi"):
        return f"model_type is {kind!r} but the model flavor is Kimi Linear ('kimi_linear')"
    have = read_config(hf)
    for key, want in hf_fields(cfg).items():
        value, where = have[key]
        if not same_value(value, want):
            if where.endswith(" (absent)"):
                return (
                    f"{where[: -len(' (absent)')]} is absent, so transformers uses {value!r}, "
                    f"but the model flavor has {want!r}"
                )
            return f"{where} is {value!r} but the model flavor has {want!r}"
    return None


def _tensor_names(root: Path) -> list[str]:
    """Every tensor name of the folder ``root`` (from its index, else its files' headers)."""
    index = root / INDEX
    if index.is_file():
        return list(read_index(index))
    return [n for file in sorted(root.glob("*.safetensors")) for n in tensor_names(file)]


def folder_dense_prefix(path: str | Path) -> DensePrefix:
    """The HF prefix of the dense feed-forward in the folder ``path``: ``block_sparse_moe``
    when its weights are named so (``save_pretrained``), else ``mlp`` (published)."""
    dense = re.compile(r"^model\.layers\.\d+\.block_sparse_moe\.(gate|up|down)_proj\.weight$")
    return "block_sparse_moe" if any(dense.match(n) for n in _tensor_names(Path(path))) else "mlp"


def check_hf_folder(path: str | Path, cfg: Any) -> DensePrefix:
    """A one-line ValueError when ``path`` cannot hold weights for ``cfg``: no config.json, a
    field that builds a different model (``config_mismatch``: the first one), safetensors
    missing or cut short, a tensor the model reads that is missing, of another shape, or
    stored in a dtype that is not floating (``hf_folder.check_tensors``). Returns the folder's
    dense prefix (``folder_dense_prefix``)."""
    root, cfg_file, hf = folder_config(path, "Kimi Linear")
    problem = config_mismatch(hf, cfg)
    if problem is not None:
        raise ValueError(f"{cfg_file}: {problem}")
    declared = declared_dtype(hf, cfg_file)
    files, _ = checked_weight_files(root)
    prefix = folder_dense_prefix(root)
    adapter = KimiLinearStateDictAdapter(cfg, None, dense_prefix=prefix)
    check_tensors(root, files, expected_tensors(cfg, adapter), declared=declared)
    return prefix


def write_hf_folder(
    model: torch.nn.Module, cfg: Any, path: str | Path, *, tokenizer_dir: str | Path | None
) -> Path:
    """Write ``model`` as a Kimi Linear HF folder in the published layout (dense feed-forward
    under ``mlp.``): ``model.safetensors``, ``config.json`` (``hf_config``) and the tokenizer
    files of ``tokenizer_dir``; transformers' ``from_pretrained`` reads it."""
    adapter = KimiLinearStateDictAdapter(cfg, None, dense_prefix="mlp")
    return write_hf_files(model, adapter, hf_config(cfg), path, tokenizer_dir=tokenizer_dir)
