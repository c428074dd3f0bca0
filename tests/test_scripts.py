"""The GPU check script's CPU dry run, so the script does not rot between GPU sessions."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.launch import REPO


def test_gpu_check_dry_run_on_cpu(tmp_path):
    out = tmp_path / "gpu_check.json"
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "scripts/gpu_check.py", "--device", "cpu", "--flavor", "debug",
         "--pattern", "KA", "--seq-len", "256", "--mean-doc", "40", "--steps", "2",
         "--warmup", "1", "--json", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    timing = json.loads(out.read_text())["timing"]
    assert timing["host"]["readbacks_per_step"] == 0
    assert timing["device_readback"]["readbacks_per_step"] >= 1
    assert "| host |" in proc.stdout
