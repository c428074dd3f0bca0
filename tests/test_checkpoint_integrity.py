"""Checkpoint manifests, the resume plan, the run lock and metrics.jsonl history (one process,
real files; the end-to-end runs are in test_runs.py)."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import pytest

from tests.dist_utils import run_distributed
from tests.helpers import flip
from tests.launch import run_module, run_python
from torchtitan_cp.checkpoint import main as checkpoint_main
from torchtitan_cp.run.checkpoint import HybridCheckpointManager, fit_error, fit_problem
from torchtitan_cp.run.errors import CheckpointError, RunError
from torchtitan_cp.run.lock import RunLock
from torchtitan_cp.run.manifest import (
    MANIFEST,
    MANIFEST_FORMAT,
    check_step,
    list_files,
    write_manifest,
)
from torchtitan_cp.run.resume import check_writable, plan_resume
from torchtitan_cp.run.start import read_rows, repair_jsonl, supersede_rows


def make_step(folder: Path, step: int, *, sealed: bool = True, run_id: str = "run-a") -> Path:
    """A step folder holding a real (one-process) DCP save, ``.metadata`` + ``__0_0.distcp``,
    plus a second 3000-byte file as the other rank's shard of a 2-rank save would be."""
    import torch
    import torch.distributed.checkpoint as dcp

    d = folder / f"step-{step}"
    d.mkdir(parents=True)
    dcp.save({"w": torch.randn(1024), "step": torch.tensor(step)}, checkpoint_id=str(d))
    (d / "__1_0.distcp").write_bytes(os.urandom(3000))
    if sealed:
        write_manifest(str(d), step=step, run_id=run_id)
    return d


def test_manifest_lists_every_file_and_is_written_atomically(tmp_path):
    d = make_step(tmp_path, 3)
    manifest = json.loads((d / MANIFEST).read_text())
    assert sorted(manifest["files"]) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert manifest["step"] == 3 and manifest["run_id"] == "run-a"
    assert manifest["files"]["__1_0.distcp"]["bytes"] == 3000
    assert not [p for p in os.listdir(d) if ".tmp" in p], "the temp manifest is renamed away"
    assert list_files(str(d)) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert check_step(str(d)) is None


def test_flipped_bytes_name_the_shard(tmp_path):
    d = make_step(tmp_path, 3)
    flip(d / "__1_0.distcp")
    problem = check_step(str(d))
    assert problem is not None and str(d / "__1_0.distcp") in problem and "corrupted" in problem
    # size-only verification does not read the data, so it cannot see flipped bytes...
    assert check_step(str(d), sha256=False) is None
    # ...but it does see a truncated or missing file
    (d / "__0_0.distcp").write_bytes(b"short")
    assert "5 bytes" in (check_step(str(d), sha256=False) or "")
    (d / "__0_0.distcp").unlink()
    assert "missing" in (check_step(str(d), sha256=False) or "")


def test_step_without_manifest_is_incomplete(tmp_path):
    d = make_step(tmp_path, 3, sealed=False)
    assert "incomplete" in (check_step(str(d)) or "")
    (d / MANIFEST).write_text("{not json")
    assert "unreadable" in (check_step(str(d)) or "")


def test_resume_skips_incomplete_and_corrupt_steps_and_moves_them_aside(tmp_path):
    folder = tmp_path / "checkpoint"
    make_step(folder, 2)
    make_step(folder, 4)
    flip(folder / "step-4" / "__0_0.distcp")
    make_step(folder, 6, sealed=False)  # a save killed midway
    plan = plan_resume(str(folder), run_id="run-b", training_steps=10)
    assert plan.step == 2 and not plan.complete
    assert len(plan.lines) == 2
    assert "step-6 skipped: incomplete" in plan.lines[0]
    assert "step-4 skipped" in plan.lines[1] and "__0_0.distcp" in plan.lines[1]
    assert sorted(os.listdir(folder)) == ["step-2"]
    aside = tmp_path / "checkpoint.aside" / "run-b"
    assert sorted(os.listdir(aside)) == ["step-4", "step-6"]
    assert check_step(str(aside / "step-6"), sha256=False) is not None, "moved as it was"
    assert (aside / "step-4" / "__0_0.distcp").stat().st_size > 4096, "moved, not deleted"


def test_resume_with_no_verified_step_is_an_error(tmp_path):
    folder = tmp_path / "checkpoint"
    make_step(folder, 4)
    flip(folder / "step-4" / ".metadata")
    with pytest.raises(CheckpointError, match=r"no checkpoint in .* verifies .*\.metadata"):
        plan_resume(str(folder), run_id="run-b", training_steps=10)
    # only unfinished saves: a fresh start, each one named
    folder2 = tmp_path / "c2"
    make_step(folder2, 4, sealed=False)
    plan = plan_resume(str(folder2), run_id="run-b", training_steps=10)
    assert plan.step == -1 and "step-4 skipped: incomplete" in plan.lines[0]


def test_folder_past_training_steps_is_refused(tmp_path):
    folder = tmp_path / "checkpoint"
    make_step(folder, 24)
    with pytest.raises(
        CheckpointError, match=r"holds step-24, past training.steps = 12.*--training.steps"
    ):
        plan_resume(str(folder), run_id="r", training_steps=12)
    plan = plan_resume(str(folder), run_id="r", training_steps=24)
    assert plan.step == 24 and plan.complete


def test_load_step_below_newest_needs_discard_later_steps(tmp_path):
    folder = tmp_path / "checkpoint"
    for step in (4, 8, 12):
        make_step(folder, step)
    with pytest.raises(
        CheckpointError, match="older than the newest checkpoint step-12.*discard_later_steps"
    ):
        plan_resume(str(folder), run_id="r", load_step=4, training_steps=30)
    assert sorted(os.listdir(folder)) == ["step-12", "step-4", "step-8"], "nothing moved"
    plan = plan_resume(
        str(folder), run_id="r", load_step=4, training_steps=30, discard_later_steps=True
    )
    assert plan.step == 4 and sorted(os.listdir(folder)) == ["step-4"]
    aside = tmp_path / "checkpoint.aside" / "r"
    assert sorted(os.listdir(aside)) == ["step-12", "step-8"]
    assert check_step(str(aside / "step-12")) is None, "moved intact"


def test_explicit_load_step_that_fails_verification_names_the_file(tmp_path):
    folder = tmp_path / "checkpoint"
    make_step(folder, 4)
    flip(folder / "step-4" / "__1_0.distcp")
    with pytest.raises(
        CheckpointError, match=r"load_step = 4: step-4 fails verification: .*__1_0\.distcp"
    ):
        plan_resume(str(folder), run_id="r", load_step=4, training_steps=30)
    with pytest.raises(CheckpointError, match=r"no step-5 in .* \(present: step-4\)"):
        plan_resume(str(folder), run_id="r", load_step=5, training_steps=30)


def test_unwritable_checkpoint_folder_is_found_at_once(tmp_path):
    check_writable(str(tmp_path / "ok"))
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match=r"checkpoint folder .*file/ckpt is not writable"):
        check_writable(str(tmp_path / "file" / "ckpt"))
    with pytest.raises(CheckpointError, match="is not writable"):
        check_writable("/proc/torchtitan_cp_probe")  # read-only for root too


def test_async_checkpointing_is_rejected():
    with pytest.raises(ValueError, match="async_mode = 'async' is not supported"):
        HybridCheckpointManager.Config(async_mode="async")


@pytest.mark.slow
def test_run_lock_refuses_a_second_holder_and_takes_over_a_stale_one(tmp_path):
    first = RunLock(str(tmp_path))
    assert first.acquire("run-1", "2026-01-01T00:00:00Z") is None
    second = RunLock(str(tmp_path))
    with pytest.raises(RunError) as e:
        second.acquire("run-2", "2026-01-01T00:01:00Z")
    msg = str(e.value)
    assert f"pid {os.getpid()}" in msg and "started 2026-01-01T00:00:00Z" in msg and "\n" not in msg
    first.release()
    assert second.acquire("run-2", "t") is None, "a clean release leaves no stale lock"
    second.release()
    # A holder that died (here: a child that exits holding the lock) leaves its record behind.
    code = (
        "import sys; from torchtitan_cp.run.lock import RunLock; "
        f"RunLock({str(tmp_path)!r}).acquire('run-dead', 'then'); sys.exit(0)"
    )
    run_python(code, check=True)
    third = RunLock(str(tmp_path))
    line = third.acquire("run-3", "now")
    assert line is not None and "stale" in line and "run run-dead" in line
    third.release()


def test_supersede_rows_keeps_one_history(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [{"run_header": {"run_id": "a"}}] + [{"step": s, "loss": float(s)} for s in range(1, 7)]
    rows.append({"step": 5, "validation_loss": 1.0})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert supersede_rows(str(path), 3) == 4
    kept = path.read_text().splitlines()
    assert json.loads(kept[0]) == {"run_header": {"run_id": "a"}}
    assert [r["step"] for r in read_rows(str(path))] == [1, 2, 3]
    moved = [
        json.loads(x) for x in (tmp_path / "metrics.superseded.jsonl").read_text().splitlines()
    ]
    assert moved[0] == {"run_header": {"run_id": "a"}}
    assert [r["step"] for r in moved[1:]] == [4, 5, 6, 5]
    assert supersede_rows(str(path), 3) == 0


@pytest.mark.slow
def test_checkpoint_cli_verify_and_seal(tmp_path):
    d = make_step(tmp_path, 7, sealed=False)
    p = run_module("torchtitan_cp.checkpoint", "verify", str(d))
    assert p.returncode == 1 and "incomplete" in p.stderr
    shard = d / "__0_0.distcp"
    full = shard.read_bytes()
    shard.write_bytes(full[:64])
    p = run_module("torchtitan_cp.checkpoint", "seal", str(d))
    assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr
    assert f"will not seal {d}: {shard} is truncated: 64 bytes" in p.stderr
    shard.write_bytes(full)
    p = run_module("torchtitan_cp.checkpoint", "seal", str(d))
    assert p.returncode == 0, p.stderr
    p = run_module("torchtitan_cp.checkpoint", "verify", str(d))
    assert p.returncode == 0 and "ok" in p.stdout


class _State:
    """A minimal Stateful for the manager's dataloader and LR-scheduler slots."""

    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict:
        return {"n": self.n}

    def load_state_dict(self, sd: dict) -> None:
        self.n = sd["n"]


def _manager(tmp_path: Path, run_id: str) -> HybridCheckpointManager:
    import torch

    model = torch.nn.Linear(4, 3)
    config = HybridCheckpointManager.Config(enable=True, interval=2, keep_latest_k=0)
    manager = HybridCheckpointManager(
        config,
        dataloader=_State(),  # pyrefly: ignore[bad-argument-type]
        model_parts=[model],
        optimizers=torch.optim.AdamW(model.parameters()),  # pyrefly: ignore[bad-argument-type]
        lr_schedulers=_State(),  # pyrefly: ignore[bad-argument-type]
        states={},
        sd_adapter=None,
        base_folder=str(tmp_path),
    )
    manager.run_id = run_id
    return manager


def test_save_writes_a_manifest_and_never_overwrites_another_runs_step(tmp_path):
    folder = tmp_path / "checkpoint"
    first = _manager(tmp_path, "run-a")
    assert first.save(curr_step=2)
    assert check_step(str(folder / "step-2")) is None
    assert json.loads((folder / "step-2" / MANIFEST).read_text())["run_id"] == "run-a"
    first.close()
    second = _manager(tmp_path, "run-b")
    with pytest.raises(
        CheckpointError, match=r"refusing to overwrite .*step-2: a complete checkpoint of run run-a"
    ):
        second.save(curr_step=2)
    assert check_step(str(folder / "step-2")) is None, "left as it was"
    # An unfinished leftover is moved aside, not overwritten in place.
    make_step(folder, 4, sealed=False, run_id="run-a")
    assert second.save(curr_step=4)
    assert check_step(str(folder / "step-4")) is None
    assert (tmp_path / "checkpoint.aside" / "run-b" / "step-4" / "__1_0.distcp").is_file()
    second.close()


def test_load_only_runs_name_bad_steps_but_move_nothing(tmp_path):
    folder = tmp_path / "checkpoint"
    make_step(folder, 2)
    make_step(folder, 4, sealed=False)
    plan = plan_resume(str(folder), run_id="r", training_steps=10, move=False)
    assert plan.step == 2 and "step-4 skipped: incomplete" in plan.lines[0]
    assert "left in place" in plan.lines[0]
    assert sorted(os.listdir(folder)) == ["step-2", "step-4"]


# ------------------------------------------------------------------ issue 15: never blocked

MALFORMED = [
    ({"format": MANIFEST_FORMAT, "step": 4}, 'has no "files" table'),
    ([1, 2], "is a JSON list, not an object"),
    ({"format": MANIFEST_FORMAT, "files": []}, '"files" is not a table'),
    ({"format": MANIFEST_FORMAT, "files": {}}, "lists no files"),
    ({"format": MANIFEST_FORMAT, "files": {"__0_0.distcp": 5}}, "is not a table"),
    ({"format": MANIFEST_FORMAT, "files": {"__0_0.distcp": {"sha256": "0" * 64}}},
     'has no valid "bytes"'),
    ({"format": MANIFEST_FORMAT, "files": {"__0_0.distcp": {"bytes": 3, "sha256": 7}}},
     'has no valid "sha256"'),
    ({"format": MANIFEST_FORMAT, "files": {"../x": {"bytes": 3, "sha256": "0" * 64}}},
     "not a file inside the step folder"),
    ({"format": "other/1", "files": {}}, "has format 'other/1'"),
]  # fmt: skip # a table, laid out by hand to read across


@pytest.mark.parametrize("manifest, why", MALFORMED, ids=[w for _, w in MALFORMED])
def test_malformed_manifests_of_any_shape_are_an_incomplete_step(tmp_path, capsys, manifest, why):
    """Before: valid JSON without "files" crashed every rank with KeyError (resume and verify)."""
    folder = tmp_path / "checkpoint"
    make_step(folder, 2)
    d = make_step(folder, 4, sealed=False)
    (d / MANIFEST).write_text(json.dumps(manifest))
    plan = plan_resume(str(folder), run_id="r", training_steps=10)
    assert plan.step == 2, "resumed from the step before"
    assert (
        plan.lines[0].startswith("checkpoint step-4 skipped: incomplete: ") and why in plan.lines[0]
    )
    assert str(d / MANIFEST) in plan.lines[0] and "moved to" in plan.lines[0]
    assert (tmp_path / "checkpoint.aside" / "r" / "step-4").is_dir()
    moved = tmp_path / "checkpoint.aside" / "r" / "step-4"
    assert checkpoint_main(["verify", str(moved)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"checkpoint: error: {moved}: incomplete: ") and why in err
    assert err.count("\n") == 1


def test_seal_refuses_a_step_that_does_not_load(tmp_path, capsys):
    """Before: seal wrote a manifest for a truncated shard (and "0 files" for an empty folder),
    and the resume from it ended in a 244-line traceback."""
    d = make_step(tmp_path, 5, sealed=False)
    shard = d / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])  # cut short
    assert checkpoint_main(["seal", str(d)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"checkpoint: error: will not seal {d}: {shard} is truncated: 100 bytes")
    assert not (d / MANIFEST).exists()
    (d / ".metadata").write_bytes((d / ".metadata").read_bytes()[:50])
    assert checkpoint_main(["seal", str(d)]) == 2
    assert f"{d}/.metadata cannot be read" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert checkpoint_main(["seal", str(empty)]) == 2
    assert (
        capsys.readouterr().err == f"checkpoint: error: {empty} is empty: not a checkpoint step\n"
    )
    assert checkpoint_main(["verify", str(empty)]) == 2, "an empty folder is not ok"
    assert "is empty: not a checkpoint step" in capsys.readouterr().err
    # A good step: seal says what it checked, verify agrees.
    good = make_step(tmp_path, 6, sealed=False)
    assert checkpoint_main(["seal", str(good)]) == 0
    out = capsys.readouterr().out
    assert "wrote manifest.sha256.json (3 files" in out
    assert "checked: .metadata loads and every byte range it lists lies inside its file" in out
    assert checkpoint_main(["verify", str(good)]) == 0
    assert f"{good}: ok (3 files match the manifest and load" in capsys.readouterr().out


def test_a_sealed_truncated_step_is_skipped_at_resume(tmp_path):
    """A step sealed before seal checked (or cut after its manifest was hashed from the short
    file) matches its manifest but cannot load: resume names the file and falls back."""
    folder = tmp_path / "checkpoint"
    make_step(folder, 2)
    d = make_step(folder, 4, sealed=False)
    shard = d / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:200])
    write_manifest(str(d), step=4, run_id="old")
    plan = plan_resume(str(folder), run_id="r", training_steps=10)
    assert plan.step == 2
    assert f"checkpoint step-4 skipped: {shard} is truncated: 200 bytes" in plan.lines[0]


def test_verify_on_the_checkpoint_folder_verifies_each_step(tmp_path, capsys):
    """Before: "incomplete: ... (a save that did not finish)" for the checkpoint folder itself."""
    folder = tmp_path / "checkpoint"
    make_step(folder, 2)
    make_step(folder, 4)
    flip(folder / "step-4" / "__1_0.distcp")
    assert checkpoint_main(["verify", str(folder)]) == 1
    captured = capsys.readouterr()
    assert captured.out.startswith(f"{folder}: a checkpoint folder with 2 step(s): step-2, step-4")
    assert f"{folder}/step-2: ok" in captured.out
    assert captured.err.startswith(f"checkpoint: error: {folder}/step-4: {folder}/step-4/__1_0")
    assert checkpoint_main(["seal", str(folder)]) == 2
    assert f"is a checkpoint folder (step-2, step-4); seal one step: {folder}/step-4" in (
        capsys.readouterr().err
    )


def test_checkpoint_that_does_not_fit_names_the_first_parameter(tmp_path):
    """What a resume with another layer_pattern, CP degree or process count meets (before: a
    220-line traceback, or AssertionError: dp_degree is inconsistent)."""
    import torch
    import torch.distributed.checkpoint as dcp

    saved = {
        "layers.0.w": torch.zeros(4, 3),
        "layers.1.wq": torch.zeros(2),
        "dataloader": {"dp_rank_0": b"a", "dp_rank_1": b"b", "world_size": 2},
    }
    dcp.save(saved, checkpoint_id=str(tmp_path))
    same = {"layers.0.w": torch.ones(4, 3), "layers.1.wq": torch.ones(2), "dataloader": {}}
    assert fit_problem(same, str(tmp_path), dp_world_size=2) is None
    other_pattern = {"layers.0.w": torch.ones(4, 3), "layers.1.dt_bias": torch.ones(2)}
    assert fit_problem(other_pattern, str(tmp_path)) == (
        "this model's parameter layers.1.dt_bias is not in the checkpoint"
    )
    wider = {"layers.0.w": torch.ones(4, 5), "layers.1.wq": torch.ones(2)}
    assert fit_problem(wider, str(tmp_path)) == (
        "parameter layers.0.w is [4, 3] in the checkpoint but [4, 5] in this model"
    )
    fewer = {"layers.0.w": torch.ones(4, 3)}
    assert fit_problem(fewer, str(tmp_path)) == (
        "the checkpoint's parameter layers.1.wq is not in this model"
    )
    problem = fit_problem(same, str(tmp_path), dp_world_size=1)
    assert problem is not None and "saved by 2 data-parallel rank(s) and this run has 1" in problem
    line = str(fit_error(str(tmp_path), problem))
    assert "--checkpoint.initial_load_model_only" in line and "NPROC" in line
    assert "layer_pattern" in str(fit_error(str(tmp_path), "x"))


def test_mamba2_checkpoint_with_the_packed_in_proj_is_refused_naming_it(tmp_path):
    """A checkpoint saved before Mamba2's in_proj was split into one weight per segment
    (2026-12-03) has the same number of values under another name: refused in one line that
    names the old parameter and the split, not loaded around it."""
    import torch
    import torch.distributed.checkpoint as dcp

    from torchtitan_cp.models import model_config

    model = model_config("debug", layer_pattern="MA", vocab_size=97).build()
    mixer = model.layers["0"].mixer
    now = {k: v.detach() for k, v in model.state_dict().items()}
    split = {f"layers.0.mixer.{name}.weight" for name in mixer.in_projections}
    old = {k: v for k, v in now.items() if k not in split}
    old["layers.0.mixer.in_proj.weight"] = torch.cat(
        [now[f"layers.0.mixer.{name}.weight"] for name in mixer.in_projections]
    )
    dcp.save(old, checkpoint_id=str(tmp_path))
    problem = fit_problem(now, str(tmp_path))
    assert problem is not None and problem.startswith(
        "its parameter layers.0.mixer.in_proj.weight is Mamba2's packed [z | x | B | C | dt] "
        "projection, split into z_proj, x_proj, B_proj, C_proj and dt_proj"
    ), problem
    line = str(fit_error(str(tmp_path), problem))
    assert "no longer reads it" in line and "new --dump_folder" in line and "\n" not in line


def test_lock_of_another_host_or_a_live_process_is_refused(tmp_path):
    """Before: taken over "because that process is gone" without checking."""
    lock = tmp_path / "run.lock"

    def holder(**kw) -> None:
        record = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "run_id": "r-old",
            "start_time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        } | kw
        lock.write_text(json.dumps(record) + "\n")

    holder(host="other-host")
    with pytest.raises(RunError) as e:
        RunLock(str(tmp_path)).acquire("run-new", "t")
    msg = str(e.value)
    assert "names pid" in msg and "host other-host" in msg and "a run on another host" in msg
    assert f"delete {lock}" in msg and "\n" not in msg
    # pid 1 runs on this host and started before "now": it may be the holder
    holder(pid=1)
    with pytest.raises(RunError, match="process 1 is still running on this host"):
        RunLock(str(tmp_path)).acquire("run-new", "t")
    assert json.loads(lock.read_text())["run_id"] == "r-old", "the record is left alone"
    # a live pid that started after the lock was taken is a reused pid: the holder is gone
    holder(pid=1, start_time="1971-01-01T00:00:00Z")
    taker = RunLock(str(tmp_path))
    line = taker.acquire("run-new", "t")
    assert line is not None and "pid 1 now belongs to a process started after that run" in line
    taker.release()


def test_truncated_metrics_jsonl_is_repaired_and_the_tail_kept(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"run_header": {"run_id": "a"}}\n{"step": 1, "loss": 1.0}\n{"step": 2, "lo')
    line = repair_jsonl(str(path), "run-b")
    assert line is not None and "moved 1 line(s) that are not JSON objects (line 3" in line
    assert str(tmp_path / "metrics.jsonl.broken-run-b") in line
    assert path.read_text().endswith('{"step": 1, "loss": 1.0}\n')
    assert (tmp_path / "metrics.jsonl.broken-run-b").read_text() == '{"step": 2, "lo\n'
    assert [r["step"] for r in read_rows(str(path))] == [1]
    assert repair_jsonl(str(path), "run-c") is None, "a clean file is left alone"


def test_read_rows_skips_what_is_not_a_json_object_and_never_raises(tmp_path):
    """Before: ``read_rows`` raised TypeError on a line ``42`` (valid JSON, not an object),
    which ``repair_jsonl`` kept, and JSONDecodeError on a row a killed run cut short."""
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"run_header": {}}\n42\n{"step": 1}\n[1]\n"x"\nnull\n{"step": 2, "lo')
    assert [r["step"] for r in read_rows(str(path))] == [1]
    line = repair_jsonl(str(path), "r")
    assert line is not None and "moved 5 line(s) that are not JSON objects (line 2, 4, 5, 6, 7" in (
        line
    )
    assert path.read_text() == '{"run_header": {}}\n{"step": 1}\n'


def _resume_with_a_stopped_rank(rank: int, world: int, folder: str) -> tuple[str, float] | None:
    """Rank 1 never joins the resume planning (stopped); rank 0 plans on a control group whose
    timeout is the run's comm.init_timeout_seconds (2 s here)."""
    from datetime import timedelta

    import torch.distributed as dist

    from torchtitan_cp.run import control, rank_timeout

    pg = control.control_group(timedelta(seconds=2))
    store = dist.distributed_c10d._get_default_store()
    if rank == 1:  # stays away until rank 0 is done, however slow the machine is
        store.wait(["test/rank0_done"], timedelta(seconds=120))
        return None
    begin = time.monotonic()
    try:
        plan_resume(folder, run_id="r", training_steps=10, pg=pg)
    except RuntimeError as e:
        assert rank_timeout.is_timeout(e), e
        err = rank_timeout.timeout_error(
            0, world, key="comm.init_timeout_seconds", seconds=2, grace=2
        )
        return str(err), time.monotonic() - begin
    finally:
        store.set("test/rank0_done", "1")
    return "planned without rank 1", time.monotonic() - begin


def _save_control_with_a_stopped_rank(rank: int, world: int) -> tuple[str, float] | None:
    """The control group made with the start's long timeout (60 s here), lowered to the train
    timeout (2 s) as the checkpointer does once training runs; rank 1 then stays away from a
    save's control collective (rank 0 clearing the step)."""
    from datetime import timedelta

    import torch.distributed as dist

    from torchtitan_cp.run import control

    control.control_group(timedelta(seconds=60))
    control.set_control_timeout(timedelta(seconds=2))
    store = dist.distributed_c10d._get_default_store()
    if rank == 1:
        store.wait(["test/rank0_done"], timedelta(seconds=120))
        return None
    begin = time.monotonic()
    try:
        control.on_rank0(lambda: None, control.control_group())
    except RuntimeError as e:
        return str(e).splitlines()[0], time.monotonic() - begin
    finally:
        store.set("test/rank0_done", "1")
    return "answered without rank 1", time.monotonic() - begin


@pytest.mark.slow
def test_a_save_waits_on_a_stopped_rank_for_the_train_timeout_only():
    """Before: the control group kept comm.init_timeout_seconds (300 s) for the whole run, so a
    rank stopped while a save cleared its step or wrote its manifest held the others 300 s (the
    one line then named comm.train_timeout_seconds). 2 s here, against 60 s unlowered; the bound
    leaves room for a loaded machine (see test_a_stopped_rank_ends_the_resume_...)."""
    from torchtitan_cp.run import rank_timeout

    out, seconds = run_distributed(_save_control_with_a_stopped_rank, 2, timeout=120)[0]
    assert rank_timeout.is_timeout(RuntimeError(out)), out
    assert seconds < 30, seconds


@pytest.mark.slow
def test_a_stopped_rank_ends_the_resume_within_the_comm_timeout(tmp_path):
    """Before: the control group's timeout was an hour, and the comm timeouts did not reach it:
    a rank stopped during resume planning hung the run with no output."""
    make_step(tmp_path / "checkpoint", 2)
    out, seconds = run_distributed(
        _resume_with_a_stopped_rank, 2, str(tmp_path / "checkpoint"), timeout=60
    )[0]
    assert out.startswith(
        "rank 0: no answer from rank 1 within 2 s (comm.init_timeout_seconds): it stopped"
    ), out
    # 2 s timeout + 2 s for the other ranks to say they are there, both wall-clock; around them
    # only the planning's CPU work (a small step). The bound tells those seconds from the hour
    # of before with room for a loaded machine; rank 1 stays away until rank 0 is done, so
    # nothing here races the machine's speed.
    assert seconds < 30, seconds
