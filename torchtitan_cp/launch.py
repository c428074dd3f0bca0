"""``torchrun`` with the recipe's one-line failures: ``python -m torchtitan_cp.launch [torchrun
options] -m torchtitan_cp.train ...`` (what ``./scripts/train.sh`` runs).

It takes torchrun's options and runs torchrun's own launcher (``torch.distributed.run``). When a
rank stops with one of the recipe's one-line errors (a configuration or data problem found inside
the ranks, a busy dump folder, an unusable checkpoint, a loss spike, a rank that stopped
answering), the first failing rank's line is printed once and the launch exits with that rank's
status (2 for configuration and data problems), instead of torchrun's ``ChildFailedError`` block
and status 1. Any other failure (a traceback) is reported by torchrun as usual.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

PREFIX = "torchtitan_cp.train: error: "


def one_line_failure(failures: dict[int, Any]) -> tuple[str, int] | None:
    """``(line, exit status)`` of the first failure (torchrun's root cause) when it is one of
    the recipe's one-line errors, else None. ``failures``: rank -> torchrun's ProcessFailure."""
    if not failures:
        return None
    # A rank killed by a signal (torchrun's SIGTERM after the first failure) is a consequence,
    # never the root cause; its timestamp is when torchrun noticed it, often the same second as
    # the rank that failed on its own (timestamps are whole seconds).
    rank = min(failures, key=lambda r: (failures[r].exitcode <= 0, failures[r].timestamp, r))
    failure = failures[rank]
    message = failure.message
    if isinstance(message, dict):
        message = message.get("message", "")
    if not isinstance(message, str) or not message.startswith(PREFIX) or "\n" in message:
        return None
    if failure.exitcode <= 0:  # killed by a signal after writing it: not the rank's verdict
        return None
    return message, failure.exitcode


class _HeldLogs(logging.Handler):
    """Holds the records of torchrun's own loggers while the ranks run: its agent logs each
    worker's failure and the SIGTERMs it sends (a few lines per rank) before it raises, which a
    one-line error makes redundant. Any other outcome replays them."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []
        self._propagate: dict[str, bool] = {}
        for name, item in list(logging.root.manager.loggerDict.items()):
            if name.startswith("torch.distributed") and isinstance(item, logging.Logger):
                self._propagate[name] = item.propagate
                item.addHandler(self)
                item.propagate = False

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def restore(self, *, replay: bool) -> None:
        for name, propagate in self._propagate.items():
            item = logging.getLogger(name)
            item.removeHandler(self)
            item.propagate = propagate
        for record in self.records if replay else ():
            logging.getLogger(record.name).handle(record)


def main(argv: list[str] | None = None) -> int:
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record

    from torchtitan_cp.run.errors import LAUNCHER_ENV

    os.environ[LAUNCHER_ENV] = "1"  # the ranks leave their one-line error to this process
    args = torchrun.parse_args(sys.argv[1:] if argv is None else argv)
    held = _HeldLogs()
    try:
        torchrun.run(args)
    except ChildFailedError as e:
        found = one_line_failure(e.failures)
        held.restore(replay=found is None)
        if found is None:
            error = e

            @record
            def report() -> None:  # torchrun's own report: its @record prints the block
                raise error

            report()
        assert found is not None
        line, status = found
        print(line, file=sys.stderr)
        return status
    except BaseException:
        held.restore(replay=True)
        raise
    held.restore(replay=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
