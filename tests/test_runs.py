"""Checkpoint integrity, one run per dump folder, honest resume and the spike guard, each through
the real entry point (``python -m torchtitan_cp.train``, one process; the 2-rank resume is in
test_train.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers import flip
from tests.launch import (
    REPO,
    python_train,
    python_train_cmd,
    read_metrics,
    read_run_headers,
    torchrun_train,
)

pytestmark = pytest.mark.slow

ARGS = ["--config_file", "configs/debug_cpu.toml", "--validator.no-enable",
        "--metrics.no-enable-wandb", "--checkpoint.enable", "--checkpoint.interval", "2"]  # fmt: skip


@pytest.fixture(scope="module")
def base_run(tmp_path_factory) -> tuple[Path, dict[int, float]]:
    """A finished 4-step run with checkpoints step-2 and step-4, and its losses."""
    dump = tmp_path_factory.mktemp("base") / "run"
    python_train([*ARGS, "--training.steps", "4"], dump_folder=dump)
    return dump, {r["step"]: r["loss"] for r in read_metrics(dump)}


def copy_of(base_run, tmp_path: Path) -> Path:
    dump = tmp_path / "run"
    shutil.copytree(base_run[0], dump)
    return dump


def error_line(proc: subprocess.CompletedProcess, code: int = 2) -> str:
    """The run failed with ``code`` and one error line, no traceback; returns that line."""
    assert proc.returncode == code, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in log(proc), proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("torchtitan_cp.train: error: "), last
    return last


def log(proc: subprocess.CompletedProcess) -> str:
    """Everything the run printed (torchtitan logs to stdout, warnings go to stderr)."""
    return proc.stdout + proc.stderr


def test_flipped_bytes_are_named_and_resume_falls_back(base_run, tmp_path):
    dump = copy_of(base_run, tmp_path)
    shard = dump / "checkpoint" / "step-4" / "__0_0.distcp"
    flip(shard, offset=shard.stat().st_size // 2)
    # Asked for by name: an error naming the shard.
    proc = python_train([*ARGS, "--training.steps", "6", "--checkpoint.load_step", "4"],
                        dump_folder=dump, check=False)  # fmt: skip
    line = error_line(proc)
    assert str(shard) in line and "corrupted" in line, line
    # Automatic resume: step-4 is named, set aside, and the run resumes from step-2 exactly.
    proc = python_train([*ARGS, "--training.steps", "4"], dump_folder=dump)
    assert "checkpoint step-4 skipped" in log(proc) and str(shard) in log(proc)
    rows = read_metrics(dump)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert {r["step"]: r["loss"] for r in rows} == base_run[1], "the corrupted state is not used"
    assert [h["resumed_from_step"] for h in read_run_headers(dump)] == [0, 2]
    assert len(list((dump / "checkpoint.aside").glob("*/step-4/__0_0.distcp"))) == 1


def test_killed_save_is_skipped_with_a_message(base_run, tmp_path):
    dump = copy_of(base_run, tmp_path)
    (dump / "checkpoint" / "step-4" / "manifest.sha256.json").unlink()  # killed before the end
    proc = python_train([*ARGS, "--training.steps", "4"], dump_folder=dump)
    assert "checkpoint step-4 skipped: incomplete" in log(proc)
    assert (dump / "checkpoint" / "step-4" / "manifest.sha256.json").is_file(), "saved anew"
    # metrics.jsonl: one header per run, no step row twice; the replaced rows moved aside
    assert [r["step"] for r in read_metrics(dump)] == [1, 2, 3, 4]
    assert [r["step"] for r in read_metrics(dump, "metrics.superseded.jsonl")] == [3, 4]
    headers = read_run_headers(dump)
    assert [h["resumed_from_step"] for h in headers] == [0, 2]
    assert headers[0]["run_id"] != headers[1]["run_id"]


def test_second_run_on_a_busy_dump_folder_is_refused(tmp_path):
    dump = tmp_path / "run"
    cmd, env = python_train_cmd(
        ["--config_file", "configs/debug_cpu.toml", "--validator.no-enable",
         "--metrics.no-enable-wandb", "--training.steps", "10000"], dump_folder=dump,
    )  # fmt: skip
    first = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        lock = dump / "run.lock"
        deadline = time.monotonic() + 240
        while not (lock.is_file() and lock.read_text().strip()):
            assert first.poll() is None and time.monotonic() < deadline, "first run did not start"
            time.sleep(0.5)
        holder = json.loads(lock.read_text())
        proc = python_train(["--config_file", "configs/debug_cpu.toml", "--training.steps", "2"],
                            dump_folder=dump, check=False)  # fmt: skip
        line = error_line(proc)
        assert "is in use by another run" in line
        assert f"pid {first.pid} on host {holder['host']}, started {holder['start_time']}" in line
        assert first.poll() is None, "the first run goes on"
    finally:
        first.terminate()
        first.wait(timeout=60)


def test_folder_past_training_steps_is_refused(base_run, tmp_path):
    dump = copy_of(base_run, tmp_path)
    line = error_line(python_train([*ARGS, "--training.steps", "2"], dump_folder=dump, check=False))
    assert "holds step-4, past training.steps = 2" in line and "--training.steps" in line
    # The same steps again: the run is complete, said so, and nothing changes.
    proc = python_train([*ARGS, "--training.steps", "4"], dump_folder=dump)
    assert "Nothing to train: checkpoint step-4 already reached training.steps = 4" in log(proc)
    assert read_run_headers(dump) == read_run_headers(base_run[0])


def test_refusal_under_torchrun_is_one_line(base_run, tmp_path):
    """All ranks stop on the same decision; torchrun's root cause shows the one line, not a
    traceback through the recipe."""
    dump = copy_of(base_run, tmp_path)
    proc = torchrun_train([*ARGS, "--training.steps", "2"], nproc=2, dump_folder=dump, check=False)
    assert proc.returncode != 0
    out = log(proc)
    assert "traceback : torchtitan_cp.train: error: checkpoint folder" in out, out[-3000:]
    assert "torchtitan_cp/run/start.py" not in out, "no traceback through the recipe"


def test_load_step_below_newest_needs_discard_later_steps(base_run, tmp_path):
    dump = copy_of(base_run, tmp_path)
    args = [*ARGS, "--training.steps", "4", "--checkpoint.load_step", "2"]
    line = error_line(python_train(args, dump_folder=dump, check=False))
    assert "older than the newest checkpoint step-4" in line and "discard_later_steps" in line
    assert sorted(os.listdir(dump / "checkpoint")) == ["step-2", "step-4"]
    proc = python_train([*args, "--checkpoint.discard_later_steps"], dump_folder=dump)
    assert "checkpoint step-4 is newer than checkpoint.load_step = 2; moved to" in log(proc)
    moved = list((dump / "checkpoint.aside").glob("*/step-4"))
    assert len(moved) == 1 and (moved[0] / "manifest.sha256.json").is_file(), "moved, not deleted"
    assert [r["step"] for r in read_metrics(dump)] == [1, 2, 3, 4]


def test_unwritable_checkpoint_folder_is_found_at_start(tmp_path):
    # /proc refuses new folders even to root (chmod would not stop root)
    args = [*ARGS, "--training.steps", "2", "--checkpoint.folder", "/proc/torchtitan_cp_ckpt"]
    proc = python_train(args, dump_folder=tmp_path / "run", check=False)
    line = error_line(proc)
    # The pre-launch check (validate.py) meets it first; the run's own start check
    # (runs.start_run) says the same for trainers built without the entry point.
    assert "/proc/torchtitan_cp_ckpt" in line and "not writable" in line
    assert "Training starts" not in log(proc) + proc.stdout


GUARD = ["--config_file", "configs/debug_cpu.toml", "--validator.no-enable",
         "--metrics.no-enable-wandb", "--training.steps", "4", "--debug.param_checksums",
         # lr 10 makes step 2's loss jump from 8.8 to ~600
         "--optimizer.param-groups.0.optimizer-kwargs.lr", "10",
         "--spike_guard.factor", "3", "--spike_guard.min_history", "1"]  # fmt: skip


def test_spike_guard_stops_before_the_update(tmp_path):
    line = error_line(python_train(GUARD, dump_folder=tmp_path / "run", check=False), code=1)
    assert "loss spike at step 2" in line and "stopped before the update" in line


def test_spike_guard_skips_the_update(tmp_path):
    dump = tmp_path / "run"
    proc = python_train([*GUARD, "--spike_guard.action", "skip"], dump_folder=dump)
    assert "loss spike at step 2" in log(proc) and "update skipped" in log(proc)
    rows = read_metrics(dump)
    assert [r["spike_guard/skipped_steps"] for r in rows] == [0, 1, 2, 3]
    # skipped updates leave every parameter as it was after step 1
    assert len({r["params_sha256"] for r in rows}) == 1
