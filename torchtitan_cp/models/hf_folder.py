"""What the Hugging Face folder checks of the models share (``models.qwen35.hf``,
``models.kimi_linear.hf``): JSON values named for one-line errors, the safetensors index, the
tensor names of a file, the comparison of a config value with the flavor's, and the check of
every tensor the model reads (name, shape, dtype) against the safetensors headers."""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path
from typing import Any

__all__ = [
    "FLOAT_DTYPES",
    "INDEX",
    "check_tensors",
    "checked_weight_files",
    "declared_dtype",
    "expected_tensors",
    "folder_config",
    "json_kind",
    "read_index",
    "read_json_object",
    "same_value",
    "tensor_names",
    "write_hf_files",
]

INDEX = "model.safetensors.index.json"
# The safetensors dtypes a floating parameter loads from by a cast within rounding
# (torch's HF reader casts whatever it finds into the parameter's dtype: integers and booleans
# too, silently; an 8-bit float is a quantized checkpoint that needs its scales).
FLOAT_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}
# transformers' names of the floating dtypes a config.json may declare (torch_dtype, dtype).
_OTHER_DTYPES = {
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
}
_DECLARED_FLOATS = {"float64", "float32", "float16", "bfloat16", "float", "half", "double", "auto"}


def json_kind(value: Any) -> str:
    """A JSON value's type, as a reader of the file would name it, with the value."""
    names = {
        str: "a string",
        list: "a list",
        bool: "a boolean",
        int: "a number",
        float: "a number",
        dict: "an object",
        type(None): "null",
    }
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
    from torchtitan_cp.run.manifest import safetensors_problem  # checkpoint files' own check

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


def declared_dtype(hf: dict[str, Any], cfg_file: Path) -> str | None:
    """The dtype ``config.json`` declares for the weights (``torch_dtype``, or ``dtype`` as
    transformers >= 5 writes it; ``text_config``'s for a multimodal config), None when it
    declares none; a one-line ValueError when it is not a floating dtype name."""
    text = hf.get("text_config") if isinstance(hf.get("text_config"), dict) else {}
    for where, block in (("", hf), ("text_config.", text)):
        for key in ("torch_dtype", "dtype"):
            value = block.get(key)
            if value is None:
                continue
            name = value.removeprefix("torch.") if isinstance(value, str) else value
            if name not in _DECLARED_FLOATS:
                raise ValueError(
                    f"{cfg_file}: {where}{key} is {json_kind(value)}, not a floating dtype "
                    "(float32, bfloat16, float16): the weights of a model are floating point"
                )
            return name
    return None


def expected_tensors(model_cfg: Any, adapter: Any) -> dict[str, tuple[list[int], Any]]:
    """HF name -> (shape, torch dtype) of every tensor a load of ``model_cfg``'s model from an
    HF folder reads: the model's state dict (built on the meta device: no memory, a 48B
    flavor in well under a second) through ``adapter.to_hf``, as torchtitan's HF load asks
    DCP for them."""
    import torch

    with torch.device("meta"):
        model = model_cfg.build()
    hf = adapter.to_hf(dict(model.state_dict()))
    return {name: (list(t.shape), t.dtype) for name, t in hf.items()}


def _headers(files: list[Path]) -> dict[str, tuple[Path, str, list[int]]]:
    """Tensor name -> (file, safetensors dtype, shape) over ``files``' headers (checked by
    ``checked_weight_files`` first), the first file holding a name winning as in torch's HF
    reader; a tensor saved in pieces (DCP's ``saved_offsets``) gets its whole shape."""
    found: dict[str, tuple[Path, str, list[int]]] = {}
    for file in files:
        with open(file, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
        meta = header.get("__metadata__") or {}
        pieces = json.loads(meta["DCP_SHARDING_INFO"]) if "DCP_SHARDING_INFO" in meta else {}
        for name, entry in header.items():
            if name == "__metadata__" or not isinstance(entry, dict):
                continue
            shape = [int(d) for d in entry.get("shape", [])]
            offsets = (pieces.get(name) or {}).get("saved_offsets") or [0] * len(shape)
            whole = [d + o for d, o in zip(shape, offsets, strict=False)]
            if name in found and found[name][0] != file:  # another piece of the same tensor
                whole = [max(a, b) for a, b in zip(found[name][2], whole, strict=False)]
                found[name] = (found[name][0], found[name][1], whole)
            else:
                found[name] = (file, str(entry.get("dtype")), whole)
    return found


def check_tensors(
    root: Path,
    files: list[Path],
    expected: dict[str, tuple[list[int], Any]],
    *,
    declared: str | None,
) -> None:
    """Every tensor of ``expected`` (``expected_tensors``) is in one of ``files`` with its
    shape, and stored in a dtype it loads from: a floating parameter from a floating dtype
    (``FLOAT_DTYPES``: the cast is within rounding), any other from its own dtype. The first
    that is not is a one-line ValueError naming the file (the folder for a missing tensor),
    the tensor and what is wrong; tensors the model does not read (a vision tower, MTP
    layers) are left alone. Reads the headers only."""
    found = _headers(files)
    for name, (shape, dtype) in expected.items():
        if name not in found:
            raise ValueError(
                f"{root}: tensor {name} ({list(shape)}) is in none of its {len(files)} "
                "safetensors file(s): a partial copy, or the weights of another model"
            )
        file, stored, got = found[name]
        if got != list(shape):
            raise ValueError(
                f"{file}: tensor {name} is {got} but the model flavor has {list(shape)}: the "
                "weights of another model size"
            )
        wanted = str(dtype).removeprefix("torch.")
        floating = getattr(dtype, "is_floating_point", False)
        if floating and stored not in FLOAT_DTYPES:
            kind = (
                "a boolean"
                if stored == "BOOL"
                else (
                    "an 8-bit float (a quantized checkpoint, which needs its scales)"
                    if stored.startswith("F8")
                    else "an integer"
                )
            )
            said = f"; config.json declares {declared}" if declared else ""
            raise ValueError(
                f"{file}: tensor {name} is stored as {stored}, {kind} dtype, but it loads "
                f"into a floating parameter ({wanted}), which would take its values cast "
                f"without a word{said}: convert the folder's weights to a floating dtype "
                "(float32, bfloat16 or float16)"
            )
        if not floating and {**FLOAT_DTYPES, **_OTHER_DTYPES}.get(stored, stored) != wanted:
            raise ValueError(
                f"{file}: tensor {name} is stored as {stored} but the model has {wanted}"
            )
