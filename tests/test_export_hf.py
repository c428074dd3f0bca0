"""scripts/export_hf.py: the step is verified first (the resume's check and message), the folder
is written beside --out and renamed into place, a non-empty --out needs --overwrite (which
replaces it, stale shards and index included, and only ever a previous HF export: never the
source step, a run's folder or other files), and every failure is one line with exit 2.
Also: a truncated .safetensors is named by the HF folder check."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import flip
from tests.launch import REPO, repo_env
from torchtitan_cp import compat

compat.apply()

from torchtitan_cp.models.qwen35.hf import check_hf_folder  # noqa: E402
from torchtitan_cp.run.manifest import write_manifest  # noqa: E402

CONFIG = ["--config_file", "configs/qwen35_debug_cpu.toml"]


def _export_main():
    spec = importlib.util.spec_from_file_location("export_hf", REPO / "scripts" / "export_hf.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


export_main = _export_main()


def export(capsys, *args: str) -> tuple[int, str]:
    """``python scripts/export_hf.py --config_file configs/qwen35_debug_cpu.toml ARGS`` in this
    process: (status, stderr)."""
    code = export_main([*CONFIG, *args])
    return code, capsys.readouterr().err


def one_line(code: int, err: str, *needles: str) -> None:
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("export_hf.py: error: "), err
    for needle in needles:
        assert needle in err, (needle, err)


@pytest.fixture(scope="module")
def step(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A sealed DCP step of the debug Qwen3.5 model (model states only, as the export reads
    them) and those weights."""
    import torch.distributed.checkpoint as dcp

    from torchtitan_cp.models import recipe_model_spec
    from torchtitan_cp.train import load_config

    torch.manual_seed(0)
    model = recipe_model_spec(load_config(CONFIG).model).model.build()
    model.init_states()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    d = tmp_path_factory.mktemp("ckpt") / "checkpoint" / "step-10"
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    dcp.save(state, checkpoint_id=str(d))
    write_manifest(str(d), step=10, run_id="r")
    return d, state


def test_refusals_are_one_line(capsys, tmp_path, step):
    d, _ = step
    code, err = export(capsys, "--checkpoint", str(tmp_path / "step-7"), "--out", str(tmp_path))
    one_line(code, err, f"--checkpoint {tmp_path}/step-7: no such step folder")
    code, err = export(capsys, "--checkpoint", str(d.parent), "--out", str(tmp_path / "o"))
    one_line(code, err, f"--checkpoint {d.parent} is a checkpoint folder (step-10); pass one step")
    full = tmp_path / "full"
    full.mkdir()
    (full / "model-00001-of-00002.safetensors").write_bytes(b"old")
    code, err = export(capsys, "--checkpoint", str(d), "--out", str(full))
    one_line(code, err, f"--out {full} is not empty (1 entries", "--overwrite")
    # /proc takes no new folders, also for root
    code, err = export(capsys, "--checkpoint", str(d), "--out", "/proc/torchtitan_cp_x/hf")
    one_line(code, err, "--out /proc/torchtitan_cp_x/hf: cannot write into /proc/torchtitan_cp_x")
    assert not list(tmp_path.glob(".*tmp-*")), "no staging folder left behind"


def test_a_step_that_fails_verification_is_not_exported(capsys, tmp_path, step):
    """Before: exit 0 from a corrupted checkpoint (embeddings off by up to 3.7e28)."""
    import shutil

    d = tmp_path / "step-10"
    shutil.copytree(step[0], d)
    shard = d / "__0_0.distcp"
    flip(shard, offset=shard.stat().st_size // 2)
    out = tmp_path / "hf"
    code, err = export(capsys, "--checkpoint", str(d), "--out", str(out))
    one_line(code, err, f"--checkpoint {d} fails verification: {shard} does not match its manifest")
    assert not out.exists()
    # truncated, and sealed that way: the layout check names the file
    shard.write_bytes(shard.read_bytes()[:1000])
    (d / "manifest.sha256.json").unlink()
    write_manifest(str(d), step=10, run_id="r")
    code, err = export(capsys, "--checkpoint", str(d), "--out", str(out))
    one_line(code, err, f"fails verification: {shard} is truncated: 1000 bytes")


def test_overwrite_replaces_stale_shards_and_index(capsys, tmp_path, step):
    """Before: the old index and shards stayed beside the new model.safetensors, and loading
    the folder trained from the old weights."""
    from safetensors.torch import load_file

    d, state = step
    out = tmp_path / "hf"
    out.mkdir()
    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        (out / name).write_bytes(b"stale")
    (out / "model.safetensors.index.json").write_text('{"weight_map": {}}')
    code = export_main([*CONFIG, "--checkpoint", str(d), "--out", str(out), "--overwrite"])
    assert code == 0, capsys.readouterr().err
    names = sorted(p.name for p in out.iterdir())
    assert "model.safetensors" in names and "config.json" in names
    assert not [n for n in names if n.startswith("model-0") or n.endswith(".index.json")], names
    assert not list(tmp_path.glob(".hf.tmp-*")), "the staging folder was renamed into place"
    from torchtitan_cp.models import recipe_model_spec
    from torchtitan_cp.train import load_config

    cfg = recipe_model_spec(load_config(CONFIG).model).model
    check_hf_folder(out, cfg)
    hf = load_file(str(out / "model.safetensors"))
    embed = next(v for k, v in hf.items() if k.endswith("embed_tokens.weight"))
    assert torch.equal(embed, state["tok_embeddings.weight"])


def test_truncated_safetensors_is_named(tmp_path, capsys, step):
    """Before: it passed the folder check, and the load failed naming no file."""
    d, _ = step
    out = tmp_path / "hf"
    assert export_main([*CONFIG, "--checkpoint", str(d), "--out", str(out)]) == 0
    capsys.readouterr()
    from torchtitan_cp.models import recipe_model_spec
    from torchtitan_cp.train import load_config

    cfg = recipe_model_spec(load_config(CONFIG).model).model
    weights = out / "model.safetensors"
    size = weights.stat().st_size
    weights.write_bytes(weights.read_bytes()[: size - 100])
    with pytest.raises(ValueError) as e:
        check_hf_folder(out, cfg)
    assert str(e.value) == (
        f"{weights} is truncated: {size - 100} bytes, its header describes {size}"
    )
    weights.write_bytes(weights.read_bytes()[:5])
    with pytest.raises(ValueError, match="shorter than a safetensors header"):
        check_hf_folder(out, cfg)


@pytest.mark.slow
def test_export_script_refuses_a_corrupted_step_in_one_line(tmp_path, step):
    """The script itself (a fresh process): one line, exit 2."""
    import shutil

    d = tmp_path / "step-10"
    shutil.copytree(step[0], d)
    flip(d / ".metadata", offset=10)
    proc = subprocess.run(
        [
            sys.executable,
            "scripts/export_hf.py",
            *CONFIG,
            "--checkpoint",
            str(d),
            "--out",
            str(tmp_path / "hf"),
        ],
        cwd=REPO,
        env=repo_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [x for x in proc.stderr.splitlines() if "Warning" not in x and x.strip()]
    assert lines[-1].startswith(f"export_hf.py: error: --checkpoint {d} fails verification: ")
    assert "Traceback" not in proc.stderr and not (tmp_path / "hf").exists()
    assert json.loads((d / "manifest.sha256.json").read_text())["step"] == 10
    assert os.path.isdir(d)


def _run_folder(root: Path, step: Path) -> Path:
    """A dump folder as a run leaves it: checkpoint/step-10 (a copy of ``step``), run.lock,
    metrics.jsonl, tb/."""
    import shutil

    run = root / "run"
    shutil.copytree(step, run / "checkpoint" / "step-10")
    (run / "run.lock").write_text("")
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 9.0}\n')
    (run / "tb").mkdir()
    return run


def _listing(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def test_an_export_never_replaces_its_source_or_a_run(capsys, tmp_path, step):
    """Before: ``--out RUN --overwrite`` replaced the whole dump folder (checkpoint/,
    metrics.jsonl, tb/) with the HF files, and ``--out RUN/checkpoint/step-10 --overwrite``
    the step itself, both exit 0."""
    run = _run_folder(tmp_path, step[0])
    src = run / "checkpoint" / "step-10"
    before = _listing(run)
    link = tmp_path / "link"
    link.symlink_to(run)
    for overwrite in ([], ["--overwrite"]):
        code, err = export(capsys, "--checkpoint", str(src), "--out", str(run), *overwrite)
        one_line(
            code,
            err,
            f"--out {run} contains the --checkpoint step {src}",
            "never replaces its own source",
        )
        code, err = export(capsys, "--checkpoint", str(src), "--out", str(src), *overwrite)
        one_line(code, err, f"--out {src} contains the --checkpoint step {src}")
        code, err = export(capsys, "--checkpoint", str(src), "--out", str(link), *overwrite)
        one_line(code, err, f"--out {link} (= {run}) contains the --checkpoint step")
        # another run's folder (the step exported is elsewhere): a run, never replaced
        code, err = export(capsys, "--checkpoint", str(step[0]), "--out", str(run), *overwrite)
        one_line(
            code,
            err,
            f"--out {run} is a training run's folder (4 other entries: "
            "checkpoint/, metrics.jsonl, run.lock, tb/)",
            "only replaces a previous HF",
        )
        code, err = export(capsys, "--checkpoint", str(step[0]), "--out", str(link), *overwrite)
        one_line(code, err, f"--out {link} (= {run}) is a training run's folder")
        code, err = export(
            capsys, "--checkpoint", str(step[0]), "--out", str(run / "checkpoint"), *overwrite
        )
        one_line(
            code,
            err,
            f"--out {run}/checkpoint is a training run's folder (1 other entries: step-10/)",
        )
        code, err = export(capsys, "--checkpoint", str(step[0]), "--out", str(src / "hf"))
        one_line(code, err, f"--out {src}/hf lies inside the checkpoint step {src}")
    assert _listing(run) == before
    assert not list(tmp_path.glob(".*tmp-*")), "no staging folder left behind"


def test_overwrite_replaces_only_a_previous_export(capsys, tmp_path, step):
    d, _ = step
    out = tmp_path / "hf"
    assert export_main([*CONFIG, "--checkpoint", str(d), "--out", str(out)]) == 0
    capsys.readouterr()
    modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()}
    assert len(set(modes.values())) == 1, f"exported files' modes differ: {modes}"
    link = tmp_path / "link"
    link.symlink_to(out)
    # a previous export, through a symlink: replaced where it lies, the link kept
    assert export_main([*CONFIG, "--checkpoint", str(d), "--out", str(link), "--overwrite"]) == 0
    assert link.is_symlink() and (out / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "link"], "nothing left aside"
    capsys.readouterr()
    (out / "notes.txt").write_text("mine")
    code, err = export(capsys, "--checkpoint", str(d), "--out", str(out), "--overwrite")
    one_line(code, err, f"--out {out} is not an HF export (1 other entries: notes.txt)")
    assert (out / "notes.txt").read_text() == "mine"


def test_another_model_names_the_export_fix(capsys, tmp_path, step):
    """Before: the resume's hint "or start a new --dump_folder", meaningless for an export."""
    code, err = export(
        capsys, "--checkpoint", str(step[0]), "--out", str(tmp_path / "hf"), "--model.n_layers", "2"
    )
    one_line(
        code,
        err,
        f"--checkpoint {step[0]} does not fit this model: ",
        "pass the --config_file and --model.* options of the run that saved it",
    )
    assert "--dump_folder" not in err and not (tmp_path / "hf").exists()


def export_tensors(checkpoint: Path, out: Path, *model: str) -> dict[str, torch.Tensor]:
    """``scripts/export_hf.py --checkpoint CHECKPOINT --out OUT MODEL`` in this process (MODEL:
    the run's ``--config_file`` and ``--model.*`` options): the exported HF tensors by name."""
    from safetensors.torch import load_file

    code = export_main([*model, "--checkpoint", str(checkpoint), "--out", str(out)])
    assert code == 0, f"export of {checkpoint} failed (exit {code})"
    return load_file(str(out / "model.safetensors"))


def export_gap(ref: dict[str, torch.Tensor], run: dict[str, torch.Tensor]) -> tuple[float, str]:
    """The largest absolute difference between two HF exports, tensor by tensor, and the tensor
    where it lies (``(0.0, "")``: bitwise equal); the same names, shapes and dtypes are required
    (a shard exported alone has another shape)."""
    assert sorted(ref) == sorted(run), sorted(set(ref) ^ set(run))
    worst = (0.0, "")  # (0.0, "") only when every tensor is bit for bit the same
    for name, a in ref.items():
        b = run[name]
        assert (a.shape, a.dtype) == (b.shape, b.dtype), (name, a.shape, b.shape, a.dtype)
        if not torch.equal(a.view(torch.uint8), b.view(torch.uint8)):
            worst = max(worst, (float((a.double() - b.double()).abs().max()), name))
    return worst


def test_a_misgathered_shard_is_caught(capsys, tmp_path, step):
    """What the TP/EP export checks (tests/test_tensor_parallel.py) would see if a sharded
    parameter were saved wrong: a DTensor saved as one rank's local shard does not fit the
    model (the export refuses it), and shards gathered in the wrong rank order change the
    export by the size of the weights where those checks require bitwise equality."""
    import torch.distributed.checkpoint as dcp

    d, state = step
    ref = export_tensors(d, tmp_path / "ref", *CONFIG)
    assert export_gap(ref, export_tensors(d, tmp_path / "same", *CONFIG)) == (0.0, "")

    def saved(name: str, weights: dict[str, torch.Tensor]) -> Path:
        bad = tmp_path / name / "step-10"
        dcp.save(weights, checkpoint_id=str(bad))
        write_manifest(str(bad), step=10, run_id="r")
        return bad

    column = "layers.0.attn.in_proj_q.weight"  # column-wise under TP: rank r holds rows r/2
    swapped = torch.cat(state[column].chunk(2)[::-1])
    gap, where = export_gap(
        ref,
        export_tensors(
            saved("swapped", {**state, column: swapped}), tmp_path / "swapped-hf", *CONFIG
        ),
    )
    assert gap > 1e-2 and where.endswith("layers.0.linear_attn.in_proj_qkv.weight"), (gap, where)
    row = "layers.0.attn.out_proj.weight"  # row-wise under TP: rank 0 holds the first columns
    local = saved("local", {**state, row: state[row].chunk(2, dim=1)[0].clone()})
    code, err = export(capsys, "--checkpoint", str(local), "--out", str(tmp_path / "local-hf"))
    one_line(code, err, f"parameter {row} is [256, 128] in the checkpoint but [256, 256]")
