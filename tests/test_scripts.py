"""The GPU check (scripts/gpu_check.sh and gpu_check.py) as a CPU dry run, so it does not rot
between GPU sessions."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.launch import REPO


def test_gpu_check_dry_run_on_cpu(tmp_path):
    out = tmp_path / "gpu_check.json"
    # The shell wrapper too: its dependency probe, then its CUDA-only tests (skipped here).
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--device", "cpu", "--flavor", "debug",
         "--pattern", "KA", "--seq-len", "256", "--mean-doc", "40", "--steps", "2",
         "--warmup", "1", "--json", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    timing = json.loads(out.read_text())["timing"]
    assert timing["host"]["readbacks_per_step"] == 0
    assert timing["device_readback"]["readbacks_per_step"] >= 1
    assert "| host |" in proc.stdout
    assert "skipped" in proc.stdout and "CUDA tests failed" not in proc.stderr


def test_sync_check_names_the_synchronising_frame():
    # A synchronising step is reported with the innermost project/fla frame, where to look.
    import importlib.util

    import pytest
    import torch

    from torchtitan_cp.ops.fla_backend import _chunk_table

    spec = importlib.util.spec_from_file_location("gpu_check", f"{REPO}/scripts/gpu_check.py")
    assert spec is not None and spec.loader is not None
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    with pytest.raises(ValueError) as info:
        _chunk_table(None, 0, torch.zeros(1, 2), None)
    site = gpu_check.sync_site(info.value)
    assert site.startswith("torchtitan_cp/ops/fla_backend.py:") and "_chunk_table" in site
