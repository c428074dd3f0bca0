"""torchtitan's DCP ``CheckpointManager`` with integrity: every save sealed by a manifest
(``run.manifest``), the resume step chosen and verified before loading (``run.resume``), a
guard against overwriting another run's verified step, and one-line errors at load and save.

At load the manager compares the checkpoint with the model and the run's data-parallel degree
(``fit_problem``) and turns a full disk during a save into one line (``disk_full_error``).
Its CLI is ``python -m torchtitan_cp.checkpoint verify|seal STEP_DIR``.
"""

from __future__ import annotations

import errno
import logging
import os
import pickle
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torchtitan.components.checkpoint import TRAIN_STATE, CheckpointManager
from torchtitan.tools.logging import logger

from torchtitan_cp.run.control import (
    all_gather,
    broadcast,
    control_group,
    on_rank0,
    set_control_timeout,
)
from torchtitan_cp.run.errors import CheckpointError
from torchtitan_cp.run.lock import new_run_id
from torchtitan_cp.run.manifest import MANIFEST, read_manifest, write_manifest
from torchtitan_cp.run.paths import existing_parent
from torchtitan_cp.run.resume import ResumePlan, check_initial_load, move_aside, plan_resume
from torchtitan_cp.run.retired import retired_problem

# Top-level state names torchtitan checkpoints beside the (flattened) model parameters.
_NON_MODEL_STATES = ("optimizer", "lr_scheduler", "dataloader", "train_state")
_DP_RANK_RE = re.compile(r"dataloader\.dp_rank_(\d+)")


def fit_problem(
    state_dict: dict[str, Any],
    checkpoint_id: str,
    *,
    dp_world_size: int | None = None,
    model_keys: set[str] | None = None,
) -> str | None:
    """None when the DCP checkpoint at ``checkpoint_id`` can load into ``state_dict`` (the
    flattened states torchtitan loads: model parameters at the top level), else what does not
    fit, naming the first parameter: one a layer no longer has (``run.retired``), one the
    checkpoint lacks, one of another shape, one only the checkpoint has, or a data loader saved
    by another number of data-parallel ranks (torchtitan cannot reshard its position). Reads ``.metadata`` only.
    ``model_keys``: every key the whole model loads, where ``state_dict`` holds one pipeline
    stage's share (a checkpoint's key is only "not in this model" when no stage has it)."""
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
    known = state_dict.keys() if model_keys is None else model_keys
    extra = [k for k in saved if k not in known and not k.startswith(prefixes)]
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


def _free_bytes(path: str) -> int:
    try:
        return shutil.disk_usage(existing_parent(path)).free
    except OSError:
        return 1 << 62


def disk_full_error(checkpoint_id: str, need_bytes: int) -> CheckpointError:
    """No space left while saving: the folder, the bytes free and about the bytes needed."""
    probe = existing_parent(os.path.dirname(checkpoint_id))
    free = _free_bytes(probe)
    return CheckpointError(
        f"saving checkpoint {checkpoint_id} failed: no space left on device "
        f"({probe}: {free / 2**20:.1f} MiB free; this save needs about "
        f"{need_bytes / 2**20:.1f} MiB). Free space, lower --checkpoint.keep_latest_k or put "
        "--checkpoint.folder on a larger disk; the unfinished step is moved aside at the next start"
    )


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
        # Called with the step on every rank before a checkpoint is written (the trainer's
        # finite-loss check: a step whose update applied a nan or inf loss is never saved).
        self.before_save: Callable[[int], None] | None = None
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
            # Under pipeline parallelism each rank holds its stages' parameters: a saved key
            # fits when any rank's model has it (one gather of the key names at load).
            keys = set().union(*all_gather(list(state_dict), self._pg()))
            problem = fit_problem(
                state_dict,
                checkpoint_id,
                dp_world_size=getattr(dataloader, "dp_world_size", None),
                model_keys=keys,
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
        if self.before_save is not None:
            self.before_save(curr_step)
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
