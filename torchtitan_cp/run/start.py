"""A run's hold on its dump folder, decided once at start before the model is built.

``start_run`` (all ranks, right after the process group exists): rank 0 takes the dump folder's
run lock, checks that the checkpoint folder is writable, takes its run lock too (a run that
saves checkpoints; none when it is the dump folder itself) and plans the resume (verification,
steps moved aside); every rank gets the same ``RunContext`` or raises the same ``RunError``.

``metrics.jsonl`` keeps one history: each run starts with a header line
``{"run_header": {"run_id", "start_time", "resumed_from_step", ...}}``, and rows of earlier runs
past the step this run resumes from move to ``metrics.superseded.jsonl``, so no step row repeats.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from torchtitan_cp.run.control import broadcast, control_group, on_rank0
from torchtitan_cp.run.lock import RunLock, new_run_id
from torchtitan_cp.run.resume import ResumePlan, check_writable, plan_resume

HEADER_KEY = "run_header"
SUPERSEDED_SUFFIX = ".superseded.jsonl"


@dataclass
class RunContext:
    run_id: str
    start_time: str
    lock: RunLock | None  # rank 0 only
    plan: ResumePlan | None  # None without checkpointing
    lines: list[str]  # what start_run decided, for the log
    checkpoint_lock: RunLock | None = None  # rank 0, when the run saves checkpoints

    def close(self) -> None:
        for lock in (self.checkpoint_lock, self.lock):
            if lock is not None:
                lock.release()


def start_run(
    *,
    dump_folder: str,
    checkpoint: Any,
    training_steps: int,
    timeout: timedelta | None = None,
) -> RunContext:
    """Lock ``dump_folder`` and plan the resume from ``checkpoint`` (a checkpoint config with
    ``enable``, ``folder``, ``load_step``, ``load_only``, ``create_seed_checkpoint``,
    ``discard_later_steps``, ``verify``). Collective over all ranks; ``timeout`` (the run's
    ``comm.init_timeout_seconds``) bounds every wait on another rank."""
    pg = control_group(timeout)
    run_id, start_time = broadcast(
        (new_run_id(), time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())), pg
    )
    lock = RunLock(dump_folder)
    lines: list[str] = []

    def take() -> str | None:
        return lock.acquire(run_id, start_time)

    stale = on_rank0(take, pg)
    if stale:
        lines.append(stale)
    plan = None
    folder = os.path.join(dump_folder, checkpoint.folder)
    ckpt_lock = RunLock(folder, what="checkpoint folder", option="--checkpoint.folder")
    # A run that writes checkpoints also locks its checkpoint folder (unless it is the dump
    # folder itself): an absolute --checkpoint.folder may be another run's, whose dump folder
    # lock does not cover it.
    if (
        checkpoint.enable
        and not checkpoint.load_only
        and os.path.realpath(folder) != os.path.realpath(dump_folder)
    ):
        try:
            on_rank0(lambda: check_writable(folder), pg)
            found = on_rank0(lambda: ckpt_lock.acquire(run_id, start_time), pg)
        except BaseException:
            lock.release()  # refused: a clean release, not a stale lock for the next run
            raise
        if found:
            lines.append(found)
    elif checkpoint.enable and not checkpoint.load_only:
        on_rank0(lambda: check_writable(folder), pg)
    if checkpoint.enable and not checkpoint.create_seed_checkpoint:
        plan = plan_resume(
            folder,
            run_id=run_id,
            load_step=checkpoint.load_step,
            training_steps=training_steps,
            discard_later_steps=getattr(checkpoint, "discard_later_steps", False),
            sha256=getattr(checkpoint, "verify", "sha256") == "sha256",
            move=not checkpoint.load_only,
            pg=pg,
        )
        lines.extend(plan.lines)
    return RunContext(
        run_id,
        start_time,
        lock if lock.held else None,
        plan,
        lines,
        ckpt_lock if ckpt_lock.held else None,
    )


def run_header(ctx: RunContext, *, resumed_from: int, world_size: int) -> dict[str, Any]:
    return {
        HEADER_KEY: {
            "run_id": ctx.run_id,
            "start_time": ctx.start_time,
            "resumed_from_step": resumed_from,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "world_size": world_size,
        }
    }


def _json_object(line: bytes | str) -> dict[str, Any] | None:
    """``line`` parsed, when it is a JSON object (a row or a run header); None otherwise (not
    JSON, or JSON of another kind: ``42``, a list, a string, ``null``)."""
    try:
        value = json.loads(line)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def repair_jsonl(path: str, run_id: str) -> str | None:
    """Before a run appends to ``path``: lines that are not JSON objects (a row cut by a killed
    process or a full disk, usually the last one; anything else a reader of rows cannot use)
    move to ``<path>.broken-<run_id>``, and the file is rewritten without them (atomically), so
    the next row starts on a line of its own. Returns a log line naming the kept-aside file, or
    None when nothing was broken."""
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        data = f.read()
    good: list[bytes] = []
    bad: list[tuple[int, bytes]] = []
    for number, line in enumerate(data.splitlines(), start=1):
        if _json_object(line) is not None:
            good.append(line)
        elif line.strip():
            bad.append((number, line))
    if not bad and (not data or data.endswith(b"\n")):
        return None
    aside = f"{path}.broken-{run_id}"
    if bad:
        with open(aside, "ab") as f:
            f.write(b"".join(line + b"\n" for _, line in bad))
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(b"".join(line + b"\n" for line in good))
    os.replace(tmp, path)
    if not bad:
        return f"{path}: its last line had no line end; added one"
    lines = ", ".join(str(n) for n, _ in bad[:5]) + (" ..." if len(bad) > 5 else "")
    return (
        f"{path}: moved {len(bad)} line(s) that are not JSON objects (line {lines}; a row cut "
        f"short by an earlier run, or another writer's text) to {aside}"
    )


def supersede_rows(path: str, resumed_from: int) -> int:
    """Move rows with ``step > resumed_from`` from ``path`` to ``<path stem>.superseded.jsonl``
    (each group after the header of the run that wrote it); returns how many moved. The rewrite
    is atomic (temp file, then rename)."""
    if not os.path.isfile(path):
        return 0
    keep: list[str] = []
    moved: list[str] = []
    header: str | None = None
    header_moved = False
    with open(path) as f:
        lines = f.read().splitlines()
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            keep.append(line)  # not ours to judge: leave it where it is
            continue
        if isinstance(row, dict) and HEADER_KEY in row:
            keep.append(line)
            header, header_moved = line, False
            continue
        step = row.get("step") if isinstance(row, dict) else None
        if isinstance(step, int) and step > resumed_from:
            if header is not None and not header_moved:
                moved.append(header)
                header_moved = True
            moved.append(line)
        else:
            keep.append(line)
    if not moved:
        return 0
    stem = path[: -len(".jsonl")] if path.endswith(".jsonl") else path
    with open(stem + SUPERSEDED_SUFFIX, "a") as f:
        f.write("\n".join(moved) + "\n")
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write("".join(line + "\n" for line in keep))
    os.replace(tmp, path)
    return sum(1 for line in moved if HEADER_KEY not in line)


def read_rows(path: str) -> list[dict[str, Any]]:
    """The step rows of a metrics.jsonl (training and validation), header lines left out, and
    lines that are not JSON objects (a row a killed run cut short, not yet repaired by the next
    run's ``repair_jsonl``) skipped: it never raises on a file the recipe wrote or repaired."""
    with open(path, "rb") as f:
        rows = [_json_object(line) for line in f if line.strip()]
    return [r for r in rows if r is not None and HEADER_KEY not in r]
