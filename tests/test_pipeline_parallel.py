"""Pipeline parallelism through torchtitan's schedules: the parity table (slow;
docs/parallelism.md has the numbers).

Every run starts from one seed checkpoint, float32 on gloo, ``--debug.deterministic``, the
hybrid debug model with one layer of each kind (``KGMRA``, Mamba2 in two B/C groups as in the
TP table), 10 steps, two pipeline
microbatches of one row a step. Against dp1 (one rank, two rows a step): pp2 under 1F1B
(stages ``KGMR|A`` by the cost model), under Interleaved1F1B (four stages, two per rank,
``KG|M|R|A``), under ZBVZeroBubble (the V order, split ``K|GM|R|A``), GPipe,
InterleavedZeroBubble, pp2 x cp2 and pp2 x tp2 (1F1B, four ranks each): the loss and grad norm within 1e-5 relative each step; host and readback routing
train bit for bit the same under pp2 x cp2; pp2's validation loss is dp1's; a pp2 x cp2
checkpoint of step 5 resumes under cp2, and a cp2 one under pp2 x cp2, on dp1's curve. pp2 x
fsdp2 (1F1B, four ranks) against one rank reading the same global batches of four rows
(``tests/helpers.row_aligned_corpus``). The runs are forked from one launcher that imported
the trainer once (tests/fork_launch.py), as the TP table's are.
"""

from __future__ import annotations

import json

import pytest

from tests.helpers import row_aligned_corpus
from tests.launch import Launch, fork_train, read_metrics
from tests.test_tensor_parallel import HYBRID as TP_HYBRID

pytestmark = pytest.mark.slow

# the TP table's model: KGMRA, Mamba2 in 2 B/C groups (so TP 2 holds one group per rank)
HYBRID = TP_HYBRID
STEPS = 10
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
VALIDATE = ["--validator.enable", "--validator.freq", str(STEPS // 2), "--validator.steps", "2"]


def schedule(name: str, split: str = "") -> list[str]:
    """The flags of pipeline schedule ``name`` (and a stage split, when given)."""
    flags = ["--parallelism.pipeline_parallel_schedule", name]
    return [*flags, "--parallelism.pipeline_parallel_split", split] if split else flags


def _launch(name: str, nproc: int, *extra: str, seed: str, **kw) -> Launch:
    """A run of STEPS steps from the seed, saving at step STEPS // 2 (``kw``: Launch's
    copy_from / remove)."""
    args = [*HYBRID, "--training.steps", str(STEPS), *RUN, "--checkpoint.enable"]
    interval = ["--checkpoint.interval", str(STEPS // 2)]
    return Launch(
        name, nproc, [*args, *interval, "--checkpoint.initial_load_path", seed, *extra], **kw
    )


def _resume(source: str, name: str, nproc: int, *extra: str, seed: str) -> Launch:
    """``source``'s dump with its step-5 checkpoint only, resumed to STEPS under another
    layout."""
    return _launch(
        name, nproc, *extra, seed=seed, copy_from=source, remove=(f"checkpoint/step-{STEPS}",)
    )


def _rows(tmp_path, name: str) -> list[tuple[float, float]]:
    rows = read_metrics(tmp_path / name)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1)), name
    return [(r["loss"], r["grad_norm"]) for r in rows]


def _validation(tmp_path, name: str) -> list[tuple[int, float]]:
    lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    return [(r["step"], r["validation_loss"]) for r in rows if "validation_loss" in r]


def _worst(ref: list[tuple[float, float]], run: list[tuple[float, float]]) -> float:
    return max(abs(a - b) / abs(a) for ra, rb in zip(ref, run, strict=True) for a, b in zip(ra, rb))


def test_pipeline_parallel_parity_table(tmp_path):
    """pp2 (1F1B, Interleaved1F1B, ZBVZeroBubble, GPipe, InterleavedZeroBubble), pp2 x cp2, pp2 x tp2 and pp2 x fsdp2 (1F1B)
    give dp1's loss and grad norm within 1e-5 relative each step; host and readback routing
    are bitwise equal under pp2 x cp2; pp2's validation loss is dp1's; a pp2 x cp2 checkpoint
    resumes under cp2, and a cp2 one under pp2 x cp2, on dp1's curve."""
    seed = str(tmp_path / "seed" / "checkpoint" / "step-0")
    seed_args = [*HYBRID, "--checkpoint.enable", "--checkpoint.create_seed_checkpoint"]
    split, interleaved = tmp_path / "split.jsonl", tmp_path / "interleaved.jsonl"
    row_aligned_corpus(split, interleaved, seq_len=256, rows=2 * STEPS)
    data = ["--dataloader.dataset", "jsonl", "--dataloader.dataset_path"]
    layouts = {
        "pp2-1f1b": (2, [*PP, *schedule("1F1B"), *VALIDATE]),
        "pp2-interleaved": (2, [*PP, *schedule("Interleaved1F1B")]),
        "pp2-zbv": (2, [*PP, *schedule("ZBVZeroBubble", "K|GM|R|A")]),
        "pp2-gpipe": (2, [*PP, *schedule("GPipe")]),
        "pp2-interleaved-zb": (2, [*PP, *schedule("InterleavedZeroBubble")]),
        "pp2xcp2": (4, [*PP, *CP]),
        "pp2xtp2": (4, [*PP, "--parallelism.tensor_parallel_degree", "2"]),
    }
    fsdp = [*PP, *schedule("1F1B"), *data, str(split)]
    print(fork_train([
        Launch("seed", 1, [*seed_args, "--metrics.no-enable-wandb"]),
        _launch("dp1", 1, *VALIDATE, seed=seed),
        *(_launch(name, n, *flags, seed=seed) for name, (n, flags) in layouts.items()),
        _launch("pp2xcp2-readback", 4, *PP, *CP, *READBACK, seed=seed),
        _launch("cp2", 2, *CP, seed=seed),
        _resume(str(tmp_path / "pp2xcp2"), "pp2xcp2-to-cp2", 2, *CP, seed=seed),
        _resume(str(tmp_path / "cp2"), "cp2-to-pp2xcp2", 4, *PP, *CP, seed=seed),
        _launch("dp1-aligned", 1, *data, str(interleaved), "--training.local_batch_size", "4",
                seed=seed),
        _launch("pp2xfsdp2", 4, *fsdp, seed=seed),
    ], folder=tmp_path))  # fmt: skip # a table, laid out by hand to read across
    assert _rows(tmp_path, "pp2xcp2") == _rows(tmp_path, "pp2xcp2-readback")
    ref = _rows(tmp_path, "dp1")
    worst = {name: _worst(ref, _rows(tmp_path, name)) for name in layouts}
    for name in ("pp2xcp2-to-cp2", "cp2-to-pp2xcp2"):
        worst[name] = _worst(ref[STEPS // 2 :], _rows(tmp_path, name)[STEPS // 2 :])
    worst["pp2xfsdp2"] = _worst(_rows(tmp_path, "dp1-aligned"), _rows(tmp_path, "pp2xfsdp2"))
    val_ref, val_pp = _validation(tmp_path, "dp1"), _validation(tmp_path, "pp2-1f1b")
    assert [s for s, _ in val_ref] == [1, STEPS // 2, STEPS], val_ref
    worst["pp2 validation"] = max(
        abs(a - b) / a for (_, a), (_, b) in zip(val_ref, val_pp, strict=True)
    )
    print("worst relative error against dp1:", worst)
    assert all(err <= REL for err in worst.values()), worst


def test_qwen35_pipeline_parallel_parity(tmp_path):
    """Qwen3.5 through the same schedules, its stages placed over its layer letters (``GGGA``):
    the dense debug model under pp2 (1F1B, stages ``GGG|A`` by the cost model), pp2 with
    Interleaved1F1B (``G|G|G|A``), pp2 x cp2 and pp2 x tp2 gives dp1's loss and grad norm
    within 1e-5 relative over 10 steps, host and readback routing bitwise under pp2 x cp2;
    ``debugmodel_moe`` under pp2, pp2 interleaved, pp2 x cp2 against dp1, and pp2 x ep2 (EP
    borrowed from FSDP, four ranks) against one rank reading the same global batches, within
    1e-5 through MOE_EXACT_STEPS and MOE_LATE after (the TP table's MoE bounds); the HF export
    of a pp2 x cp2 checkpoint taken at learning rate 0 is bit for bit the unsharded export."""
    from tests.test_export_hf import export_gap, export_tensors
    from tests.test_tensor_parallel import (
        FROZEN,
        MOE_EXACT_STEPS,
        MOE_LATE,
        MOE_STEPS,
        QWEN35,
        QWEN35_MOE,
    )

    def runs(model: list[str], steps: int, tag: str, seed: str) -> list[Launch]:
        args = [*model, *RUN, "--checkpoint.enable", "--checkpoint.initial_load_path", seed]

        def run(name: str, nproc: int, *extra: str) -> Launch:
            return Launch(f"{tag}-{name}", nproc, [*args, "--training.steps", str(steps), *extra])

        return [
            Launch(f"{tag}-seed", 1, [*model, "--checkpoint.enable",
                   "--checkpoint.create_seed_checkpoint", "--metrics.no-enable-wandb"]),
            run("dp1", 1),
            run("pp2-1f1b", 2, *PP, *schedule("1F1B")),
            run("pp2-interleaved", 2, *PP, *schedule("Interleaved1F1B")),
            run("pp2xcp2", 4, *PP, *CP),
        ]  # fmt: skip # a table, laid out by hand to read across

    dense_seed = str(tmp_path / "dense-seed" / "checkpoint" / "step-0")
    moe_seed = str(tmp_path / "moe-seed" / "checkpoint" / "step-0")
    split, interleaved = tmp_path / "split.jsonl", tmp_path / "interleaved.jsonl"
    row_aligned_corpus(split, interleaved, seq_len=256, rows=2 * MOE_STEPS)
    data = ["--dataloader.dataset", "jsonl", "--dataloader.dataset_path"]
    moe_args = [
        *QWEN35_MOE,
        *RUN,
        "--checkpoint.enable",
        "--checkpoint.initial_load_path",
        moe_seed,
        "--training.steps",
        str(MOE_STEPS),
    ]
    dense_args = [
        *QWEN35,
        *RUN,
        "--checkpoint.enable",
        "--checkpoint.initial_load_path",
        dense_seed,
    ]
    print(fork_train([
        *runs(QWEN35, STEPS, "dense", dense_seed),
        Launch("dense-pp2xcp2-readback", 4, [*dense_args, "--training.steps", str(STEPS), *PP,
               *CP, *READBACK]),
        Launch("dense-pp2xtp2", 4, [*dense_args, "--training.steps", str(STEPS), *PP,
               "--parallelism.tensor_parallel_degree", "2"]),
        Launch("dense-pp2xcp2-lr0", 4, [*dense_args, "--training.steps", "1", *PP, *CP,
               *FROZEN]),
        *runs(QWEN35_MOE, MOE_STEPS, "moe", moe_seed),
        Launch("moe-dp1-aligned", 1, [*moe_args, *data, str(interleaved),
               "--training.local_batch_size", "4"]),
        Launch("moe-pp2xep2", 4, [*moe_args, *PP, *schedule("1F1B"), *data, str(split),
               "--parallelism.expert_parallel_degree", "2"]),
    ], folder=tmp_path))  # fmt: skip # a table, laid out by hand to read across

    def rows(name: str, steps: int) -> list[tuple[float, float]]:
        got = read_metrics(tmp_path / name)
        assert [r["step"] for r in got] == list(range(1, steps + 1)), name
        return [(r["loss"], r["grad_norm"]) for r in got]

    def per_step(ref: list, run: list) -> list[float]:
        return [max(abs(a - b) / abs(a) for a, b in zip(x, y)) for x, y in zip(ref, run)]

    assert rows("dense-pp2xcp2", STEPS) == rows("dense-pp2xcp2-readback", STEPS)
    dense_ref = rows("dense-dp1", STEPS)
    dense = ("pp2-1f1b", "pp2-interleaved", "pp2xcp2", "pp2xtp2")
    worst = {f"dense-{n}": _worst(dense_ref, rows(f"dense-{n}", STEPS)) for n in dense}
    moe_ref = rows("moe-dp1", MOE_STEPS)
    moe = {
        f"moe-{n}": per_step(moe_ref, rows(f"moe-{n}", MOE_STEPS))
        for n in ("pp2-1f1b", "pp2-interleaved", "pp2xcp2")
    }
    moe["moe-pp2xep2"] = per_step(
        rows("moe-dp1-aligned", MOE_STEPS), rows("moe-pp2xep2", MOE_STEPS)
    )
    print("qwen3_5 dense: worst relative error against dp1:", worst)
    print("qwen3_5 MoE: relative error per step:", moe)
    assert all(err <= REL for err in worst.values()), worst
    assert all(max(v[:MOE_EXACT_STEPS]) <= REL for v in moe.values()), moe
    assert all(max(v[MOE_EXACT_STEPS:]) <= MOE_LATE for v in moe.values()), moe
    seed_hf = export_tensors(dense_seed, tmp_path / "seed-hf", *QWEN35)
    step_1 = tmp_path / "dense-pp2xcp2-lr0" / "checkpoint" / "step-1"
    assert export_gap(seed_hf, export_tensors(step_1, tmp_path / "pp-hf", *QWEN35)) == (0.0, "")


def test_kimi_linear_pipeline_parallel_parity(tmp_path):
    """Kimi Linear (``KKKA``, MoE after its first layer) through the same schedules, its stages
    placed over its layer letters: pp2 (1F1B, ``KKK|A`` by the cost model), pp2 Interleaved1F1B
    (``K|K|K|A``) and pp2 x cp2 against dp1, and pp2 x ep2 (EP borrowed from FSDP, four ranks)
    against one rank reading the same global batches, within 1e-5 relative each of MOE_STEPS
    steps (no top-k route flipped here, unlike Qwen3.5's MoE); host and readback routing
    bitwise under pp2 x cp2; at learning rate 0 a pp2 x cp2 checkpoint exports bit for bit what
    dp1's does (not the seed's: the expert bias moves by each expert's load at any lr, so this
    also checks that the stages count the loads of every pipeline microbatch)."""
    from tests.test_export_hf import export_gap, export_tensors
    from tests.test_tensor_parallel import FROZEN, MOE_STEPS

    kimi = ["--config_file", "configs/kimi_linear_debug_cpu.toml"]
    seed = str(tmp_path / "seed" / "checkpoint" / "step-0")
    split, interleaved = tmp_path / "split.jsonl", tmp_path / "interleaved.jsonl"
    row_aligned_corpus(split, interleaved, seq_len=256, rows=2 * MOE_STEPS)
    data = ["--dataloader.dataset", "jsonl", "--dataloader.dataset_path"]
    args = [*kimi, *RUN, "--checkpoint.enable", "--checkpoint.initial_load_path", seed]

    def run(name: str, nproc: int, *extra: str, steps: int = MOE_STEPS) -> Launch:
        return Launch(name, nproc, [*args, "--training.steps", str(steps), *extra])

    print(fork_train([
        Launch("seed", 1, [*kimi, "--checkpoint.enable", "--checkpoint.create_seed_checkpoint",
               "--metrics.no-enable-wandb"]),
        run("dp1", 1),
        run("pp2-1f1b", 2, *PP, *schedule("1F1B")),
        run("pp2-interleaved", 2, *PP, *schedule("Interleaved1F1B")),
        run("pp2xcp2", 4, *PP, *CP),
        run("pp2xcp2-readback", 4, *PP, *CP, *READBACK),
        run("dp1-aligned", 1, *data, str(interleaved), "--training.local_batch_size", "4"),
        run("pp2xep2", 4, *PP, *schedule("1F1B"), *data, str(split),
            "--parallelism.expert_parallel_degree", "2"),
        run("dp1-lr0", 1, *FROZEN, steps=1),
        run("pp2xcp2-lr0", 4, *PP, *CP, *FROZEN, steps=1),
    ], folder=tmp_path))  # fmt: skip # a table, laid out by hand to read across

    def rows(name: str) -> list[tuple[float, float]]:
        got = read_metrics(tmp_path / name)
        assert [r["step"] for r in got] == list(range(1, MOE_STEPS + 1)), name
        return [(r["loss"], r["grad_norm"]) for r in got]

    def per_step(ref: list, got: list) -> list[float]:
        return [max(abs(a - b) / abs(a) for a, b in zip(x, y)) for x, y in zip(ref, got)]

    assert rows("pp2xcp2") == rows("pp2xcp2-readback")
    err = {n: per_step(rows("dp1"), rows(n)) for n in ("pp2-1f1b", "pp2-interleaved", "pp2xcp2")}
    err["pp2xep2"] = per_step(rows("dp1-aligned"), rows("pp2xep2"))
    print("kimi_linear: relative error per step:", err)
    assert all(max(v) <= REL for v in err.values()), err
    step_1 = "{}/checkpoint/step-1".format
    ref_hf = export_tensors(tmp_path / step_1("dp1-lr0"), tmp_path / "dp1-hf", *kimi)
    pp_hf = export_tensors(tmp_path / step_1("pp2xcp2-lr0"), tmp_path / "pp-hf", *kimi)
    assert export_gap(ref_hf, pp_hf) == (0.0, "")
