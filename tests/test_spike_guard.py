"""The loss-spike guard's decision rule (the end-to-end stop and skip runs are in test_runs.py)."""

from __future__ import annotations

import math

import pytest

from torchtitan_cp.run.errors import LossSpikeError
from torchtitan_cp.run.spike_guard import SpikeGuard, SpikeGuardConfig


def test_guard_waits_for_history_then_skips_spikes_against_the_median():
    guard = SpikeGuard(SpikeGuardConfig(factor=2.0, window=4, min_history=3, action="skip"))
    assert guard.check(1, 100.0) is None  # a high first loss is history, not a spike
    assert guard.check(2, 4.0) is None
    assert guard.check(3, 4.0) is None
    assert guard.check(4, 8.0) is None  # median of [100, 4, 4] is 4: 8.0 is not above 2 x 4
    # median of [100, 4, 4, 8] is 6: 12.5 is above 2 x 6
    line = guard.check(5, 12.5)
    assert line is not None and "step 5" in line and "update skipped" in line
    assert guard.skipped == 1
    assert list(guard.history) == [100.0, 4.0, 4.0, 8.0], "a skipped loss stays out of the history"
    assert guard.check(6, 4.1) is None
    assert list(guard.history) == [4.0, 4.0, 8.0, 4.1], "the window keeps the last 4"


def test_stop_raises_one_line_with_the_fix():
    guard = SpikeGuard(SpikeGuardConfig(factor=3.0, window=10, min_history=2))
    guard.check(1, 2.0)
    guard.check(2, 2.0)
    with pytest.raises(LossSpikeError) as e:
        guard.check(3, 6.5)
    msg = str(e.value)
    assert "loss spike at step 3" in msg and "spike_guard.action = 'stop'" in msg
    assert "\n" not in msg and e.value.exit_code == 1


def test_non_finite_losses_are_left_to_the_nan_guard():
    guard = SpikeGuard(SpikeGuardConfig(factor=2.0, window=4, min_history=1, action="skip"))
    guard.check(1, 3.0)
    assert guard.check(2, math.nan) is None and guard.check(3, math.inf) is None
    assert list(guard.history) == [3.0]


@pytest.mark.parametrize(
    "kwargs, key",
    [({"factor": 0.5}, "factor"), ({"factor": 1.0}, "factor"), ({"factor": -2.0}, "factor"),
     ({"factor": 2.0, "window": 0}, "window"), ({"factor": 2.0, "window": 5, "min_history": 6},
     "min_history")],
)  # fmt: skip
def test_bad_settings_name_the_key(kwargs, key):
    with pytest.raises(ValueError, match=f"spike_guard.{key}"):
        SpikeGuardConfig(**kwargs)


def test_off_by_default():
    assert not SpikeGuardConfig().enabled
