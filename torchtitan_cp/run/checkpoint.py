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

A manifest of any wrong shape makes its step incomplete, like a missing one; a step must also
load (``dcp_layout_problem``: every byte range DCP's ``.metadata`` lists lies inside its file). At
load the manager compares the checkpoint with the model and the run's data-parallel degree
(``fit_problem``) and turns a full disk during a save into one line (``disk_full_error``).

CLI: ``python -m torchtitan_cp.checkpoint verify|seal STEP_DIR`` checks a step folder (or every
step of a checkpoint folder), or writes a manifest for one you trust (a checkpoint written by
plain torchtitan) once it checked that the folder loads.
"""

from __future__ import annotations

import argparse
import errno
import hashlib
import json
import logging
import os
import pickle
import re
import shutil
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torchtitan.components.checkpoint import TRAIN_STATE, CheckpointManager
from torchtitan.tools.logging import logger

from torchtitan_cp.run.errors import CheckpointError, RunError
from torchtitan_cp.run.lock import new_run_id
from torchtitan_cp.run.retired import retired_problem

MANIFEST = "manifest.sha256.json"
MANIFEST_FORMAT = "torchtitan_cp.checkpoint-manifest/1"
_STEP_RE = re.compile(r"step-(\d+)")
_CHUNK = 8 << 20


# ----------------------------------------------------------------------------- collectives

_CONTROL_GROUP: tuple[Any, Any] | None = None  # (the default group it belongs to, the group)
CONTROL_TIMEOUT = timedelta(seconds=300)
"""The control group's timeout when the caller names none (torchtitan's default
``comm.init_timeout_seconds``); the trainer passes its ``comm.init_timeout_seconds``."""


def control_group(timeout: timedelta | None = None) -> Any:
    """A gloo group for checkpoint control: resume planning, verification and manifests (rank 0
    decides, the ranks hash shares). Its timeout is ``timeout`` (the run's
    ``comm.init_timeout_seconds``), so a stopped rank ends a resume within it instead of hanging
    the others. Every rank must make the first call at the same point; later calls return it.
    None without torch.distributed. A new default group (a second trainer in the same process,
    after ``destroy_process_group``) gets a new one."""
    global _CONTROL_GROUP
    if not dist.is_initialized():
        return None
    world = dist.group.WORLD
    if _CONTROL_GROUP is None or _CONTROL_GROUP[0] is not world:
        group = dist.new_group(backend="gloo", timeout=timeout or CONTROL_TIMEOUT)
        _CONTROL_GROUP = (world, group)
    return _CONTROL_GROUP[1]


def set_control_timeout(timeout: timedelta) -> None:
    """Set the control group's timeout (a no-op without one). The checkpointer sets
    ``comm.train_timeout_seconds`` once training runs, so a rank stopped during a save (clearing
    the step, the manifest) ends the others within the bound of a training step and the line
    names that key; it kept ``comm.init_timeout_seconds`` (300 s) before. Every rank calls it at
    the same point, after the collectives that the longer timeout was for."""
    pg = control_group()
    if pg is not None:
        dist.set_timeout(timeout, pg)


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
        try:
            with open(tmp, "w") as f:
                json.dump(manifest, f, indent=1, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, os.path.join(step_dir, MANIFEST))
        except OSError as e:
            raise CheckpointError(
                f"checkpoint {step_dir}: cannot write its {MANIFEST} ({e.strerror or e}); "
                "the step stays incomplete and is moved aside at the next start"
            ) from None
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


_SHA256_RE = re.compile(r"[0-9a-f]{64}")


def manifest_problem(manifest: Any) -> str | None:
    """What is wrong with the shape of a parsed manifest (``"it ..."``), or None."""
    if not isinstance(manifest, dict):
        return f"is a JSON {type(manifest).__name__}, not an object"
    if manifest.get("format") != MANIFEST_FORMAT:
        return f"has format {manifest.get('format')!r}, not {MANIFEST_FORMAT!r}"
    files = manifest.get("files")
    if not isinstance(files, dict):
        return 'has no "files" table' if files is None else '"files" is not a table'
    if not files:
        return "lists no files"
    for rel, entry in files.items():
        if not rel or os.path.isabs(rel) or ".." in rel.split("/"):
            return f"names {rel!r}, which is not a file inside the step folder"
        if not isinstance(entry, dict):
            return f"entry {rel!r} is not a table"
        size, digest = entry.get("bytes"), entry.get("sha256")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            return f'entry {rel!r} has no valid "bytes" ({size!r})'
        if not isinstance(digest, str) or not _SHA256_RE.fullmatch(digest):
            return f'entry {rel!r} has no valid "sha256"'
    return None


def read_manifest(step_dir: str) -> tuple[dict[str, Any] | None, str]:
    """(manifest, "") or (None, why it is missing or invalid). A manifest of any wrong shape
    makes the step incomplete, like a missing one."""
    path = os.path.join(step_dir, MANIFEST)
    if not os.path.isfile(path):
        return None, f"incomplete: no {MANIFEST} (a save that did not finish)"
    try:
        with open(path) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        return None, f"incomplete: {path} is unreadable ({e})"
    problem = manifest_problem(manifest)
    if problem is not None:
        return None, f"incomplete: {path} {problem}"
    return manifest, ""


def safetensors_problem(path: str | os.PathLike[str]) -> str | None:
    """None when ``path`` is as long as its safetensors header says, else what is wrong
    (naming the file): cut inside the header, an unreadable header, or tensors past its end.
    Reads the header only."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"{path} is truncated: {size} bytes, shorter than a safetensors header"
        n = int.from_bytes(head, "little")
        if 8 + n > size:
            return f"{path} is truncated: {size} bytes, its header alone needs {8 + n}"
        try:
            header = json.loads(f.read(n))
            end = max(
                (int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"),
                default=0,
            )
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):
            return f"{path} has an unreadable safetensors header: not a safetensors file"
    if 8 + n + end > size:
        return f"{path} is truncated: {size} bytes, its header describes {8 + n + end}"
    return None


def dcp_layout_problem(step_dir: str) -> str | None:
    """None when ``step_dir`` holds a loadable checkpoint layout, else the first problem,
    naming the file: DCP (``.metadata`` unpickles and every byte range it lists lies inside an
    existing file; this reads ``.metadata`` only) or, without ``.metadata``, Hugging Face
    safetensors (each file's header and length)."""
    from torch.distributed.checkpoint import FileSystemReader

    meta = os.path.join(step_dir, ".metadata")
    if not os.path.isfile(meta):
        shards = sorted(n for n in os.listdir(step_dir) if n.endswith(".safetensors"))
        if not shards:
            what = "is empty" if not os.listdir(step_dir) else "holds no .metadata (DCP)"
            return f"{step_dir} {what}: not a checkpoint step (no .metadata, no *.safetensors)"
        for name in shards:
            problem = safetensors_problem(os.path.join(step_dir, name))
            if problem:
                return problem
        return None
    try:
        metadata = FileSystemReader(step_dir).read_metadata()
    except Exception as e:  # a truncated pickle raises any of several types
        return f"{meta} cannot be read ({type(e).__name__}: {e}): truncated or not DCP metadata"
    ends: dict[str, int] = {}
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        rel = getattr(info, "relative_path", None)
        if isinstance(rel, str):
            ends[rel] = max(ends.get(rel, 0), int(info.offset) + int(info.length))
    for rel, end in sorted(ends.items()):
        path = os.path.join(step_dir, rel)
        if not os.path.isfile(path):
            return f"{path} is missing ({meta} refers to it)"
        size = os.path.getsize(path)
        if size < end:
            return f"{path} is truncated: {size} bytes, {meta} refers to bytes up to {end}"
    return None


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
    # A step sealed after it was cut short matches its manifest but cannot load.
    return broadcast(dcp_layout_problem(step_dir) if _rank(pg) == 0 else None, pg)


# ----------------------------------------------------------------------------- resume plan


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
        m = _STEP_RE.fullmatch(name)
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


# ----------------------------------------------------------------------------- fit and space

# Top-level state names torchtitan checkpoints beside the (flattened) model parameters.
_NON_MODEL_STATES = ("optimizer", "lr_scheduler", "dataloader", "train_state")
_DP_RANK_RE = re.compile(r"dataloader\.dp_rank_(\d+)")


def fit_problem(
    state_dict: dict[str, Any], checkpoint_id: str, *, dp_world_size: int | None = None
) -> str | None:
    """None when the DCP checkpoint at ``checkpoint_id`` can load into ``state_dict`` (the
    flattened states torchtitan loads: model parameters at the top level), else what does not
    fit, naming the first parameter: one a layer no longer has (``run.retired``), one the
    checkpoint lacks, one of another shape, one only the checkpoint has, or a data loader saved
    by another number of data-parallel ranks (torchtitan cannot reshard its position). Reads ``.metadata`` only."""
    from torch.distributed.checkpoint import FileSystemReader

    saved = FileSystemReader(checkpoint_id).read_metadata().state_dict_metadata
    # First a parameter a layer no longer has (its replacements are missing too): the change
    # that retired it says more than the replacement's absence.
    retired = retired_problem(k for k in saved if k not in state_dict)
    if retired is not None:
        return retired
    for key, value in state_dict.items():
        if not isinstance(value, torch.Tensor):
            continue
        meta = saved.get(key)
        if meta is None:
            return f"this model's parameter {key} is not in the checkpoint"
        size = getattr(meta, "size", None)
        if size is not None and tuple(size) != tuple(value.shape):
            return (
                f"parameter {key} is {list(size)} in the checkpoint but {list(value.shape)} in "
                "this model"
            )
    states = {k for k, v in state_dict.items() if not isinstance(v, torch.Tensor)}
    prefixes = tuple(f"{k}." for k in {*_NON_MODEL_STATES, *states})
    extra = [k for k in saved if k not in state_dict and not k.startswith(prefixes)]
    if extra:
        return f"the checkpoint's parameter {extra[0]} is not in this model"
    if dp_world_size is not None and "dataloader" in state_dict:
        saved_dp = sum(1 for k in saved if _DP_RANK_RE.fullmatch(k))
        if saved_dp and saved_dp != dp_world_size:
            return (
                f"it was saved by {saved_dp} data-parallel rank(s) and this run has "
                f"{dp_world_size}, and torchtitan cannot split a data loader's position over "
                "another number of ranks"
            )
    return None


def fit_error(checkpoint_id: str, problem: str) -> CheckpointError:
    """The one-line error for a checkpoint that does not fit the run, with the fix."""
    if "data-parallel" in problem:
        fix = (
            "resume with the process count and parallelism degrees of the run that saved it "
            "(NPROC, parallelism.context_parallel_degree, data_parallel_*), or start a new "
            f"--dump_folder from its weights: --checkpoint.initial_load_path {checkpoint_id} "
            "--checkpoint.initial_load_model_only"
        )
    elif "no longer reads it" in problem:
        fix = "convert it (that parameter split as said) or start a new --dump_folder"
    else:
        fix = (
            "it was saved with other [model] settings (layer_pattern, flavor, n_layers or a "
            "size): use those, or start a new --dump_folder"
        )
    return CheckpointError(f"checkpoint {checkpoint_id} does not fit this run: {problem}; {fix}")


class _DropMessage(logging.Filter):
    """Drops the log records whose message starts with ``prefix``."""

    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefix)


def _os_error(exc: BaseException) -> OSError | None:
    """The OSError behind ``exc``: itself, its cause or context, or a rank's failure inside a
    DCP ``CheckpointException``."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError):
            return e
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            todo.extend(f[0] if isinstance(f, tuple) else f for f in failures.values())
        todo.extend([e.__cause__, e.__context__])
    return None


# What DCP writes per item beside its payload (torch 2.14, measured on the debug model's steps):
# torch.save's zip container (~1.56 KiB for a tensor, ~1.23 KiB for another object) and the
# item's entry in .metadata (~0.27 KiB). A step of many small items (AdamW's per-parameter step
# counters and param groups) is ~20 % larger than its tensors' bytes.
_TENSOR_ITEM_BYTES = 1850
_OBJECT_ITEM_BYTES = 1530


def _state_bytes(state: Any) -> int:
    """About the bytes this rank's share of a (nested) state dict takes in a DCP step: each
    item DCP writes (a tensor, or another leaf, pickled) with its per-item cost. Lists are
    walked as DCP walks them (only when they hold tensors or mappings; else one item)."""
    if isinstance(state, torch.Tensor):
        local = state.to_local() if hasattr(state, "to_local") else state
        return local.numel() * local.element_size() + _TENSOR_ITEM_BYTES
    if isinstance(state, dict):
        return sum(_state_bytes(v) for v in state.values())
    if isinstance(state, list) and any(isinstance(v, torch.Tensor | dict | list) for v in state):
        return sum(_state_bytes(v) for v in state)
    if hasattr(state, "state_dict") and callable(state.state_dict):
        return _state_bytes(state.state_dict())
    try:
        payload = len(pickle.dumps(state))
    except Exception:  # not picklable here: DCP would fail on it anyway
        payload = 0
    return payload + _OBJECT_ITEM_BYTES


def _existing(path: str) -> str:
    while path and not os.path.exists(path):
        path = os.path.dirname(path)
    return path or "."


def _free_bytes(path: str) -> int:
    try:
        return shutil.disk_usage(_existing(path)).free
    except OSError:
        return 1 << 62


def disk_full_error(checkpoint_id: str, need_bytes: int) -> CheckpointError:
    """No space left while saving: the folder, the bytes free and about the bytes needed."""
    probe = _existing(os.path.dirname(checkpoint_id))
    free = _free_bytes(probe)
    return CheckpointError(
        f"saving checkpoint {checkpoint_id} failed: no space left on device "
        f"({probe}: {free / 2**20:.1f} MiB free; this save needs about "
        f"{need_bytes / 2**20:.1f} MiB). Free space, lower --checkpoint.keep_latest_k or put "
        "--checkpoint.folder on a larger disk; the unfinished step is moved aside at the next start"
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
            # torchtitan warns "initial_load_model_only=True has no effect without an
            # initial_load_path" whenever this Config holds its own defaults (model_only True,
            # no path): the recipe's defaults and each TOML section re-check are built before
            # the command line sets the path, so it warned while the path was set and loaded.
            quiet = _DropMessage("initial_load_model_only=True has no effect without")
            logger.addFilter(quiet)
            try:
                CheckpointManager.Config.__post_init__(self)
            finally:
                logger.removeFilter(quiet)
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
        # The newest step of this run's checkpoint folder: the one it resumed from, then each
        # save (for "where to resume" in a stopped run's line).
        self.newest_step: int | None = None
        self.on_loaded: Any = None
        # comm.train_timeout_seconds (set by the trainer): the control group's timeout once
        # training runs, as torchtitan sets it for the other groups after the first step.
        self.train_timeout: timedelta | None = None
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
        if self.plan.step >= 0:
            self.newest_step = self.plan.step
        return loaded

    def dcp_load(
        self, state_dict: dict[str, Any], checkpoint_id: str, from_hf: bool, from_quantized: bool
    ) -> None:
        if not from_hf:
            dataloader = self.states.get("dataloader")
            problem = fit_problem(
                state_dict, checkpoint_id, dp_world_size=getattr(dataloader, "dp_world_size", None)
            )
            if problem is not None:
                raise fit_error(checkpoint_id, problem)
        super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)

    def dcp_save(self, state_dict: dict[str, Any], checkpoint_id: str, *args: Any, **kwargs: Any):
        try:
            return super().dcp_save(state_dict, checkpoint_id, *args, **kwargs)
        except BaseException as e:  # DCP's CheckpointException is a BaseException
            # DCP reports every rank's failure on every rank: all of them decide here alike.
            # A full disk shows as ENOSPC, or (torch.save's zip writer swallows the OSError) as
            # "unexpected pos" with less space left than the save needs.
            world = dist.get_world_size() if dist.is_initialized() else 1
            need = _state_bytes(state_dict) * world
            err = _os_error(e)
            if err is not None and err.errno in (errno.ENOSPC, errno.EDQUOT):
                raise disk_full_error(checkpoint_id, need) from None
            if isinstance(e, Exception | CheckpointException) and _free_bytes(checkpoint_id) < need:
                raise disk_full_error(checkpoint_id, need) from None
            raise

    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        if not self._should_save(curr_step, last_step):
            return False
        step_dir = self._create_checkpoint_id(curr_step)
        run_id = self._run_id()
        pg = self._pg()
        if self.train_timeout is not None and curr_step > self.resumed_from + 1:
            # torchtitan lowers the other groups' timeouts to comm.train_timeout_seconds after
            # the first step of this process (after its save): the control group follows.
            set_control_timeout(self.train_timeout)

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
            self.newest_step = curr_step
            begin = time.monotonic()
            manifest = write_manifest(step_dir, step=curr_step, run_id=run_id, pg=pg)
            size = sum(f["bytes"] for f in manifest["files"].values())
            logger.info(
                f"Wrote {MANIFEST} for step-{curr_step} ({len(manifest['files'])} files, "
                f"{size / 2**20:.1f} MiB) in {time.monotonic() - begin:.2f} seconds."
            )
        return saved


# ----------------------------------------------------------------------------- CLI


def _err(message: str) -> None:
    print(f"checkpoint: error: {message}", file=sys.stderr)


def _verify(step_dir: str) -> int:
    begin = time.monotonic()
    problem = check_step(step_dir)
    if problem:
        _err(f"{step_dir}: {problem}")
        return 1
    manifest, _ = read_manifest(step_dir)
    n = len(manifest["files"]) if manifest else 0
    print(
        f"{step_dir}: ok ({n} files match the manifest and load; {time.monotonic() - begin:.2f} s)"
    )
    return 0


def _seal(step_dir: str) -> int:
    if os.path.exists(os.path.join(step_dir, MANIFEST)):
        _err(f"{step_dir} already has a {MANIFEST}")
        return 2
    problem = dcp_layout_problem(step_dir)
    if problem:
        _err(f"will not seal {step_dir}: {problem}")
        return 2
    m = _STEP_RE.fullmatch(os.path.basename(step_dir))
    manifest = write_manifest(step_dir, step=int(m.group(1)) if m else -1, run_id="sealed")
    files = manifest["files"]
    checked = (
        ".metadata loads and every byte range it lists lies inside its file"
        if os.path.isfile(os.path.join(step_dir, ".metadata"))
        else "every *.safetensors header matches its file's length"
    )
    size = sum(f["bytes"] for f in files.values()) / 2**20
    print(f"{step_dir}: wrote {MANIFEST} ({len(files)} files, {size:.1f} MiB); checked: {checked}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m torchtitan_cp.checkpoint",
        description="Check a checkpoint step folder (or every step of a checkpoint folder) "
        "against its manifest, or write a manifest for a step folder you trust (e.g. saved by "
        "plain torchtitan) once it checks that the folder loads.",
    )
    p.add_argument("command", choices=["verify", "seal"])
    p.add_argument("step_dir")
    args = p.parse_args(argv)
    step_dir = args.step_dir.rstrip("/") or "/"
    if not os.path.isdir(step_dir):
        _err(f"{step_dir} is not a folder")
        return 2
    steps = scan_steps(step_dir)
    if steps and not os.path.exists(os.path.join(step_dir, MANIFEST)):
        # The checkpoint folder itself: verify each step; seal one step at a time.
        names = ", ".join(os.path.basename(s.path) for s in steps)
        if args.command == "seal":
            _err(f"{step_dir} is a checkpoint folder ({names}); seal one step: {steps[-1].path}")
            return 2
        print(f"{step_dir}: a checkpoint folder with {len(steps)} step(s): {names}")
        return max(_verify(s.path) for s in steps)
    if not os.listdir(step_dir):
        _err(f"{step_dir} is empty: not a checkpoint step")
        return 2
    return _verify(step_dir) if args.command == "verify" else _seal(step_dir)


if __name__ == "__main__":
    sys.exit(main())
