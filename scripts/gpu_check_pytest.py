"""pytest plugin of scripts/gpu_check.py's pytest parts (``-p gpu_check_pytest``; loaded by
every xdist worker too):

* fla's autotune keeps one config per kernel by ``GPU_CHECK_FLA_AUTOTUNE`` (a rule of
  scripts/gpu_autotune.py), installed before the test modules import fla's kernels;
* flex attention is compiled without max_autotune, as in the other parts;
* every test's outcome appends one JSON line to each file of ``GPU_CHECK_RESULTS``
  (``os.pathsep``-separated), with its duration and what it recorded (``record_property``:
  the measured errors), under the part ``GPU_CHECK_PART``, as it finishes: a part cut short
  keeps the tests it finished.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any


def pytest_configure(config: Any) -> None:
    rule = os.environ.get("GPU_CHECK_FLA_AUTOTUNE")
    if rule:
        import gpu_autotune

        gpu_autotune.prune(rule)
    import torch

    if torch.cuda.is_available():
        from gpu_check import no_flex_max_autotune

        no_flex_max_autotune()


def pytest_runtest_logreport(report: Any) -> None:
    # One line per test: its call phase, or the phase that skipped or failed it.
    if report.when != "call" and not (report.skipped or report.failed):
        return
    paths = [p for p in os.environ.get("GPU_CHECK_RESULTS", "").split(os.pathsep) if p]
    if not paths:
        return
    import gpu_autotune
    import torch

    row = {
        "part": os.environ.get("GPU_CHECK_PART", "tests"),
        "name": report.nodeid,
        "ok": not report.failed,
        "outcome": report.outcome,
        "seconds": round(report.duration, 2),
        "call": float(os.environ.get("GPU_CHECK_CALL", "0")) or None,
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "fla_autotune": gpu_autotune.applied()["rule"],
        "finished_at": time.time(),
        **{k: v for k, v in report.user_properties},
    }
    if report.skipped and isinstance(report.longrepr, tuple):
        row["skipped"] = report.longrepr[2]
    if report.failed:
        row["error"] = str(report.longrepr)[-1500:]
    line = json.dumps(row, default=str)
    for p in paths:
        with open(p, "a") as f:
            f.write(line + "\n")
