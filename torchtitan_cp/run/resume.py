"""Resume planning: which step of a run's checkpoint folder this run loads, and the steps it
moves aside.

At start (``plan_resume``) the checkpoint folder is scanned: the newest step that verifies is the
resume point; each incomplete or mismatching step newer than it is named in a log line and moved
aside to ``<folder>.aside/<run_id>/`` (never deleted). An explicit ``load_step`` or
``initial_load_path`` that fails verification is an error naming the file. ``load_step`` below
newer complete steps is refused unless ``discard_later_steps`` moves them aside.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any

from torchtitan_cp.run.control import barrier, broadcast, group_rank, on_rank0
from torchtitan_cp.run.errors import CheckpointError
from torchtitan_cp.run.manifest import check_step, read_manifest
from torchtitan_cp.run.paths import probe_write

__all__ = [
    "ResumePlan",
    "StepDir",
    "aside_folder",
    "check_initial_load",
    "check_writable",
    "move_aside",
    "plan_resume",
    "scan_steps",
]

STEP_RE = re.compile(r"step-(\d+)")
"""A step folder's name, ``step-N``."""


@dataclass
class StepDir:
    step: int
    path: str
    complete: bool  # has a well-formed manifest (not yet verified)
    why: str = ""  # why it is incomplete


def scan_steps(folder: str) -> list[StepDir]:
    """``step-N`` folders directly under ``folder``, oldest first."""
    if not os.path.isdir(folder):
        return []
    out = []
    for name in os.listdir(folder):
        m = STEP_RE.fullmatch(name)
        path = os.path.join(folder, name)
        if m and os.path.isdir(path):
            manifest, why = read_manifest(path)
            out.append(StepDir(int(m.group(1)), path, manifest is not None, why))
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
    try:
        os.makedirs(folder, exist_ok=True)
        probe_write(folder)
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
    steps: list[StepDir] = broadcast(scan_steps(folder) if group_rank(pg) == 0 else None, pg)
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
            reason = problem if s.complete else s.why
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
    barrier(pg)
    plan.complete = training_steps is not None and plan.step >= 0 and plan.step >= training_steps
    return plan


def check_initial_load(path: str, *, sha256: bool = True, pg: Any = None) -> None:
    """``checkpoint.initial_load_path`` must verify (a DCP folder with a manifest)."""
    problem = check_step(path, sha256=sha256, pg=pg)
    if problem is not None:
        raise CheckpointError(
            f"checkpoint.initial_load_path = {path} fails verification: {problem}"
        )
