"""Hugging Face Qwen3.5 folders: write one from a model, check one against a flavor.

A folder holds ``config.json`` (HF's Qwen3.5 layout: the language model's sizes under
``text_config``), safetensors (one file, or shards listed in ``model.safetensors.index.json``)
and the tokenizer files. Weights are converted by torchtitan's ``Qwen35StateDictAdapter``;
loading for training goes through torchtitan's checkpoint loading (``[checkpoint]
initial_load_path`` + ``initial_load_in_hf``), which ``check_hf_folder`` guards with one-line
errors before any process group starts.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

INDEX = "model.safetensors.index.json"


def hf_text_config(cfg: Any) -> dict[str, Any]:
    """The ``text_config`` fields of HF's Qwen3.5 ``config.json`` that the model config fixes,
    in the order they are checked (``cfg`` a ``Qwen35Model.Config``)."""
    from torchtitan_cp.models.qwen35 import layer_types

    attn = cfg.first_attention
    dn = next(lay.delta_net for lay in cfg.layers if lay.delta_net is not None)
    ffn = cfg.layers[0].feed_forward
    return {
        "hidden_size": cfg.dim,
        "num_hidden_layers": len(cfg.layers),
        "layer_types": layer_types(cfg),
        "vocab_size": cfg.vocab_size,
        "intermediate_size": ffn.w1.out_features if ffn is not None else None,
        "num_attention_heads": attn.n_heads,
        "num_key_value_heads": attn.n_kv_heads,
        "head_dim": attn.head_dim,
        "partial_rotary_factor": attn.rotary_dim / attn.head_dim,
        "linear_num_key_heads": dn.in_proj_q.out_features // dn.key_head_dim,
        "linear_num_value_heads": dn.in_proj_v.out_features // dn.value_head_dim,
        "linear_key_head_dim": dn.key_head_dim,
        "linear_value_head_dim": dn.value_head_dim,
        "linear_conv_kernel_dim": dn.conv_kernel_size,
        "tie_word_embeddings": bool(cfg.enable_weight_tying),
    }


def hf_config(cfg: Any) -> dict[str, Any]:
    """A ``config.json`` for ``cfg`` (the text model)."""
    text = hf_text_config(cfg)
    text.update(
        model_type="qwen3_5_text", rms_norm_eps=1e-6, rope_theta=cfg.first_attention.rope.theta,
        torch_dtype="float32",
    )  # fmt: skip
    return {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "tie_word_embeddings": text["tie_word_embeddings"],
        "text_config": text,
    }


def write_hf_folder(
    model: torch.nn.Module, cfg: Any, path: str | Path, *, tokenizer_dir: str | Path | None
) -> Path:
    """Write ``model``'s weights (HF names via ``Qwen35StateDictAdapter.to_hf``) as
    ``model.safetensors``, ``config.json`` and the tokenizer files of ``tokenizer_dir``."""
    from safetensors.torch import save_file
    from torchtitan.models.qwen3_5 import Qwen35StateDictAdapter

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    adapter = Qwen35StateDictAdapter(cfg, None)
    sd = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    hf = {k: v.contiguous() for k, v in adapter.to_hf(sd).items()}
    save_file(hf, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config(cfg), indent=2) + "\n")
    if tokenizer_dir is not None:
        for f in Path(tokenizer_dir).iterdir():
            if f.is_file() and f.name.startswith(("tokenizer", "special_tokens", "vocab")):
                shutil.copy2(f, out / f.name)
    return out


def check_hf_folder(path: str | Path, cfg: Any) -> None:
    """A one-line ValueError when ``path`` cannot hold weights for ``cfg``: no config.json, a
    ``text_config`` field that differs from the flavor (the first one, in
    ``hf_text_config`` order), or safetensors shards that are missing."""
    root = Path(path)
    if not root.is_dir():
        raise ValueError(f"HF folder not found: {root}")
    cfg_file = root / "config.json"
    if not cfg_file.is_file():
        raise ValueError(f"{cfg_file}: missing (an HF Qwen3.5 folder needs its config.json)")
    try:
        hf = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg_file}: invalid JSON: {e}") from None
    text = hf.get("text_config", hf)
    for key, want in hf_text_config(cfg).items():
        # HF keeps tie_word_embeddings at the top level (default false).
        have = hf.get(key, text.get(key, False)) if key == "tie_word_embeddings" else text.get(key)
        if key == "partial_rotary_factor" and have is not None:
            same = abs(float(have) - want) < 1e-9
        else:
            same = have == want
        if not same:
            raise ValueError(
                f"{cfg_file}: text_config.{key} is {have!r} but the model flavor has {want!r}"
                + (" (set [model] enable_weight_tying to match)" if key.startswith("tie") else "")
            )
    index = root / INDEX
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text()).get("weight_map", {}).values()))
        missing = [s for s in shards if not (root / s).is_file()]
        if missing:
            raise ValueError(
                f"{root}: missing safetensors shard(s) {', '.join(missing)} listed in {INDEX}"
            )
    else:
        shards = sorted(p.name for p in root.glob("*.safetensors"))
        if not shards:
            raise ValueError(f"{root}: no *.safetensors weights (and no {INDEX})")
    for shard in shards:
        problem = safetensors_problem(root / shard)
        if problem:
            raise ValueError(problem)


def safetensors_problem(path: str | Path) -> str | None:
    """None when ``path`` is as long as its safetensors header says, else what is wrong
    (naming the file): cut inside the header, an unreadable header, or tensors past its end.
    Reads the header only."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"{path} is truncated: {size} bytes, shorter than a safetensors header"
        n = int.from_bytes(head, "little")
        if 8 + n > size:
            return f"{path} is truncated: {size} bytes, its header alone needs {8 + n}"
        try:
            header = json.loads(f.read(n))
            end = max(
                (int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"),
                default=0,
            )
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):
            return f"{path} has an unreadable safetensors header: not a safetensors file"
    if 8 + n + end > size:
        return f"{path} is truncated: {size} bytes, its header describes {8 + n + end}"
    return None
