"""``torchrun ... -m tests.fla_interpreter_train ARGS``: the trainer with fla-core's kernels on
CPU under Triton's interpreter (the ``fla_interpreter`` tier's trainer run).

Each rank installs the interpreter (tests/fla_interpreter.py) before anything imports fla, then
runs the trainer (``torchtitan_cp.train.run_worker``) with ARGS; production code never imports tests/. Exit status
2 with one line when the interpreter cannot run here.
"""

from __future__ import annotations

import sys

from tests import fla_interpreter

if __name__ == "__main__":
    why = fla_interpreter.install()
    if why is not None:
        print(f"tests.fla_interpreter_train: error: {why}", file=sys.stderr)
        sys.exit(2)
    from torchtitan_cp.run.process_exit import exit_process
    from torchtitan_cp.train import run_worker

    exit_process(run_worker())
