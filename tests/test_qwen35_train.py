"""Qwen3.5 end to end through the real entry point: 2 gloo CPU ranks, with and without CP."""

from __future__ import annotations

import functools

import pytest

from tests.launch import Launch, fork_train, read_metrics, seeded_runs

pytestmark = pytest.mark.slow

CONFIG = ["--config_file", "configs/qwen35_debug_cpu.toml"]


@pytest.mark.parametrize("cp", [1, 2])
def test_qwen35_debug_trains_on_two_cpu_ranks(tmp_path, cp):
    """FSDP over 2 ranks (CP=1) or CP=2 head-tail: the loss falls and the host routing reads
    nothing back."""
    args = [
        *CONFIG,
        "--training.steps",
        "10",
        "--validator.freq",
        "10",
        "--validator.steps",
        "1",
        "--metrics.no-enable-wandb",
        "--parallelism.context_parallel_degree",
        str(cp),
    ]
    print(fork_train([Launch(f"cp{cp}", 2, args)], folder=tmp_path))
    dump = tmp_path / f"cp{cp}"
    rows = read_metrics(dump)
    assert [r["step"] for r in rows] == list(range(1, 11))
    first, last = rows[0]["loss"], sum(r["loss"] for r in rows[-3:]) / 3
    assert last < first - 1.0, (first, last)
    assert all(r["routing/source"] == "host" and r["routing/readbacks"] == 0 for r in rows)


# Qwen3.5's debug config unless a caller names another (tests/test_kimi_linear_train.py).
_seeded_runs = functools.partial(seeded_runs, config=CONFIG)


def _assert_same_curve(ref: list[dict], other: list[dict]) -> None:
    for a, b in zip(ref, other, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-5, (a["step"], a["loss"], b["loss"])
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5, (a["step"], a["grad_norm"])


def test_qwen35_cp_with_fsdp_matches_fsdp_alone(tmp_path):
    """dp_shard=2 x cp=2 (4 ranks, head-tail) gives the dp_shard=2 loss and grad norm within
    1e-5 over 3 AdamW steps from one seed checkpoint: FSDP shards and reduces over the
    flattened dp_shard x cp mesh."""
    cp2 = ["--parallelism.context_parallel_degree", "2"]
    runs = _seeded_runs(
        tmp_path,
        ["--parallelism.data_parallel_shard_degree", "2"],
        {"dp2": (2, []), "dp2cp2": (4, cp2)},
    )
    _assert_same_curve(runs["dp2"], runs["dp2cp2"])


def test_qwen35_pass_kv_matches_unsharded(tmp_path):
    """Qwen3.5's debug flavor with pass-KV attention at CP=2 (head-tail) gives the CP=1 loss
    and grad norm within 1e-5 over 3 AdamW steps from one seed checkpoint."""
    cp2 = ["--parallelism.context_parallel_degree", "2"]
    runs = _seeded_runs(
        tmp_path, ["--model.attention_cp", "pass_kv"], {"cp1": (1, []), "cp2": (2, cp2)}
    )
    _assert_same_curve(runs["cp1"], runs["cp2"])
