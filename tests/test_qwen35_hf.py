"""Hugging Face checkpoints in and out for Qwen3.5, without network.

An HF folder is written from a random debug model (config.json, safetensors through
torchtitan's ``Qwen35StateDictAdapter``, the bundled tokenizer) and read back through
torchtitan's own checkpoint loading code (``CheckpointManager.dcp_load`` with ``from_hf``).
"""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import torch

from torchtitan_cp import compat

compat.apply()

from torchtitan.distributed.utils import set_spmd_backend  # noqa: E402

from tests.launch import REPO, Launch, fork_train, read_metrics  # noqa: E402
from tests.test_qwen35 import make_batch  # noqa: E402
from torchtitan_cp.models.qwen35.hf import check_hf_folder, write_hf_folder  # noqa: E402
from torchtitan_cp.models.qwen35.model import qwen35_config  # noqa: E402
from torchtitan_cp.trainer.config import ConfigError  # noqa: E402

set_spmd_backend("partial_dtensor")

TOKENIZER = REPO / "torchtitan_cp" / "assets" / "tokenizer"
CONFIG = "configs/qwen35_debug_cpu.toml"


def _cfg(tied: bool = False):
    return qwen35_config(
        "debugmodel",
        n_layers=4,
        vocab_size=4096,
        attention_backend="sdpa",
        enable_weight_tying=tied,
    )


def _random_model(seed: int, tied: bool = False):
    torch.manual_seed(seed)
    model = _cfg(tied).build()
    model.init_states()
    with torch.no_grad():  # zero-initialised norms and biases would hide a mis-mapped key
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    return model


def test_to_hf_then_from_hf_returns_the_same_tensors():
    from torchtitan.models.qwen3_5 import Qwen35StateDictAdapter

    model = _random_model(0)
    adapter = Qwen35StateDictAdapter(model.config, None)
    sd = model.state_dict()
    hf = adapter.to_hf(dict(sd))
    assert "model.language_model.layers.0.linear_attn.in_proj_qkv.weight" in hf
    assert not any(k.startswith("model.visual") for k in hf)  # text-only model
    back = adapter.from_hf(hf)
    assert sorted(back) == sorted(sd)
    for k, v in sd.items():
        assert torch.equal(back[k], v), k


def _load_through_torchtitan(model, path: Path) -> None:
    """torchtitan's CheckpointManager.dcp_load(from_hf=True) on a manager holding ``model``."""
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.checkpointer.base import ModelWrapper
    from torchtitan.models.qwen3_5 import Qwen35StateDictAdapter

    wrapper = ModelWrapper(model)
    manager = types.SimpleNamespace(
        sd_adapter=Qwen35StateDictAdapter(model.config, str(path)), states={"model": wrapper}
    )
    CheckpointManager.dcp_load(  # pyrefly: ignore[bad-argument-type]
        manager, wrapper.state_dict(), checkpoint_id=str(path), from_hf=True, from_quantized=False
    )


@pytest.mark.parametrize("tied", [False, True])
def test_hf_folder_loads_back_with_bitwise_logits(tmp_path, tied):
    """Also with tied embeddings (HF's tie_word_embeddings, Qwen3.5 0.8B-4B): the folder then
    has no lm_head.weight and loading still gives the same model."""
    from safetensors import safe_open

    model = _random_model(0, tied)
    folder = write_hf_folder(model, model.config, tmp_path / "hf", tokenizer_dir=TOKENIZER)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {
        f.name for f in folder.iterdir()
    }
    check_hf_folder(folder, model.config)
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        assert ("lm_head.weight" in f.keys()) != tied
    other = _random_model(1, tied)
    tokens, positions, _ = make_batch(7, 2, 64, vocab=4096)
    assert not torch.equal(model(tokens, positions), other(tokens, positions))
    _load_through_torchtitan(other, folder)
    assert torch.equal(model(tokens, positions), other(tokens, positions))


def test_config_mismatch_names_the_first_field(tmp_path):
    model = _random_model(0)
    folder = write_hf_folder(model, model.config, tmp_path / "hf", tokenizer_dir=None)
    cfg_file = folder / "config.json"
    hf = json.loads(cfg_file.read_text())  # the export's flat qwen3_5_text layout
    hf["layer_types"][1] = "full_attention"
    hf["linear_key_head_dim"] = 32
    cfg_file.write_text(json.dumps(hf))
    with pytest.raises(ValueError) as e:
        check_hf_folder(folder, model.config)
    msg = str(e.value)
    assert ": layer_types is" in msg and "linear_key_head_dim" not in msg
    assert "\n" not in msg
    hf["hidden_size"] = 1024
    cfg_file.write_text(json.dumps(hf))
    with pytest.raises(ValueError, match=r": hidden_size is 1024 but the model flavor"):
        check_hf_folder(folder, model.config)


def test_missing_shard_is_one_line(tmp_path):
    model = _random_model(0)
    folder = write_hf_folder(model, model.config, tmp_path / "hf", tokenizer_dir=None)
    (folder / "model.safetensors").rename(folder / "model-00001-of-00002.safetensors")
    index = {
        "weight_map": {
            "a": "model-00001-of-00002.safetensors",
            "b": "model-00002-of-00002.safetensors",
        }
    }
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError) as e:
        check_hf_folder(folder, model.config)
    assert "missing safetensors shard(s) model-00002-of-00002.safetensors" in str(e.value)
    assert "\n" not in str(e.value)


def _initial_hf_load(folder: Path) -> list[str]:
    """The trainer arguments that start a run from the model weights of the HF folder
    ``folder`` (the recipe's debug config)."""
    return [
        "--config_file",
        CONFIG,
        "--checkpoint.enable",
        "--checkpoint.initial_load_in_hf",
        "--checkpoint.initial_load_model_only",
        "--checkpoint.initial_load_path",
        str(folder),
    ]


def test_training_config_checks_the_hf_folder_before_starting(tmp_path):
    from torchtitan_cp.train import load_config

    model = _random_model(0)
    folder = write_hf_folder(model, model.config, tmp_path / "hf", tokenizer_dir=TOKENIZER)
    (folder / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match="no \\*.safetensors weights"):
        load_config(_initial_hf_load(folder))


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory) -> Path:
    model = _random_model(0)
    return write_hf_folder(
        model, model.config, tmp_path_factory.mktemp("hf") / "hf", tokenizer_dir=TOKENIZER
    )


INDEX_CASES = {
    # before: AttributeError: 'list' object has no attribute 'values', a 20-line traceback
    "list": ('{"weight_map": ["model.safetensors"]}',
             "weight_map is a list (['model.safetensors']), not an object of tensor name"),
    # before: the bare JSON error, no file named
    "cut": ('{"metadata": {}, "weight_map": {"a": "model.safet',
            "invalid JSON (Unterminated string starting at: line 1 column 38 (char 37); a file "
            "cut short?)"),
    "not-object": ("[1, 2]", "a list ([1, 2]), not a JSON object with a weight_map"),
    "no-map": ('{"metadata": {}}', 'no "weight_map" (tensor name -> safetensors file)'),
    "empty": ('{"weight_map": {}}', "weight_map is empty: it lists no tensors"),
    "shard-number": ('{"weight_map": {"a": 3}}',
                     "weight_map['a'] is a number (3), not the name of a safetensors file"),
    "shard-outside": ('{"weight_map": {"a": "../x.safetensors"}}',
                      "weight_map['a'] is a string ('../x.safetensors'), not the name"),
}  # fmt: skip # a table, laid out by hand to read across

CONFIG_CASES = {
    # before: "rope_parameters.rope_theta is absent", as if the field were missing
    "rope-string": ({"rope_parameters": "default"},
                    "config.json: rope_parameters is a string ('default'), not an object of RoPE "
                    "settings (rope_type, rope_theta, partial_rotary_factor, ...)"),
    "rope-scaling-list": ({"rope_scaling": [1, 2]}, "config.json: rope_scaling is a list ([1, 2])"),
    "rope-per-type": ({"rope_parameters": {"full_attention": 5}},
                      "config.json: rope_parameters.full_attention is a number (5), not an object"),
    "text-config": ({"model_type": "qwen3_5", "text_config": "x"},
                    "config.json: text_config is a string ('x'), not an object"),
}  # fmt: skip # a table, laid out by hand to read across


def _pre_launch_error(tmp_path: Path, hf_folder: Path, name: str, edit) -> tuple[Path, str]:
    """A copy of ``hf_folder`` whose file ``name`` is rewritten by ``edit(old text) -> new
    text``, through the pre-launch check (what ``train.sh`` runs before torchrun): the file and
    the one-line ConfigError."""
    import shutil

    from torchtitan_cp.train import load_config

    folder = tmp_path / "hf"
    shutil.copytree(hf_folder, folder)
    path = folder / name
    path.write_text(edit(path.read_text() if path.exists() else ""))
    with pytest.raises(ConfigError) as e:
        load_config(_initial_hf_load(folder))
    assert "\n" not in str(e.value)
    return path, str(e.value)


@pytest.mark.parametrize("case", sorted(INDEX_CASES))
def test_every_index_defect_is_one_line_naming_file_and_field(tmp_path, hf_folder, case):
    text, needle = INDEX_CASES[case]
    index, line = _pre_launch_error(
        tmp_path, hf_folder, "model.safetensors.index.json", lambda _: text
    )
    assert line.startswith(f"{index}: ") and needle in line, line


@pytest.mark.parametrize("case", sorted(CONFIG_CASES))
def test_config_fields_of_the_wrong_type_are_named(tmp_path, hf_folder, case):
    fields, needle = CONFIG_CASES[case]
    cfg_file, line = _pre_launch_error(
        tmp_path, hf_folder, "config.json", lambda old: json.dumps({**json.loads(old), **fields})
    )
    assert line.startswith(f"{cfg_file.parent}/{needle}"), line


@pytest.mark.slow
def test_training_continues_from_an_hf_folder_and_exports_back(tmp_path):
    """Train 10 steps, export to an HF folder (scripts/export_hf.py), start a CP=2 run from
    that folder: its first loss continues the first run's curve (far below a fresh start);
    last_save_in_hf writes HF safetensors again."""
    import subprocess
    import sys

    first = tmp_path / "first"
    base = ["--config_file", CONFIG, "--validator.no-enable", "--metrics.no-enable-wandb"]
    # Each run forks its ranks from a process that imported the trainer once (fork_train).
    print(
        fork_train(
            [
                Launch(
                    "first",
                    2,
                    [
                        *base,
                        "--training.steps",
                        "10",
                        "--checkpoint.enable",
                        "--checkpoint.interval",
                        "10",
                    ],
                )
            ],
            folder=tmp_path,
        )
    )
    fresh = read_metrics(first)
    hf = tmp_path / "hf"
    proc = subprocess.run(
        [
            sys.executable,
            "scripts/export_hf.py",
            "--config_file",
            CONFIG,
            "--checkpoint",
            str(first / "checkpoint" / "step-10"),
            "--out",
            str(hf),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**__import__("os").environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (hf / "config.json").is_file() and (hf / "tokenizer.json").is_file()
    _transformers_reads_the_export(first / "checkpoint" / "step-10", hf)

    second = tmp_path / "second"
    args = [
        *base,
        "--training.steps",
        "3",
        "--parallelism.context_parallel_degree",
        "2",
        "--checkpoint.enable",
        "--checkpoint.interval",
        "3",
        "--checkpoint.initial_load_path",
        str(hf),
        "--checkpoint.initial_load_in_hf",
        "--checkpoint.initial_load_model_only",
        "--checkpoint.last_save_model_only",
        "--checkpoint.last_save_in_hf",
    ]
    print(fork_train([Launch("second", 2, args)], folder=tmp_path))
    resumed = read_metrics(second)
    assert resumed[0]["loss"] < fresh[0]["loss"] - 1.0, (fresh[0]["loss"], resumed[0]["loss"])
    # ... and below every loss of the first run's first half: it starts where that run got to.
    assert resumed[0]["loss"] < min(r["loss"] for r in fresh[:5]), (fresh, resumed[0])
    exported = list((second / "checkpoint" / "step-3").glob("*.safetensors"))
    assert exported, "last_save_in_hf wrote no safetensors"


def _transformers_reads_the_export(checkpoint: Path, folder: Path) -> None:
    """transformers' ``from_pretrained`` of export_hf.py's folder gives the checkpoint's
    logits (float32: measured max |diff| ~2e-7; the transformers tests' LOGITS_ATOL)."""
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM

    from tests.test_qwen35_transformers import LOGITS_ATOL, torch_reference_kernels

    model = _cfg().build()
    state = model.state_dict()
    dcp.load(state, checkpoint_id=str(checkpoint))
    model.load_state_dict(state)
    with torch_reference_kernels():
        theirs = AutoModelForCausalLM.from_pretrained(folder).eval()
        tokens = torch.randint(0, 4096, (2, 64), generator=torch.Generator().manual_seed(7))
        with torch.no_grad():
            err = (model(tokens) - theirs(input_ids=tokens).logits).abs().max().item()
    print(f"export_hf.py -> transformers: max |logits diff| = {err:.2e}")
    assert err <= LOGITS_ATOL
