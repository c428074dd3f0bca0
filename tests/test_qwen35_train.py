"""Qwen3.5 end to end through the real entry point: 2 gloo CPU ranks, with and without CP."""

from __future__ import annotations

import pytest

from tests.launch import read_metrics, torchrun_train

pytestmark = pytest.mark.slow

CONFIG = ["--config_file", "configs/qwen35_debug_cpu.toml"]


@pytest.mark.parametrize("cp", [1, 2])
def test_qwen35_debug_trains_on_two_cpu_ranks(tmp_path, cp):
    """FSDP over 2 ranks (CP=1) or CP=2 head-tail: the loss falls and the host routing reads
    nothing back."""
    dump = tmp_path / f"cp{cp}"
    torchrun_train(
        [*CONFIG, "--training.steps", "10", "--validator.freq", "10", "--validator.steps", "1",
         "--metrics.no-enable-wandb", "--parallelism.context_parallel_degree", str(cp)],
        nproc=2, dump_folder=dump,
    )  # fmt: skip
    rows = read_metrics(dump)
    assert [r["step"] for r in rows] == list(range(1, 11))
    first, last = rows[0]["loss"], sum(r["loss"] for r in rows[-3:]) / 3
    assert last < first - 1.0, (first, last)
    assert all(r["routing/source"] == "host" and r["routing/readbacks"] == 0 for r in rows)
