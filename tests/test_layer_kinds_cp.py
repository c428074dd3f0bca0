"""Layer kinds under context parallelism, end to end, each in the same three tests (all slow:
multi-process). KDA, GDN and attention have theirs in tests/test_model_cp.py, test_bitwise.py
and test_train.py; every other kind is one entry of ``KINDS`` below:

* The whole model (the kind's layers and one attention layer), float64, CP over the kind's
  worlds and load balancers: loss and every gradient equal the unsharded model's to 1e-10
  (tests/test_model_cp.py's harness; one spawn per entry of ``model``, covering its balancers).
* Host-metadata and device-readback routing train bit for bit the same (tests/test_bitwise.py's
  harness, every balancer).
* The real entry point: a trainer run at CP=2 gives the CP=1 loss and grad norm within 1e-5 over
  3 AdamW steps (tests/test_train.py's check, its launches forked by tests/launch.py::fork_train).

Gated DeltaProduct (P): two delta-rule steps per token (the default ``householder``), so its
stream's tables are the routing's expanded (``SequenceTables.expanded``).

Mamba2 (M): the model tests build the debug flavor with the reference's Mamba2 sizes (head_dim
64, state 128: two heads at dim 64); the trainer runs configs/debug_mamba2_cpu.toml.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from tests.dist_utils import run_distributed
from torchtitan_cp.routing.balancers import balancer_names

pytestmark = pytest.mark.slow


@dataclass(frozen=True)
class KindCases:
    pattern: str  # the model's layer_pattern
    model: list[tuple[int, tuple[str, ...], int, int]]  # (world, balancers, bsz, seqlen) spawns
    trainer: tuple[str, ...]  # train.py options of its trainer run (config file, pattern)


KINDS = {
    "M": KindCases(
        "MMA",
        [(2, ("headtail",), 2, 64), (3, ("contiguous",), 1, 96), (4, ("headtail",), 1, 64),
         (2, ("ptrr",), 2, 64)],
        ("--config_file", "configs/debug_mamba2_cpu.toml"),
    ),
    "R": KindCases("RRA", [(2, balancer_names(), 2, 64)], ("--model.layer_pattern", "RRA")),
    "P": KindCases("PPA", [(2, balancer_names(), 2, 64), (3, ("headtail",), 1, 96)],
                   ("--model.layer_pattern", "PPA")),
}  # fmt: skip # a table, laid out by hand to read across


def _cp_model_balancers(rank, world, pattern, balancers, bsz, seqlen) -> dict[str, float]:
    from tests.test_model_cp import _cp_model

    worst = {}
    for balancer in balancers:
        for name, err in _cp_model(rank, world, pattern, balancer, bsz, seqlen).items():
            worst[f"{balancer}/{name}"] = err
    return worst


@pytest.mark.parametrize(
    "pattern, world, balancers, bsz, seqlen",
    [(k.pattern, *case) for k in KINDS.values() for case in k.model],
)
def test_model_cp_equals_unsharded(pattern, world, balancers, bsz, seqlen):
    from tests.test_model_cp import TOL

    for worst in run_distributed(_cp_model_balancers, world, pattern, balancers, bsz, seqlen):
        bad = {k: v for k, v in worst.items() if v > TOL}
        assert not bad, bad


@pytest.mark.parametrize("pattern", [k.pattern for k in KINDS.values()])
def test_host_and_readback_train_bitwise_identically(pattern):
    from tests.test_bitwise import _compare

    for problems in run_distributed(_compare, 2, pattern, timeout=600):
        assert not problems, problems[:10]


@pytest.mark.parametrize("letter", sorted(KINDS))
def test_trainer_cp2_matches_cp1(tmp_path, letter):
    from tests.launch import seeded_runs

    degree = "--parallelism.context_parallel_degree"
    run = ["--config_file", "configs/debug_cpu.toml", *KINDS[letter].trainer]
    runs = seeded_runs(
        tmp_path,
        [],
        {"cp1": (1, [degree, "1"]), "cp2": (2, [degree, "2"])},
        run,
        seed_extra=(degree, "1"),  # one process, whatever CP degree the kind's config sets
    )
    ref, cp = runs["cp1"], runs["cp2"]
    for a, b in zip(ref, cp, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-5, (a["step"], a["loss"], b["loss"])
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5, (a["step"], a["grad_norm"])
    assert torch.isfinite(torch.tensor([r["loss"] for r in cp])).all()
