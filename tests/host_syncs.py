"""The trainer's whole steps under ``HostSyncRecorder`` in every rank of a launch (tests only).

``tests.fork_launch`` runs ``main`` in each rank instead of ``torchtitan_cp.train.main`` for a
job with ``"entry": "tests.host_syncs:main"``: the real trainer on the real TOML and command
line, its device named ``cpu:0`` (apart from the host's ``cpu``, as the GPU check's dry run
names it: ``trainer/host_sync.py``), and the steps of ``HOST_SYNC_STEPS`` (default ``2``: past
the warm-up, not a log step when ``metrics.log_freq`` > 2) recorded whole, forward, backward,
gradient clipping and optimizer step. Each rank writes ``<dump_folder>/host_syncs_rank<R>.json``:
``{"steps": {step: [event line, ...]}}``.
"""

from __future__ import annotations

import json
import os
from typing import Any


def main(argv: list[str]) -> int:
    import torch
    import torchtitan.tools.utils as titan_utils

    from torchtitan_cp.train import main as train_main
    from torchtitan_cp.trainer.host_sync import event_lines, recorded
    from torchtitan_cp.trainer.trainer import HybridTrainer

    watched = {int(s) for s in os.environ.get("HOST_SYNC_STEPS", "2").split(",")}
    steps: dict[int, list[str]] = {}
    titan_utils.get_local_device = lambda: torch.device("cpu", 0)
    original = HybridTrainer.train_step

    def train_step(self: Any, data_iterator: Any) -> Any:
        if self.step not in watched:
            return original(self, data_iterator)
        with recorded(self) as rec:
            try:
                return original(self, data_iterator)
            finally:
                steps[self.step] = event_lines(rec.events)

    HybridTrainer.train_step = train_step  # type: ignore[method-assign]
    try:
        status = train_main(argv)
    finally:
        HybridTrainer.train_step = original  # type: ignore[method-assign]
    dump = argv[argv.index("--dump_folder") + 1]
    rank = int(os.environ.get("RANK", "0"))
    with open(os.path.join(dump, f"host_syncs_rank{rank}.json"), "w") as f:
        json.dump({"steps": {str(k): v for k, v in sorted(steps.items())}}, f, indent=1)
    return status
