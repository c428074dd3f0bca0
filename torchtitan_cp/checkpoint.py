"""Checkpoint integrity on top of torchtitan's DCP checkpoints (the format is unchanged).

Every save ends with ``step-N/manifest.sha256.json``: the sha256 and size of each file in the
step folder, written by rank 0 after all ranks finished writing, under a temporary name and then
renamed, so a step folder without a valid manifest is an incomplete save. Ranks hash disjoint
shares of the files (parallel I/O) and rank 0 merges them.

At start (``plan_resume``) the checkpoint folder is scanned: the newest step that verifies is the
resume point; each incomplete or mismatching step newer than it is named in a log line and moved
aside to ``<folder>.aside/<run_id>/`` (never deleted). An explicit ``load_step`` or
``initial_load_path`` that fails verification is an error naming the file. ``load_step`` below
newer complete steps is refused unless ``discard_later_steps`` moves them aside.

CLI: ``python -m torchtitan_cp.checkpoint verify|seal STEP_DIR`` checks a step folder, or writes
a manifest for one you trust (a checkpoint written by plain torchtitan).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Literal

import torch.distributed as dist
from torchtitan.components.checkpoint import TRAIN_STATE, CheckpointManager
from torchtitan.tools.logging import logger

from torchtitan_cp.run_lock import RunError, new_run_id

MANIFEST = "manifest.sha256.json"
MANIFEST_FORMAT = "torchtitan_cp.checkpoint-manifest/1"
_STEP_RE = re.compile(r"step-(\d+)")
_CHUNK = 8 << 20


class CheckpointError(RunError):
    """A checkpoint that cannot be used as asked; the message names the step folder or file."""


# ----------------------------------------------------------------------------- collectives

_CONTROL_GROUP: tuple[Any, Any] | None = None  # (the default group it belongs to, the group)


def control_group() -> Any:
    """A gloo group with a long timeout for checkpoint control (hashing can take minutes on a
    big checkpoint; the training groups' timeouts are short). Every rank must make the first
    call at the same point; None without torch.distributed. A new default group (a second
    trainer in the same process, after ``destroy_process_group``) gets a new one."""
    global _CONTROL_GROUP
    if not dist.is_initialized():
        return None
    world = dist.group.WORLD
    if _CONTROL_GROUP is None or _CONTROL_GROUP[0] is not world:
        _CONTROL_GROUP = (world, dist.new_group(backend="gloo", timeout=timedelta(hours=1)))
    return _CONTROL_GROUP[1]


def _rank(pg: Any) -> int:
    return dist.get_rank(pg) if pg is not None else 0


def _world(pg: Any) -> int:
    return dist.get_world_size(pg) if pg is not None else 1


def broadcast(obj: Any, pg: Any) -> Any:
    """Rank 0's ``obj`` on every rank of ``pg``."""
    if pg is None:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=dist.get_global_rank(pg, 0), group=pg)
    return box[0]


def _all_gather(obj: Any, pg: Any) -> list[Any]:
    if pg is None:
        return [obj]
    out: list[Any] = [None] * _world(pg)
    dist.all_gather_object(out, obj, group=pg)
    return out


def _barrier(pg: Any) -> None:
    if pg is not None:
        dist.barrier(group=pg)


def on_rank0(fn: Any, pg: Any) -> Any:
    """Run ``fn()`` on rank 0; every rank gets its result, or raises the same
    ``RunError`` rank 0 raised (so all ranks stop with one identical line)."""
    result: Any = None
    error: RunError | None = None
    if _rank(pg) == 0:
        try:
            result = fn()
        except RunError as e:
            error = e
    result, error = broadcast((result, error), pg)
    if error is not None:
        raise error
    return result


# ----------------------------------------------------------------------------- manifests


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def list_files(step_dir: str) -> list[str]:
    """Files under ``step_dir`` (relative, sorted), leaving out the manifest and its temp files."""
    out = []
    for root, _, names in os.walk(step_dir):
        for name in names:
            rel = os.path.relpath(os.path.join(root, name), step_dir)
            if not rel.startswith(MANIFEST):
                out.append(rel)
    return sorted(out)


def _hash_share(step_dir: str, files: list[str], pg: Any) -> dict[str, dict[str, Any]]:
    """sha256 and size of ``files``; rank r hashes files r, r + world, ... (all ranks call)."""
    mine = {}
    for rel in files[_rank(pg) :: _world(pg)]:
        path = os.path.join(step_dir, rel)
        try:
            mine[rel] = {"sha256": file_sha256(path), "bytes": os.path.getsize(path)}
        except OSError as e:
            mine[rel] = {"error": e.strerror or str(e)}
    merged: dict[str, dict[str, Any]] = {}
    for part in _all_gather(mine, pg):
        merged.update(part)
    return merged


def write_manifest(step_dir: str, *, step: int, run_id: str, pg: Any = None) -> dict[str, Any]:
    """Hash every file of a finished save and write the manifest atomically (all ranks call,
    after all ranks finished writing the step)."""
    _barrier(pg)
    files = broadcast(list_files(step_dir) if _rank(pg) == 0 else None, pg)
    digests = _hash_share(step_dir, files, pg)
    manifest = {
        "format": MANIFEST_FORMAT,
        "step": step,
        "run_id": run_id,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "files": digests,
    }

    def write() -> None:
        bad = {k: v["error"] for k, v in digests.items() if "error" in v}
        if bad:
            raise CheckpointError(f"checkpoint {step_dir}: cannot read back saved files: {bad}")
        tmp = os.path.join(step_dir, f"{MANIFEST}.tmp-{os.getpid()}")
        with open(tmp, "w") as f:
            json.dump(manifest, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(step_dir, MANIFEST))
        _fsync_dir(step_dir)

    on_rank0(write, pg)
    return manifest


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def read_manifest(step_dir: str) -> tuple[dict[str, Any] | None, str]:
    """(manifest, "") or (None, why it is missing or invalid)."""
    path = os.path.join(step_dir, MANIFEST)
    if not os.path.isfile(path):
        return None, f"incomplete: no {MANIFEST} (a save that did not finish)"
    try:
        with open(path) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        return None, f"{path} is unreadable ({e})"
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        return None, f"{path} is not a {MANIFEST_FORMAT} manifest"
    return manifest, ""


def check_step(step_dir: str, *, sha256: bool = True, pg: Any = None) -> str | None:
    """None when ``step_dir`` matches its manifest, else the first problem, naming the file.
    ``sha256=False`` checks presence and sizes only (no reading). All ranks call."""
    manifest, why = broadcast(read_manifest(step_dir) if _rank(pg) == 0 else None, pg)
    if manifest is None:
        return why
    expected: dict[str, dict[str, Any]] = manifest["files"]
    files = sorted(expected)
    got: dict[str, dict[str, Any]]
    if sha256:
        got = _hash_share(step_dir, files, pg)
    else:
        got = {}
        for rel in files:
            path = os.path.join(step_dir, rel)
            got[rel] = {"bytes": os.path.getsize(path)} if os.path.isfile(path) else {"error": ""}
    for rel in files:
        path = os.path.join(step_dir, rel)
        want, have = expected[rel], got[rel]
        if "error" in have:
            return f"{path} is missing or unreadable"
        if have["bytes"] != want["bytes"]:
            return f"{path} has {have['bytes']} bytes, its manifest says {want['bytes']}"
        if sha256 and have["sha256"] != want["sha256"]:
            return (
                f"{path} does not match its manifest (sha256 {have['sha256'][:12]}..., "
                f"expected {want['sha256'][:12]}...): the file is corrupted"
            )
    return None


# ----------------------------------------------------------------------------- resume plan


@dataclass
class StepDir:
    step: int
    path: str
    complete: bool  # has a manifest (not yet verified)


def scan_steps(folder: str) -> list[StepDir]:
    """``step-N`` folders directly under ``folder``, oldest first."""
    if not os.path.isdir(folder):
        return []
    out = []
    for name in os.listdir(folder):
        m = _STEP_RE.fullmatch(name)
        path = os.path.join(folder, name)
        if m and os.path.isdir(path):
            out.append(StepDir(int(m.group(1)), path, os.path.isfile(os.path.join(path, MANIFEST))))
    return sorted(out, key=lambda s: s.step)


def aside_folder(folder: str, run_id: str) -> str:
    """Where this run moves step folders it will not use: ``<folder>.aside/<run_id>``."""
    return os.path.join(os.path.normpath(folder) + ".aside", run_id)


def move_aside(step_dir: str, folder: str, run_id: str) -> str:
    dest_dir = aside_folder(folder, run_id)
    os.makedirs(dest_dir, exist_ok=True)
    dest = os.path.join(dest_dir, os.path.basename(os.path.normpath(step_dir)))
    os.replace(step_dir, dest)
    return dest


@dataclass
class ResumePlan:
    """What this run loads from its own checkpoint folder (``step`` -1: none)."""

    step: int = -1
    complete: bool = False  # the loaded step already reached training.steps
    lines: list[str] = field(default_factory=list)  # what was skipped or moved, for the log


def check_writable(folder: str) -> None:
    """Create ``folder`` and a probe file in it; a ``CheckpointError`` if that fails."""
    probe = os.path.join(folder, f".write-probe-{os.getpid()}")
    try:
        os.makedirs(folder, exist_ok=True)
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise CheckpointError(
            f"checkpoint folder {folder} is not writable ({e.strerror}): make it writable, pass "
            "another --dump_folder or --checkpoint.folder, or --checkpoint.load_only to only load"
        ) from None


def plan_resume(
    folder: str,
    *,
    run_id: str,
    load_step: int = -1,
    training_steps: int | None = None,
    discard_later_steps: bool = False,
    sha256: bool = True,
    move: bool = True,
    pg: Any = None,
) -> ResumePlan:
    """Choose the step to resume from (see the module docstring). Collective over ``pg``; rank 0
    moves folders aside (``move=False``, for load-only runs: names them only); every rank
    returns the same plan or raises the same error."""
    steps: list[StepDir] = broadcast(scan_steps(folder) if _rank(pg) == 0 else None, pg)
    by_step = {s.step: s for s in steps}
    plan = ResumePlan()
    newest_complete = max((s.step for s in steps if s.complete), default=-1)

    def past(step: int) -> CheckpointError:
        return CheckpointError(
            f"checkpoint folder {folder} holds step-{step}, past training.steps = "
            f"{training_steps}: nothing to train. Raise --training.steps above {step} to "
            "continue that run, or pass a new --dump_folder for a new run"
        )

    aside: list[tuple[StepDir, str]] = []
    if load_step < 0:
        if training_steps is not None and newest_complete > training_steps:
            raise past(newest_complete)
        for s in reversed(steps):
            problem = check_step(s.path, sha256=sha256, pg=pg) if s.complete else None
            if s.complete and problem is None:
                plan.step = s.step
                break
            reason = problem if s.complete else f"incomplete: no {MANIFEST} (a killed save?)"
            aside.append((s, f"checkpoint step-{s.step} skipped: {reason}"))
        if plan.step < 0 and newest_complete >= 0:
            # Starting over would silently drop the run's progress: the user decides.
            skipped = "; ".join(line for _, line in aside)
            raise CheckpointError(
                f"no checkpoint in {folder} verifies ({skipped}); restore a good copy, or pass "
                "a new --dump_folder to start over"
            )
    else:
        where = f"checkpoint.load_step = {load_step}"
        if load_step not in by_step:
            have = ", ".join(f"step-{s.step}" for s in steps) or "none"
            raise CheckpointError(f"{where}: no step-{load_step} in {folder} (present: {have})")
        later = [s for s in steps if s.step > load_step]
        later_complete = [s.step for s in later if s.complete]
        if later_complete and not discard_later_steps:
            raise CheckpointError(
                f"{where} is older than the newest checkpoint step-{max(later_complete)} in "
                f"{folder}; saving from step {load_step} would mix two runs. Pass "
                "--checkpoint.discard_later_steps to move the later steps to "
                f"{aside_folder(folder, run_id)} (nothing is deleted), or use a new --dump_folder"
            )
        if training_steps is not None and load_step > training_steps:
            raise past(load_step)
        problem = check_step(by_step[load_step].path, sha256=sha256, pg=pg)
        if problem is not None:
            raise CheckpointError(f"{where}: step-{load_step} fails verification: {problem}")
        plan.step = load_step
        for s in reversed(later):
            aside.append((s, f"checkpoint step-{s.step} is newer than {where}"))

    def move_all() -> list[str]:
        lines = []
        for s, why in aside:
            if not move:
                lines.append(f"{why}; left in place (checkpoint.load_only)")
                continue
            try:
                lines.append(f"{why}; moved to {move_aside(s.path, folder, run_id)}")
            except OSError as e:
                raise CheckpointError(
                    f"{why}, but moving {s.path} aside failed ({e.strerror}): move it yourself"
                ) from None
        return lines

    plan.lines = on_rank0(move_all, pg)
    _barrier(pg)
    plan.complete = training_steps is not None and plan.step >= 0 and plan.step >= training_steps
    return plan


def check_initial_load(path: str, *, sha256: bool = True, pg: Any = None) -> None:
    """``checkpoint.initial_load_path`` must verify (a DCP folder with a manifest)."""
    problem = check_step(path, sha256=sha256, pg=pg)
    if problem is not None:
        raise CheckpointError(
            f"checkpoint.initial_load_path = {path} fails verification: {problem}"
        )


# ----------------------------------------------------------------------------- the manager


class HybridCheckpointManager(CheckpointManager):
    """torchtitan's DCP ``CheckpointManager`` plus manifests, verified resume and a guard
    against overwriting another run's verified step."""

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        discard_later_steps: bool = False
        """With load_step below the newest step: move the later steps to
        <folder>.aside/<run_id>/ (never deleted) instead of refusing to start."""

        verify: Literal["sha256", "size"] = "sha256"
        """Check a checkpoint before loading it: sha256 of every file (reads it all once), or
        file presence and sizes only (for checkpoints too big to hash at every start)."""

        def __post_init__(self) -> None:
            CheckpointManager.Config.__post_init__(self)
            if self.async_mode != "disabled":
                raise ValueError(
                    f"checkpoint.async_mode = '{self.async_mode}' is not supported: the "
                    "integrity manifest is written once every rank has finished writing; use "
                    "'disabled'"
                )

    def __init__(self, config: Config, **kwargs: Any) -> None:
        self.plan: ResumePlan | None = None
        self.run_id: str | None = None
        self.resumed_from = 0
        self.on_loaded: Any = None
        self.discard_later_steps = config.discard_later_steps
        self.sha256 = config.verify == "sha256"
        super().__init__(config, **kwargs)

    def _pg(self) -> Any:
        return control_group()

    def _run_id(self) -> str:
        if self.run_id is None:
            self.run_id = broadcast(new_run_id(), self._pg())
        return self.run_id

    def load(self, step: int = -1) -> bool:
        loaded = super().load(step)
        if self.on_loaded is not None:
            self.on_loaded(self.resumed_from)
        return loaded

    def _find_load_step(self, folder: str = "") -> int:
        if self.plan is not None and folder in ("", self.folder):
            return self.plan.step
        return super()._find_load_step(folder)

    def _load(self, step: int = -1) -> bool:
        if self.plan is None:  # built outside HybridTrainer: plan here
            self.plan = plan_resume(
                self.folder,
                run_id=self._run_id(),
                load_step=step,
                discard_later_steps=self.discard_later_steps,
                sha256=self.sha256,
                pg=self._pg(),
            )
            for line in self.plan.lines:
                logger.warning(line)
        if self.plan.step < 0 and self.initial_load_path and not self.initial_load_in_hf:
            check_initial_load(self.initial_load_path, sha256=self.sha256, pg=self._pg())
        loaded = super()._load(self.plan.step)
        train_state = self.states.get(TRAIN_STATE)
        self.resumed_from = int(getattr(train_state, "step", 0)) if loaded else 0
        return loaded

    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        if not self._should_save(curr_step, last_step):
            return False
        step_dir = self._create_checkpoint_id(curr_step)
        run_id = self._run_id()
        pg = self._pg()

        def clear() -> str | None:
            if not os.path.isdir(step_dir):
                return None
            manifest, _ = read_manifest(step_dir)
            if manifest is not None and manifest.get("run_id") != run_id:
                raise CheckpointError(
                    f"refusing to overwrite {step_dir}: a complete checkpoint of run "
                    f"{manifest.get('run_id')}; move it away or use a new --dump_folder"
                )
            return f"moved the unfinished {step_dir} to {move_aside(step_dir, self.folder, run_id)}"

        line = on_rank0(clear, pg)
        if line:
            logger.warning(line)
        saved = super()._save(curr_step, last_step)
        if saved:
            begin = time.monotonic()
            manifest = write_manifest(step_dir, step=curr_step, run_id=run_id, pg=pg)
            size = sum(f["bytes"] for f in manifest["files"].values())
            logger.info(
                f"Wrote {MANIFEST} for step-{curr_step} ({len(manifest['files'])} files, "
                f"{size / 2**20:.1f} MiB) in {time.monotonic() - begin:.2f} seconds."
            )
        return saved


# ----------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m torchtitan_cp.checkpoint",
        description="Check a checkpoint step folder against its manifest, or write a manifest "
        "for a step folder you trust (e.g. saved by plain torchtitan).",
    )
    p.add_argument("command", choices=["verify", "seal"])
    p.add_argument("step_dir")
    args = p.parse_args(argv)
    step_dir = args.step_dir.rstrip("/")
    if not os.path.isdir(step_dir):
        print(f"checkpoint: error: {step_dir} is not a folder", file=sys.stderr)
        return 2
    if args.command == "verify":
        begin = time.monotonic()
        problem = check_step(step_dir)
        if problem:
            print(f"checkpoint: error: {step_dir}: {problem}", file=sys.stderr)
            return 1
        print(f"{step_dir}: ok ({time.monotonic() - begin:.2f} s)")
        return 0
    if os.path.exists(os.path.join(step_dir, MANIFEST)):
        print(f"checkpoint: error: {step_dir} already has a {MANIFEST}", file=sys.stderr)
        return 2
    m = _STEP_RE.fullmatch(os.path.basename(step_dir))
    manifest = write_manifest(step_dir, step=int(m.group(1)) if m else -1, run_id="sealed")
    print(f"{step_dir}: wrote {MANIFEST} ({len(manifest['files'])} files)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
