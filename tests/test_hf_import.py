"""Every tensor an HF import reads is checked before any rank starts (``train --check``, which
``./scripts/train.sh`` runs before torchrun, and every rank's own check): its name, shape and
dtype, against the model and the folder's ``config.json``. Qwen3.5 and Kimi Linear alike.

Before: neither the folder check nor the load looked at a tensor's dtype, and torch's HF reader
casts whatever it finds into the parameter, so a folder whose ``model.embed_tokens.weight`` was
stored as int32 trained without a word (step-1 loss 8.2536 instead of 8.2357 on Kimi Linear,
7.7771 instead of 7.6527 on Qwen3.5); a missing or mis-shaped tensor passed the check and
failed in DCP's load planner with 332 lines of both ranks' tracebacks and exit 1.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from torchtitan_cp import compat

compat.apply()

from safetensors.torch import load_file, save_file  # noqa: E402

from tests.launch import REPO  # noqa: E402
from torchtitan_cp.models import recipe_model_spec  # noqa: E402
from torchtitan_cp.train import load_config, main  # noqa: E402

TOKENIZER = REPO / "torchtitan_cp" / "assets" / "tokenizer"
MODELS = {
    # config file, a tensor the model reads, one of another layer kind
    "qwen3_5": ("configs/qwen35_debug_cpu.toml", "model.language_model.embed_tokens.weight",
                "model.language_model.layers.1.linear_attn.in_proj_qkv.weight"),
    "kimi_linear": ("configs/kimi_linear_debug_cpu.toml", "model.embed_tokens.weight",
                    "model.layers.3.self_attn.kv_b_proj.weight"),
}  # fmt: skip # a table, laid out by hand to read across


@pytest.fixture(scope="module", params=sorted(MODELS))
def folder(request, tmp_path_factory) -> tuple[str, Path]:
    """(model name, an HF folder of the config file's model, as scripts/export_hf.py writes
    it): the check passes it."""
    name = request.param
    config = load_config(["--config_file", MODELS[name][0]])
    spec = recipe_model_spec(config.model)
    torch.manual_seed(0)
    model = spec.model.build()
    model.init_states()
    if name == "qwen3_5":
        from torchtitan_cp.models.qwen35.hf import write_hf_folder
    else:
        from torchtitan_cp.models.kimi_linear.hf import write_hf_folder
    path = tmp_path_factory.mktemp(name) / "hf"
    write_hf_folder(model, spec.model, path, tokenizer_dir=TOKENIZER)
    return name, path


def check(capsys, name: str, path: Path, tmp_path: Path) -> tuple[int, str]:
    """``python -m torchtitan_cp.train --check`` of a run that starts from the HF folder
    ``path`` (in this process): (status, stderr)."""
    code = main(
        [
            "--check",
            "--nproc",
            "2",
            "--config_file",
            MODELS[name][0],
            "--dump_folder",
            str(tmp_path / "run"),
            "--checkpoint.enable",
            "--checkpoint.initial_load_in_hf",
            "--checkpoint.initial_load_model_only",
            "--checkpoint.initial_load_path",
            str(path),
        ]
    )
    return code, capsys.readouterr().err


def one_line(code: int, err: str) -> str:
    assert code == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("torchtitan_cp.train: error: "), err
    return err.strip()


def edited(folder: tuple[str, Path], tmp_path: Path, edit) -> tuple[str, Path]:
    """A copy of the folder whose tensors ``edit(dict)`` changed in place."""
    import shutil

    name, path = folder
    copy = tmp_path / "hf"
    shutil.copytree(path, copy)
    tensors = load_file(str(copy / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(copy / "model.safetensors"), metadata={"format": "pt"})
    return name, copy


def test_the_written_folder_passes(capsys, tmp_path, folder):
    name, path = folder
    assert check(capsys, name, path, tmp_path)[0] == 0


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.bool, torch.float8_e4m3fn])
def test_a_floating_tensor_stored_as_integer_or_bool_is_refused(capsys, tmp_path, folder, dtype):
    """int32 embeddings: the values cast into the float parameter trained a different model.
    The line names the file, the tensor and the stored dtype (float8: a quantized checkpoint,
    which would need its scales)."""
    key = MODELS[folder[0]][1]
    name, path = edited(folder, tmp_path, lambda t: t.update({key: (t[key] * 100).to(dtype)}))
    line = one_line(*check(capsys, name, path, tmp_path))
    stored = {
        torch.int32: "I32",
        torch.int64: "I64",
        torch.bool: "BOOL",
        torch.float8_e4m3fn: "F8_E4M3",
    }[dtype]
    assert f"{path}/model.safetensors: tensor {key} is stored as {stored}, " in line, line
    assert "but it loads into a floating parameter (float32)" in line, line
    assert "convert the folder's weights to a floating dtype" in line, line
    assert "config.json declares float32" in line, line


def test_bfloat16_tensors_load_by_a_cast_within_rounding(capsys, tmp_path, folder):
    name, path = edited(
        folder, tmp_path, lambda t: t.update({k: v.to(torch.bfloat16) for k, v in t.items()})
    )
    assert check(capsys, name, path, tmp_path)[0] == 0


def test_a_missing_tensor_is_one_line_before_launch(capsys, tmp_path, folder):
    key = MODELS[folder[0]][2]
    name, path = edited(folder, tmp_path, lambda t: t.pop(key))
    line = one_line(*check(capsys, name, path, tmp_path))
    assert f"{path}: tensor {key} (" in line and "is in none of its 1 safetensors file(s)" in line


def test_a_tensor_of_another_shape_is_one_line_before_launch(capsys, tmp_path, folder):
    key = MODELS[folder[0]][2]
    name, path = edited(folder, tmp_path, lambda t: t.update({key: t[key][:-1].clone()}))
    line = one_line(*check(capsys, name, path, tmp_path))
    want = list(load_file(str(folder[1] / "model.safetensors"))[key].shape)
    got = [want[0] - 1, *want[1:]]
    assert f"{path}/model.safetensors: tensor {key} is {got} but the model flavor has {want}" in (
        line
    ), line


def test_a_config_that_declares_a_non_floating_dtype_is_refused(capsys, tmp_path, folder):
    import shutil

    name, path = folder
    copy = tmp_path / "hf"
    shutil.copytree(path, copy)
    cfg = json.loads((copy / "config.json").read_text())
    cfg.pop("dtype", None)
    (copy / "config.json").write_text(json.dumps({**cfg, "torch_dtype": "int8"}))
    line = one_line(*check(capsys, name, copy, tmp_path))
    assert f"{copy}/config.json: torch_dtype is a string ('int8'), not a floating dtype" in line
