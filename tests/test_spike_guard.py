"""The loss-spike guard's decision rule (the end-to-end stop and skip runs are in test_runs.py)."""

from __future__ import annotations

import math

import pytest

from torchtitan_cp.run.errors import LossSpikeError, NonFiniteLossError
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
    # the skipped loss is history too: a lasting new level is not compared against forever
    assert list(guard.history) == [4.0, 4.0, 8.0, 12.5], "the window keeps the last 4"
    assert guard.check(6, 4.1) is None and guard.in_a_row == []


def test_one_spike_is_skipped_and_training_goes_on():
    guard = SpikeGuard(SpikeGuardConfig(factor=1.5, window=50, min_history=3, action="skip"))
    losses = [8.0, 7.5, 7.0, 6.8, 30.0, 6.7, 6.6, 6.5, 6.4]
    verdicts = [guard.check(step, loss) for step, loss in enumerate(losses, start=1)]
    assert [v is not None for v in verdicts] == [False] * 4 + [True] + [False] * 4
    assert guard.skipped == 1


def test_persistent_spikes_stop_after_max_skips():
    """A loss that stays high means an update already applied changed the model: skipping it
    cannot recover, so after max_skips skips in a row the run stops (before: every later update
    was skipped to the end of the run, with exit 0)."""
    guard = SpikeGuard(
        SpikeGuardConfig(factor=1.5, window=50, min_history=3, action="skip", max_skips=3)
    )
    for step, loss in enumerate([8.0, 7.5, 7.0], start=1):
        assert guard.check(step, loss) is None
    for step in (4, 5, 6):
        assert guard.check(step, 40.0) is not None
    with pytest.raises(LossSpikeError) as e:
        guard.check(7, 40.0)
    msg = str(e.value)
    assert "4 spikes in a row (updates of steps 4-6 skipped, spike_guard.max_skips = 3)" in msg
    assert "an update before step 4 changed the model" in msg and e.value.exit_code == 1
    assert "Resume from the last checkpoint" in msg
    assert "\n" not in msg
    # a normal loss between spikes starts the count again
    guard = SpikeGuard(SpikeGuardConfig(factor=1.5, min_history=1, action="skip", max_skips=1))
    guard.check(1, 8.0)
    assert guard.check(2, 40.0) is not None and guard.check(3, 8.0) is None
    assert guard.check(4, 40.0) is not None, "not two in a row"


def test_stop_raises_one_line_with_the_fix():
    guard = SpikeGuard(SpikeGuardConfig(factor=3.0, window=10, min_history=2))
    guard.check(1, 2.0)
    guard.check(2, 2.0)
    with pytest.raises(LossSpikeError) as e:
        guard.check(3, 6.5)
    msg = str(e.value)
    assert "loss spike at step 3" in msg and "spike_guard.action = 'stop'" in msg
    assert "\n" not in msg and e.value.exit_code == 1


def test_a_non_finite_loss_is_a_spike_before_its_update_whatever_the_history():
    """Before, the guard left inf and nan to the log step's check, which ran after the update
    (the model then held nan) and ended the run with a traceback. Now ``skip`` drops such an
    update (it never enters the history), ``stop`` ends the run before it in one line that
    names the step and where to resume."""
    guard = SpikeGuard(SpikeGuardConfig(factor=2.0, window=4, min_history=3, action="skip"))
    guard.check(1, 3.0)
    for step, loss in ((2, math.nan), (3, math.inf)):
        line = guard.check(step, loss)
        assert line == f"loss is not finite ({loss}) at step {step}; update skipped " + (
            "(spike_guard.action = 'skip')"
        )
    assert list(guard.history) == [3.0] and guard.skipped == 2
    stop = SpikeGuard(SpikeGuardConfig(factor=2.0, min_history=10))
    with pytest.raises(NonFiniteLossError) as e:
        stop.check(1, math.nan, resume="rerun to resume from step 4")
    assert str(e.value) == (
        "loss is not finite (nan) at step 1; stopped before the update (spike_guard.action = "
        "'stop'): rerun to resume from step 4 with a lower lr "
        "(optimizer.param_groups.0.optimizer_kwargs.lr), or set spike_guard.action = 'skip' to "
        "drop such updates"
    )
    assert e.value.exit_code == 1


@pytest.mark.parametrize(
    "kwargs, key",
    [
        ({"factor": 0.5}, "factor"),
        ({"factor": 1.0}, "factor"),
        ({"factor": -2.0}, "factor"),
        ({"factor": 2.0, "window": 0}, "window"),
        ({"factor": 2.0, "window": 5, "min_history": 6}, "min_history"),
        ({"factor": math.inf}, "factor"),
        ({"factor": math.nan}, "factor"),
        ({"factor": 2.0, "max_skips": 0}, "max_skips"),
    ],
)
def test_bad_settings_name_the_key(kwargs, key):
    with pytest.raises(ValueError, match=f"spike_guard.{key}"):
        SpikeGuardConfig(**kwargs)


def test_off_by_default():
    assert not SpikeGuardConfig().enabled
