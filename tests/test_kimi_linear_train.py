"""Kimi Linear end to end through the real entry point on gloo CPU ranks: CP=2 gives the CP=1
losses from one seed checkpoint, and the host routing reads nothing back; expert parallelism
(alone, with CP, with FSDP over the experts) gives the unsharded runs' losses."""

from __future__ import annotations

import pytest

from tests.test_qwen35_train import _assert_same_curve, _seeded_runs

pytestmark = pytest.mark.slow

CONFIG = ["--config_file", "configs/kimi_linear_debug_cpu.toml"]


@pytest.mark.parametrize("balancer", ["headtail", "contiguous"])
def test_kimi_linear_cp2_matches_cp1(tmp_path, balancer):
    """CP=2 on 2 ranks = CP=1 on 1 rank (same global batch): loss and grad norm within 1e-5
    over 10 AdamW steps; the loss falls; 0 routing readbacks."""
    cp2 = [
        "--parallelism.context_parallel_degree",
        "2",
        "--parallelism.context_parallel_load_balancer",
        balancer,
    ]
    runs = _seeded_runs(tmp_path, [], {"cp1": (1, []), "cp2": (2, cp2)}, config=CONFIG, steps=10)
    _assert_same_curve(runs["cp1"], runs["cp2"])
    rows = runs["cp2"]
    assert rows[-1]["loss"] < rows[0]["loss"]
    assert all(r["routing/source"] == "host" and r["routing/readbacks"] == 0 for r in rows)


def test_kimi_linear_expert_parallel_matches_unsharded(tmp_path):
    """torchtitan's MoE sharding and all-to-all dispatcher on Kimi Linear's experts (the
    activation-dtype subclass takes its local expert shard), from one seed checkpoint, loss
    and grad norm within 1e-5 relative over 3 AdamW steps: cp2 x ep2 on 2 ranks (EP borrowed
    from CP) against dp1, and dp_shard2 x cp2 x ep2 on 4 ranks (EP inside dp_shard x cp, the
    experts FSDP-sharded over the other 2) against fsdp2 (the same two data-parallel ranks).
    Few steps: MoE curves part under any resharding (near-tied top-k routes flip on last-bit
    differences, Adam amplifies them; tests/test_tensor_parallel.py's Qwen3.5 MoE check)."""
    ep2 = ["--parallelism.expert_parallel_degree", "2"]
    cp2 = ["--parallelism.context_parallel_degree", "2"]
    runs = _seeded_runs(
        tmp_path,
        [],
        {
            "dp1": (1, []),
            "cp2xep2": (2, [*cp2, *ep2]),
            "fsdp2": (2, []),
            "fsdp2xcp2xep2": (4, ["--parallelism.data_parallel_shard_degree", "2", *cp2, *ep2]),
        },
        config=CONFIG,
        steps=3,
    )
    worst = {
        name: max(
            abs(a[key] - b[key]) / abs(a[key])
            for a, b in zip(runs[ref], runs[name], strict=True)
            for key in ("loss", "grad_norm")
        )
        for name, ref in (("cp2xep2", "dp1"), ("fsdp2xcp2xep2", "fsdp2"))
    }
    print("kimi_linear EP: worst relative error:", worst)
    assert all(err <= 1e-5 for err in worst.values()), worst
    assert all(r["routing/readbacks"] == 0 for r in runs["fsdp2xcp2xep2"])
