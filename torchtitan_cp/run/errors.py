"""The errors that stop a run with one line and an exit code (the entry point prints them without a
traceback): a busy or unwritable dump folder, an unusable checkpoint, a loss spike."""

from __future__ import annotations

__all__ = ["CheckpointError", "LossSpikeError", "RunError"]


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
