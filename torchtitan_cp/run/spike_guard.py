"""Loss-spike guard: next to torchtitan's NaN guard, before the optimizer applies an update.

When a step's global loss exceeds ``factor`` times the median of the last ``window`` accepted
losses (once ``min_history`` are known), the run stops (``action = "stop"``, before the update,
so no checkpoint holds it) or the update is skipped (``action = "skip"``: gradients are dropped,
the optimizer leaves parameters and moments alone, the LR schedule advances). The loss is the
global average every rank already agrees on, so all ranks decide alike. Off by default
(``factor = 0``): enabling it costs one device->host read of the loss per step.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Literal

from torchtitan_cp.run.errors import LossSpikeError


@dataclass(kw_only=True, slots=True)
class SpikeGuardConfig:
    """``[spike_guard]``: stop or skip a step whose loss jumps far above its recent median."""

    factor: float = 0.0
    """Trigger when loss > factor x median of recent losses; 0 turns the guard off (> 1 else)."""
    window: int = 50
    """How many recent accepted losses the median is taken over."""
    min_history: int = 10
    """Losses needed before the guard acts (the first steps of a run fall fast)."""
    action: Literal["stop", "skip"] = "stop"
    """stop: end the run before the update (exit 1); skip: drop this step's update and go on."""

    def __post_init__(self) -> None:
        if self.factor != 0 and not self.factor > 1:
            raise ValueError(f"spike_guard.factor must be 0 (off) or > 1, got {self.factor}")
        if self.window < 1:
            raise ValueError(f"spike_guard.window must be >= 1, got {self.window}")
        if not 1 <= self.min_history <= self.window:
            raise ValueError(
                f"spike_guard.min_history must be in [1, window = {self.window}], "
                f"got {self.min_history}"
            )

    @property
    def enabled(self) -> bool:
        return self.factor > 0


class SpikeGuard:
    """The guard's state: recent accepted losses (not checkpointed: after a resume the guard
    waits for ``min_history`` new losses again) and how many updates it skipped."""

    def __init__(self, config: SpikeGuardConfig) -> None:
        self.config = config
        self.history: deque[float] = deque(maxlen=config.window)
        self.skipped = 0

    def check(self, step: int, loss: float) -> str | None:
        """None to apply the update; the log line when it is skipped; raises
        ``LossSpikeError`` to stop. Non-finite losses are left to torchtitan's NaN guard."""
        cfg = self.config
        if not math.isfinite(loss):
            return None
        if len(self.history) >= cfg.min_history:
            median = statistics.median(self.history)
            if loss > cfg.factor * median:
                what = (
                    f"loss spike at step {step}: loss {loss:.6g} > {cfg.factor:g} x median "
                    f"{median:.6g} of the last {len(self.history)} steps"
                )
                if cfg.action == "stop":
                    raise LossSpikeError(
                        f"{what}; stopped before the update (spike_guard.action = 'stop'). "
                        "Resume from the last checkpoint, e.g. with a lower LR, or set "
                        "spike_guard.action = 'skip'"
                    )
                self.skipped += 1
                return f"{what}; update skipped (spike_guard.action = 'skip')"
        self.history.append(loss)
        return None
