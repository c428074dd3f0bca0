"""Mamba2 layers under context parallelism, end to end (all slow: multi-process).

* The whole "MMA" model, float64, CP = 2, 3 and 4 over contiguous, head-tail and PTRR: loss and
  every gradient equal the unsharded model's to 1e-10 (tests/test_model_cp.py's harness).
* Host-metadata and device-readback routing train bit for bit the same (tests/test_bitwise.py's
  harness, every balancer).
* The real entry point: a trainer run with layer_pattern = "MMA" at CP=2 gives the CP=1 loss and
  grad norm within 1e-5 over 3 AdamW steps (tests/test_train.py's harness).

The model tests build the debug flavor with the reference's Mamba2 sizes (head_dim 64, state 128:
two heads at dim 64).
"""

from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_distributed

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(
    "world, balancer, bsz, seqlen",
    [(2, "headtail", 2, 64), (3, "contiguous", 1, 96), (4, "headtail", 1, 64), (2, "ptrr", 2, 64)],
)
def test_mamba2_model_cp_equals_unsharded(world, balancer, bsz, seqlen):
    from tests.test_model_cp import TOL, _cp_model

    for worst in run_distributed(_cp_model, world, "MMA", balancer, bsz, seqlen):
        bad = {k: v for k, v in worst.items() if v > TOL}
        assert not bad, bad


def test_mamba2_host_and_readback_train_bitwise_identically():
    from tests.test_bitwise import _compare

    for problems in run_distributed(_compare, 2, "MMA", timeout=600):
        assert not problems, problems[:10]


def test_mamba2_trainer_cp2_matches_cp1(tmp_path):
    from tests.test_train import run_steps, seed_checkpoint

    opts = ["--config_file", "configs/debug_mamba2_cpu.toml"]
    seed = seed_checkpoint(tmp_path, *opts, "--parallelism.context_parallel_degree", "1")
    common = [*opts, "--checkpoint.enable", "--checkpoint.initial_load_path", seed]
    ref = run_steps(tmp_path, "cp1", 1, *common, "--parallelism.context_parallel_degree", "1")
    cp = run_steps(tmp_path, "cp2", 2, *common, "--parallelism.context_parallel_degree", "2")
    for a, b in zip(ref, cp, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-5, (a["step"], a["loss"], b["loss"])
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5, (a["step"], a["grad_norm"])
    assert torch.isfinite(torch.tensor([r["loss"] for r in cp])).all()
