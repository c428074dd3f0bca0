"""What the Hugging Face folder checks of the models share (``models.qwen35.hf``,
``models.kimi_linear.hf``): JSON values named for one-line errors, the safetensors index, the
tensor names of a file, and the comparison of a config value with the flavor's."""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path
from typing import Any

__all__ = [
    "INDEX",
    "checked_weight_files",
    "folder_config",
    "json_kind",
    "read_index",
    "read_json_object",
    "same_value",
    "tensor_names",
    "write_hf_files",
]

INDEX = "model.safetensors.index.json"


def json_kind(value: Any) -> str:
    """A JSON value's type, as a reader of the file would name it, with the value."""
    names = {str: "a string", list: "a list", bool: "a boolean", int: "a number",
             float: "a number", dict: "an object", type(None): "null"}  # fmt: skip
    shown = repr(value)
    shown = shown if len(shown) <= 40 else shown[:37] + "..."
    return f"{names.get(type(value), type(value).__name__)} ({shown})"


def read_json_object(path: Path, holding: str) -> dict[str, Any]:
    """``path`` parsed as a JSON object; a one-line ValueError naming the file otherwise
    (``holding``: what the object should hold, for the message)."""
    try:
        data = json.loads(path.read_text())
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: invalid JSON ({e}; a file cut short?)") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: {json_kind(data)}, not a JSON object {holding}")
    return data


def read_index(index: Path) -> dict[str, str]:
    """The ``weight_map`` (tensor name -> shard file) of ``model.safetensors.index.json``; a
    one-line ValueError naming the file and the field for any defect."""
    data = read_json_object(index, "with a weight_map")
    weight_map = data.get("weight_map")
    if weight_map is None:
        raise ValueError(f'{index}: no "weight_map" (tensor name -> safetensors file)')
    if not isinstance(weight_map, dict):
        raise ValueError(
            f"{index}: weight_map is {json_kind(weight_map)}, not an object of tensor name -> "
            "safetensors file"
        )
    if not weight_map:
        raise ValueError(f"{index}: weight_map is empty: it lists no tensors")
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or not shard or "/" in shard or shard.startswith("."):
            raise ValueError(
                f"{index}: weight_map[{name!r}] is {json_kind(shard)}, not the name of a "
                "safetensors file in the folder"
            )
    return weight_map


def folder_config(path: str | Path, model: str) -> tuple[Path, Path, dict[str, Any]]:
    """``(root, config.json's path, its object)`` of the HF folder ``path`` of ``model`` (for
    messages); a one-line ValueError when the folder or its config.json is missing or not a
    JSON object."""
    root = Path(path)
    if not root.is_dir():
        raise ValueError(f"HF folder not found: {root}")
    cfg_file = root / "config.json"
    if not cfg_file.is_file():
        raise ValueError(f"{cfg_file}: missing (an HF {model} folder needs its config.json)")
    return root, cfg_file, read_json_object(cfg_file, "of model settings")


def checked_weight_files(root: Path) -> tuple[list[Path], dict[str, str] | None]:
    """The safetensors files of the HF folder ``root`` (the shards its index lists, else every
    ``*.safetensors``) and the index's weight map (None without an index). A one-line
    ValueError for a shard the index lists that is missing, a folder without weights, or a file
    cut short (each is checked as a resume checks a checkpoint, so it is named here, not deep
    inside the loader)."""
    index = root / INDEX
    weight_map = None
    if index.is_file():
        weight_map = read_index(index)
        shards = sorted(set(weight_map.values()))
        missing = [s for s in shards if not (root / s).is_file()]
        if missing:
            raise ValueError(
                f"{root}: missing safetensors shard(s) {', '.join(missing)} listed in {INDEX}"
            )
        files = [root / s for s in shards]
    else:
        files = sorted(root.glob("*.safetensors"))
        if not files:
            raise ValueError(f"{root}: no *.safetensors weights (and no {INDEX})")
    from torchtitan_cp.run.checkpoint import safetensors_problem  # checkpoint files' own check

    for file in files:
        problem = safetensors_problem(file)
        if problem:
            raise ValueError(problem)
    return files, weight_map


def same_value(have: Any, want: Any) -> bool:
    if isinstance(want, bool) or isinstance(have, bool):
        return have is want
    if isinstance(want, float):
        return isinstance(have, int | float) and math.isclose(have, want, rel_tol=1e-9)
    if isinstance(want, list):
        return isinstance(have, list | tuple) and list(have) == want
    return have == want


def tensor_names(file: Path) -> list[str]:
    """The tensor names in a safetensors file's header (no tensor data read)."""
    from safetensors import safe_open

    try:
        with safe_open(str(file), "pt") as f:
            return list(f.keys())
    except Exception:  # a damaged file: the checkpoint loader names it
        return []


def write_hf_files(
    model: Any,
    adapter: Any,
    config: dict[str, Any],
    path: str | Path,
    *,
    tokenizer_dir: str | Path | None,
) -> Path:
    """Write ``model``'s weights in HF names (``adapter.to_hf``) as ``model.safetensors``,
    ``config`` as ``config.json`` and the tokenizer files of ``tokenizer_dir`` into ``path``."""
    from safetensors.torch import save_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    hf = {k: v.contiguous() for k, v in adapter.to_hf(sd).items()}
    save_file(hf, str(out / "model.safetensors"), metadata={"format": "pt"})
    # safetensors creates its file 0600; give it the mode of the files written beside it
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(out / "model.safetensors", 0o666 & ~umask)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if tokenizer_dir is not None:
        for f in Path(tokenizer_dir).iterdir():
            if f.is_file() and f.name.startswith(("tokenizer", "special_tokens", "vocab")):
                shutil.copy2(f, out / f.name)
    return out
