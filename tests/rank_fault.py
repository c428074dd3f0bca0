"""``torchrun ... -m tests.rank_fault ARGS``: the trainer's own entry point
(``python -m torchtitan_cp.train ARGS``, its ``__main__`` run through ``runpy``) with one fault
arranged on rank 1: a ``RuntimeError`` once its trainer is built, outside torchtitan's
``@record``-ed ``train``, where nothing but the entry point records an error for torchrun.
Tests only; production code never imports tests/."""

from __future__ import annotations

import os
import runpy

MESSAGE = "rank 1 failed after building its trainer (tests.rank_fault)"


def _arrange() -> None:
    from torchtitan_cp.trainer.trainer import HybridTrainer

    built = HybridTrainer.__init__

    def init(self, *args, **kwargs) -> None:
        built(self, *args, **kwargs)
        if os.environ.get("RANK") == "1":
            raise RuntimeError(MESSAGE)

    HybridTrainer.__init__ = init  # type: ignore[method-assign]


if __name__ == "__main__":
    _arrange()
    runpy.run_module("torchtitan_cp.train", run_name="__main__", alter_sys=True)
