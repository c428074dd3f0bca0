"""The errors that stop a run with one line and an exit code (the entry point prints them without a
traceback): a busy or unwritable dump folder, an unusable checkpoint, a loss spike, a rank that
stopped answering; and how a launch reports that line once (``LAUNCHER_ENV``)."""

from __future__ import annotations

__all__ = [
    "LAUNCHER_ENV",
    "RUN_INFO_ENV",
    "CheckpointError",
    "LossSpikeError",
    "NonFiniteLossError",
    "RankTimeoutError",
    "RunError",
]

LAUNCHER_ENV = "TORCHTITAN_CP_LAUNCHER"
"""Set by ``python -m torchtitan_cp.launch`` (``./scripts/train.sh``): a rank's one-line error
goes to its torchrun error file only, and the launcher prints it once."""

RUN_INFO_ENV = "TORCHTITAN_CP_RUN_INFO"
"""Set by the launcher to a file in its log folder: each node's local rank 0 writes there,
before training, where the run keeps its checkpoints, so that a launch stopped by a signal
(SIGTERM) can say in its one line where a rerun resumes (``launch.stopped_line``)."""


class RunError(RuntimeError):
    """A run that must not go on: a busy or unwritable dump folder, an unusable checkpoint, a
    loss spike. The message is one line naming the folder or file and the fix; the entry point
    prints it without a traceback and exits with ``exit_code``."""

    exit_code = 2


class CheckpointError(RunError):
    """A checkpoint that cannot be used as asked; the message names the step folder or file."""


class LossSpikeError(RunError):
    """The spike guard stopped the run."""

    exit_code = 1


class NonFiniteLossError(LossSpikeError):
    """A step's loss was inf or nan (the spike guard's verdict before the update, or the log
    step's check after it)."""


class RankTimeoutError(RunError):
    """Another rank did not answer within the comm timeout (not a configuration problem); the
    message names it (``run/rank_timeout.py``)."""

    exit_code = 1
