"""End-to-end runs of the real entry point under torchrun (gloo, 2 CPU processes). The tests
that only compare runs' metrics fork their runs from one launcher (``fork_train``: real rank
processes and gloo groups, the real entry point, no torchrun agent); the rest, and every test
about torchrun itself, launch with torchrun."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.launch import (
    Launch,
    fork_train,
    python_train,
    read_metrics,
    read_run_headers,
    torchrun_train,
)

pytestmark = pytest.mark.slow

DEFAULT = ["--config_file", "configs/debug_cpu.toml"]


def test_default_config_trains_and_logs(tmp_path):
    """The embedded default with 2 ranks: loss falls, metrics.jsonl and an offline wandb run."""
    dump = tmp_path / "run"
    torchrun_train(
        [*DEFAULT, "--training.steps", "16", "--validator.freq", "8"], nproc=2, dump_folder=dump
    )
    rows = read_metrics(dump)
    assert [r["step"] for r in rows] == list(range(1, 17))
    for key in ("loss", "grad_norm", "lr", "tokens_per_s"):
        assert all(isinstance(r[key], float) for r in rows), key
    first, last = rows[0]["loss"], sum(r["loss"] for r in rows[-3:]) / 3
    assert last < first - 0.5, (first, last)
    lines = (dump / "metrics.jsonl").read_text().splitlines()
    assert any("validation_loss" in line for line in lines)
    runs = list(dump.glob("tb/*/wandb/offline-run-*"))
    assert runs, "expected an offline wandb run to sync later"


def fork_steps(tmp_path, runs: dict[str, tuple[int, list[str]]]) -> dict[str, list[dict]]:
    """3 deterministic steps of the debug config for each run ``{name: (nproc, extra args)}``,
    forked one after another from one launcher that imported the trainer once; each run's
    metrics by name."""
    fork_train(
        [
            Launch(
                name,
                nproc,
                [
                    *DEFAULT,
                    "--training.steps",
                    "3",
                    "--validator.no-enable",
                    "--metrics.no-enable-wandb",
                    "--debug.deterministic",
                    *extra,
                ],
            )
            for name, (nproc, extra) in runs.items()
        ],
        folder=tmp_path,
    )
    return {name: read_metrics(tmp_path / name) for name in runs}


def seed_checkpoint(tmp_path, *extra: str) -> str:
    """One initial model for runs with different sharding (FSDP initialises per shard).
    Also covers running the entry point without torchrun (one process)."""
    dump = tmp_path / "seed"
    python_train(
        [
            *DEFAULT,
            "--checkpoint.enable",
            "--checkpoint.create_seed_checkpoint",
            "--metrics.no-enable-wandb",
            *extra,
        ],
        dump_folder=dump,
    )
    return str(dump / "checkpoint" / "step-0")


def from_seed(tmp_path, pattern: str) -> list[str]:
    """The arguments of runs of layer pattern ``pattern`` that all start from one seed
    checkpoint of it (written here)."""
    seed = seed_checkpoint(tmp_path, "--model.layer_pattern", pattern)
    return [
        "--model.layer_pattern",
        pattern,
        "--checkpoint.enable",
        "--checkpoint.initial_load_path",
        seed,
    ]


@pytest.mark.parametrize(
    "pattern, modes", [("KKA", ["all_gather", "pass_kv"]), ("GGA", ["all_gather"])]
)
def test_context_parallel_matches_unsharded(tmp_path, pattern, modes):
    """CP=2 (head-tail) gives the CP=1 loss and grad norm within 1e-5 over 3 AdamW steps, with
    attention all-gathering K/V and (KKA) passing them (``model.attention_cp``)."""
    common = from_seed(tmp_path, pattern)
    runs = fork_steps(tmp_path, {
        "cp1": (1, common),
        **{f"cp2-{mode}": (2, [*common, "--model.attention_cp", mode,
                               "--parallelism.context_parallel_degree", "2"]) for mode in modes},
    })  # fmt: skip # a table, laid out by hand to read across
    ref = runs["cp1"]
    max_loss = "loss_metrics/global_max_loss"
    assert all(r[max_loss] == r["loss"] for r in ref), "one rank: the average itself"
    for mode in modes:
        cp = runs[f"cp2-{mode}"]
        for a, b in zip(ref, cp, strict=True):
            assert abs(a["loss"] - b["loss"]) <= 1e-5, (mode, a["step"], a["loss"], b["loss"])
            assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5, (mode, a["step"])
        # global_max_loss: the largest per-rank average (each CP rank's loss over its own
        # tokens), never below the average (before: a maximum of partial sums, about half)
        assert all(r[max_loss] >= r["loss"] for r in cp), [(r["loss"], r[max_loss]) for r in cp]


def test_checkpoint_resume_continues_the_loss_curve(tmp_path):
    dump = tmp_path / "ckpt"
    args = [
        *DEFAULT,
        "--training.steps",
        "6",
        "--validator.no-enable",
        "--metrics.no-enable-wandb",
        "--checkpoint.enable",
        "--checkpoint.interval",
        "3",
    ]
    torchrun_train(args, nproc=2, dump_folder=dump)
    full = {r["step"]: r["loss"] for r in read_metrics(dump)}
    shutil.rmtree(dump / "checkpoint" / "step-6")
    torchrun_train(args, nproc=2, dump_folder=dump)
    # One history: each step once; the first run's rows 4-6 moved to metrics.superseded.jsonl.
    rows = read_metrics(dump)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert [r["step"] for r in read_metrics(dump, "metrics.superseded.jsonl")] == [4, 5, 6]
    headers = read_run_headers(dump)
    assert [h["resumed_from_step"] for h in headers] == [0, 3], "the resumed run starts at step 4"
    assert all(h["world_size"] == 2 for h in headers)
    for r in rows:
        assert r["loss"] == full[r["step"]], (r["step"], r["loss"], full[r["step"]])
    # Both ranks hashed their share: the manifest covers every shard of the 2-rank save.
    manifest = json.loads((dump / "checkpoint" / "step-6" / "manifest.sha256.json").read_text())
    assert {".metadata", "__0_0.distcp", "__1_0.distcp"} <= set(manifest["files"])


@pytest.mark.parametrize("pattern, balancer", [("KKA", "headtail"), ("GGA", "ptrr")])
def test_host_and_readback_runs_are_bitwise_identical(tmp_path, pattern, balancer):
    """Two runs (CP=2, 2 gradient-accumulation microbatches, validation; forked) that differ
    only in linear_attention.routing_source log identical losses, grad norms, gradient and
    parameter hashes; the host run reads nothing back, also in validation."""
    common = [
        "--model.layer_pattern",
        pattern,
        "--parallelism.context_parallel_degree",
        "2",
        "--parallelism.context_parallel_load_balancer",
        balancer,
        "--training.global_batch_size",
        "4",
        "--debug.param_checksums",
        "--debug.seed",
        "42",
        "--validator.enable",
        "--validator.freq",
        "2",
        "--validator.steps",
        "2",
    ]
    fork_train(
        [
            Launch(
                source,
                2,
                [
                    *DEFAULT,
                    "--training.steps",
                    "3",
                    "--metrics.no-enable-wandb",
                    "--debug.deterministic",
                    "--linear_attention.routing_source",
                    source,
                    *common,
                ],
            )
            for source in ("host", "device_readback")
        ],
        folder=tmp_path,
    )
    runs = {
        s: (tmp_path / s / "metrics.jsonl").read_text().splitlines()
        for s in ("host", "device_readback")
    }
    host = [json.loads(x) for x in runs["host"]]
    dev = [json.loads(x) for x in runs["device_readback"]]
    train_h, train_d = [r for r in host if "loss" in r], [r for r in dev if "loss" in r]
    assert len(train_h) == len(train_d) == 3
    for h, d in zip(train_h, train_d, strict=True):
        for key in ("loss", "grad_norm", "params_sha256", "grads_sha256"):
            assert h[key] == d[key], (h["step"], key)
        assert h["routing/source"] == "host" and h["routing/readbacks"] == 0
        assert h["routing/microbatches"] == 2  # gradient accumulation takes the host path too
        assert d["routing/source"] == "device_readback" and d["routing/readbacks"] > 0
    val_h = [r for r in host if "validation_loss" in r]
    val_d = [r for r in dev if "validation_loss" in r]
    assert val_h and [r["validation_loss"] for r in val_h] == [r["validation_loss"] for r in val_d]
    assert all(r["validation_routing/source"] == "host" for r in val_h)
    assert all(r["validation_routing/readbacks"] == 0 for r in val_h)
    assert all(r["validation_routing/readbacks"] > 0 for r in val_d)


def test_context_parallel_with_fsdp_matches_fsdp_alone(tmp_path):
    """dp_shard=2 x cp=2 (4 ranks) gives the dp_shard=2 loss and grad norm: CP composes with
    FSDP (gradients reduced over the flattened dp_shard x cp mesh)."""
    pattern = "KGA"
    common = [*from_seed(tmp_path, pattern), "--parallelism.data_parallel_shard_degree", "2"]
    runs = fork_steps(tmp_path, {
        "dp2": (2, common),
        "dp2cp2": (4, [*common, "--parallelism.context_parallel_degree", "2"]),
    })  # fmt: skip # a table, laid out by hand to read across
    ref, both = runs["dp2"], runs["dp2cp2"]
    for a, b in zip(ref, both, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-5, (a["step"], a["loss"], b["loss"])
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5, (a["step"], a["grad_norm"])
