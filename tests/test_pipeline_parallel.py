"""Pipeline parallelism through torchtitan's schedules: the parity table (slow;
docs/parallelism.md has the numbers).

Every run starts from one seed checkpoint, float32 on gloo, ``--debug.deterministic``, the
hybrid debug model with one layer of each kind (``KGMRA``). Against dp1 (one rank, two rows a
step): pp2 under 1F1B (stages ``KGMR|A`` by the cost model), pp2 under Interleaved1F1B (four
stages, two per rank, ``KG|M|R|A``), pp2 under ZBVZeroBubble (the V order, split
``KG|MR|A|``-free: ``K|GM|R|A``) and pp2 x cp2 (1F1B, four ranks), each with two pipeline
microbatches of one row: the loss and grad norm within 1e-5 relative each step, and host and
readback routing train bit for bit the same under pp2 x cp2. The runs are forked from one
launcher that imported the trainer once (tests/fork_launch.py), as the TP table's are.
"""

from __future__ import annotations

import pytest

from tests.launch import Launch, fork_train, read_metrics
from tests.test_train import DEFAULT

pytestmark = pytest.mark.slow

HYBRID = [*DEFAULT, "--model.layer_pattern", "KGMRA"]
STEPS = 6
REL = 1e-5
RUN = ["--validator.no-enable", "--metrics.no-enable-wandb", "--debug.deterministic"]
PP = [
    "--parallelism.pipeline_parallel_degree",
    "2",
    "--parallelism.pipeline_parallel_microbatch_size",
    "1",
]
CP = ["--parallelism.context_parallel_degree", "2"]
READBACK = ["--linear_attention.routing_source", "device_readback"]


def schedule(name: str, split: str = "") -> list[str]:
    """The flags of pipeline schedule ``name`` (and a stage split, when given)."""
    flags = ["--parallelism.pipeline_parallel_schedule", name]
    return [*flags, "--parallelism.pipeline_parallel_split", split] if split else flags


def _launch(name: str, nproc: int, *extra: str, seed: str) -> Launch:
    args = [*HYBRID, "--training.steps", str(STEPS), *RUN, "--checkpoint.enable"]
    return Launch(name, nproc, [*args, "--checkpoint.initial_load_path", seed, *extra])


def _rows(tmp_path, name: str) -> list[tuple[float, float]]:
    rows = read_metrics(tmp_path / name)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1)), name
    return [(r["loss"], r["grad_norm"]) for r in rows]


def _worst(ref: list[tuple[float, float]], run: list[tuple[float, float]]) -> float:
    return max(abs(a - b) / abs(a) for ra, rb in zip(ref, run, strict=True) for a, b in zip(ra, rb))


def test_pipeline_parallel_parity_table(tmp_path):
    """pp2 (1F1B, Interleaved1F1B, ZBVZeroBubble) and pp2 x cp2 give dp1's loss and grad norm
    within 1e-5 relative each step; host and readback routing are bitwise equal under
    pp2 x cp2."""
    seed = str(tmp_path / "seed" / "checkpoint" / "step-0")
    seed_args = [*HYBRID, "--checkpoint.enable", "--checkpoint.create_seed_checkpoint"]
    layouts = {
        "pp2-1f1b": (2, [*PP, *schedule("1F1B")]),
        "pp2-interleaved": (2, [*PP, *schedule("Interleaved1F1B")]),
        "pp2-zbv": (2, [*PP, *schedule("ZBVZeroBubble", "K|GM|R|A")]),
        "pp2xcp2": (4, [*PP, *CP]),
    }
    print(fork_train([
        Launch("seed", 1, [*seed_args, "--metrics.no-enable-wandb"]),
        _launch("dp1", 1, seed=seed),
        *(_launch(name, n, *flags, seed=seed) for name, (n, flags) in layouts.items()),
        _launch("pp2xcp2-readback", 4, *PP, *CP, *READBACK, seed=seed),
    ], folder=tmp_path))  # fmt: skip # a table, laid out by hand to read across
    assert _rows(tmp_path, "pp2xcp2") == _rows(tmp_path, "pp2xcp2-readback")
    ref = _rows(tmp_path, "dp1")
    worst = {name: _worst(ref, _rows(tmp_path, name)) for name in layouts}
    print("worst relative error against dp1:", worst)
    assert all(err <= REL for err in worst.values()), worst
