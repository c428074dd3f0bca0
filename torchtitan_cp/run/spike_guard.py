"""Loss-spike guard: next to torchtitan's NaN guard, before the optimizer applies an update.

When a step's global loss exceeds ``factor`` times the median of the last ``window`` losses (once
``min_history`` are known), the run stops (``action = "stop"``, before the update, so no
checkpoint holds it) or the update is skipped (``action = "skip"``: gradients are dropped, the
optimizer leaves parameters and moments alone, the LR schedule advances).

What ``skip`` recovers from, and what it does not: skipping drops the update of a batch whose
loss jumped (a bad batch), and training goes on. It cannot undo an update already applied: when
the loss stays high, the model itself changed (or the data is bad from there on), and skipping
every later update would freeze the run. So at most ``max_skips`` consecutive updates are
skipped; the next spike in a row stops the run (exit 1) naming the steps, to resume from the last
checkpoint (e.g. with a lower LR).
Every finite loss enters the history, skipped ones too, so a lasting change of level becomes
the new median after ``window / 2`` steps instead of being compared against forever. A loss
that is not finite (inf, nan) is a spike whatever the history, acted on before its update
(``stop``: one line naming the step and where to resume; ``skip``: its update dropped); with
the guard off the trainer's log step ends the run on it, after the update.

The loss is the global average every rank already agrees on, so all ranks decide alike. Off by
default (``factor = 0``): enabling it costs one device->host read of the loss per step.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Literal

from torchtitan_cp.run.errors import LossSpikeError, NonFiniteLossError


@dataclass(kw_only=True, slots=True)
class SpikeGuardConfig:
    """``[spike_guard]``: stop or skip a step whose loss jumps far above its recent median."""

    factor: float = 0.0
    """Trigger when loss > factor x median of recent losses; 0 turns the guard off (> 1 else)."""
    window: int = 50
    """How many recent losses (skipped ones included) the median is taken over."""
    min_history: int = 10
    """Losses needed before the guard acts (the first steps of a run fall fast)."""
    action: Literal["stop", "skip"] = "stop"
    """stop: end the run before the update (exit 1); skip: drop this step's update and go on."""
    max_skips: int = 3
    """skip: most updates skipped in a row; one more spike in a row stops the run (exit 1): the
    loss stayed high, so an update already applied changed the model, which skipping cannot undo."""

    def __post_init__(self) -> None:
        if self.factor != 0 and not (self.factor > 1 and math.isfinite(self.factor)):
            raise ValueError(
                f"spike_guard.factor must be 0 (off) or a finite number > 1, got {self.factor}"
            )
        if self.window < 1:
            raise ValueError(f"spike_guard.window must be >= 1, got {self.window}")
        if not 1 <= self.min_history <= self.window:
            raise ValueError(
                f"spike_guard.min_history must be in [1, window = {self.window}], "
                f"got {self.min_history}"
            )
        if self.max_skips < 1:
            raise ValueError(f"spike_guard.max_skips must be >= 1, got {self.max_skips}")

    @property
    def enabled(self) -> bool:
        return self.factor > 0


class SpikeGuard:
    """The guard's state: recent losses (not checkpointed: after a resume the guard waits for
    ``min_history`` new losses again), how many updates it skipped, and the current run of
    consecutive skips."""

    def __init__(self, config: SpikeGuardConfig) -> None:
        self.config = config
        self.history: deque[float] = deque(maxlen=config.window)
        self.skipped = 0
        self.in_a_row: list[int] = []  # steps of the current run of skipped updates

    def check(
        self, step: int, loss: float, *, resume: str = "resume from the last checkpoint"
    ) -> str | None:
        """None to apply the update; the log line when it is skipped; raises
        ``LossSpikeError`` to stop (``resume``: where the run can go on from, for the line). A
        loss that is not finite is always a spike, whatever the history, and never enters
        it: ``stop`` ends the run before its update poisons the model (``NonFiniteLossError``),
        ``skip`` drops that update as it drops a spike's."""
        cfg = self.config
        spike = None
        if not math.isfinite(loss):
            spike = f"loss is not finite ({loss}) at step {step}"
            if cfg.action == "stop":
                raise NonFiniteLossError(
                    f"{spike}; stopped before the update (spike_guard.action = 'stop'): "
                    f"{resume} with a lower lr (optimizer.param_groups.0.optimizer_kwargs.lr), "
                    "or set spike_guard.action = 'skip' to drop such updates"
                )
        elif len(self.history) >= cfg.min_history:
            median = statistics.median(self.history)
            if loss > cfg.factor * median:
                spike = (
                    f"loss spike at step {step}: loss {loss:.6g} > {cfg.factor:g} x median "
                    f"{median:.6g} of the last {len(self.history)} steps"
                )
        if math.isfinite(loss):
            self.history.append(loss)
        if spike is None:
            self.in_a_row = []
            return None
        if cfg.action == "stop":
            raise LossSpikeError(
                f"{spike}; stopped before the update (spike_guard.action = 'stop'). Resume "
                "from the last checkpoint, e.g. with a lower LR, or set spike_guard.action = "
                "'skip'"
            )
        if len(self.in_a_row) >= cfg.max_skips:
            first, last = self.in_a_row[0], self.in_a_row[-1]
            steps = f"step {first}" if first == last else f"steps {first}-{last}"
            raise LossSpikeError(
                f"{spike}, {len(self.in_a_row) + 1} spikes in a row (updates of {steps} "
                f"skipped, spike_guard.max_skips = {cfg.max_skips}): the loss stays high, which "
                f"skipping cannot fix (an update before step {first} changed the model, or the "
                "data is bad from there on); stopped before the update. Resume from the last "
                "checkpoint, e.g. with a lower LR, or check the data of these steps"
            )
        self.in_a_row.append(step)
        self.skipped += 1
        return f"{spike}; update skipped (spike_guard.action = 'skip')"


def resume_hint(folder: str | None, step: int | None) -> str:
    """Where a stopped run goes on from, for its one-line error: the newest checkpoint step of
    ``folder`` (``step``; a rerun of the same command resumes from it), or that there is none
    (``folder`` None: checkpointing off)."""
    if folder is None:
        return "no checkpoint to resume from (checkpoint.enable is off): start again"
    if step is None:
        return f"no checkpoint in {folder} yet: start again (a rerun starts from step 0)"
    return (
        f"rerun the same command to resume from step {step} (its newest checkpoint, "
        f"{folder}/step-{step})"
    )


def non_finite_error(step: int, loss: float, *, resume: str) -> NonFiniteLossError:
    """The log step's check: the step's loss is not finite after its update was applied (no
    spike guard, or one that let it through): the model may hold inf or nan now, and this step
    is never saved."""
    return NonFiniteLossError(
        f"loss is not finite ({loss}) at step {step}, after its update (its parameters may be "
        f"nan now; no checkpoint holds this step): {resume} with a lower lr "
        "(optimizer.param_groups.0.optimizer_kwargs.lr), or set spike_guard.factor (e.g. 10) "
        "with spike_guard.action = 'skip' to drop such updates before they apply"
    )
