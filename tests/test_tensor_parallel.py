"""Tensor and expert parallelism, alone and composed with CP: the parity table (slow;
docs/parallelism.md has the numbers).

The model: the float64 hybrid debug model with one layer of each kind that shards over TP
(``KGRA``; Mamba2 is refused, see ``Mamba2Mixer.tensor_parallel_heads``) under tp2 and
cp2 x tp2 equals the unsharded model (loss and gradients, 1e-10). The trainer: every run starts
from one seed checkpoint, float32 on gloo. Hybrid: tp2, cp2 and cp2 x tp2 give dp1's loss and
grad norm within 1e-5 relative over 10 AdamW steps, host and device-readback routing train bit
for bit the same under cp2 x tp2 (one routing per CP rank, shared by its TP ranks), and a DCP
checkpoint of one layout resumes under the other. Qwen3.5 dense: tp2 and cp2 x tp2 against dp1,
routing bitwise, and the HF export of a cp2 x tp2 checkpoint bitwise equal to the unsharded
export of the same weights. Qwen3.5 MoE: cp2 x ep2 against dp1, ep2 against fsdp2, the HF
export of an ep2 checkpoint bitwise equal to the unsharded one. Cost on the 2-core machine:
process starts dominate (about 10 s of CPU each; a hybrid step on 4 ranks about 1.4 s); the
totals are in docs/parallelism.md."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed
from tests.launch import python_train, read_metrics, torchrun_train
from tests.test_export_hf import export_gap, export_tensors
from tests.test_train import DEFAULT, seed_checkpoint

pytestmark = pytest.mark.slow

PATTERN = "KGRA"
HYBRID = [*DEFAULT, "--model.layer_pattern", PATTERN]
QWEN35 = ["--config_file", "configs/qwen35_debug_cpu.toml"]
QWEN35_MOE = [*QWEN35, "--model.flavor", "debugmodel_moe"]
STEPS = 10
REL = 1e-5
# One full training step at learning rate 0: the sharded run saves the seed's weights again
FROZEN = ["--optimizer.param-groups.0.optimizer-kwargs.lr", "0"]


def _tp_model(rank: int, world: int, pattern: str) -> dict[str, dict[str, float]]:
    """The float64 debug model, unsharded on every rank, against its copies under tp2 (each
    CP row of the 2 x 2 mesh alone, CP off) and cp2 x tp2: loss and every gradient (TP shards
    gathered, CP parts summed). One world of 4 for both layouts: a spawn costs more CPU than
    the model."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from tests.helpers import random_batch
    from tests.test_model_cp import loss_and_grads
    from torchtitan_cp.models import model_config
    from torchtitan_cp.models.hybrid.parallelize import apply_tensor_parallel
    from torchtitan_cp.trainer.sequence import SequencePreprocessor

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("cp", "tp"))
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = model_config("debug", layer_pattern=pattern, vocab_size=97).build()
    model.init_states()
    model = model.double()
    tokens, positions, labels = random_batch(1, 2, 64, 97)
    common = dict(device=torch.device("cpu"), load_balancer="headtail", ptrr_block_size=16)
    ref = SequencePreprocessor(cp_group=None, **common)
    ref_loss, ref_grads = loss_and_grads(model, ref, tokens, positions, labels, True)
    out = {}
    for name, cp_group in (("tp2", None), ("cp2xtp2", mesh["cp"].get_group())):
        tp_model = copy.deepcopy(model)
        apply_tensor_parallel(tp_model, mesh["tp"])
        seq = SequencePreprocessor(cp_group=cp_group, **common)
        loss, grads = loss_and_grads(tp_model, seq, tokens, positions, labels, True)
        if cp_group is not None:
            dist.all_reduce(loss, group=cp_group)
        worst = {"loss": float((loss - ref_loss).abs())}
        for key, g in grads.items():
            g = g.full_tensor() if isinstance(g, DTensor) else g
            if cp_group is not None:
                dist.all_reduce(g, group=cp_group)
            worst[key] = float((g - ref_grads[key]).abs().max())
        out[name] = worst
    return out


def test_model_tp_equals_unsharded():
    """Every kind that shards (K, G, R, A) in one model, float64: loss and gradients under tp2
    and cp2 x tp2 equal the unsharded model's to 1e-10."""
    for per_layout in run_distributed(_tp_model, 4, PATTERN):
        for layout, worst in per_layout.items():
            bad = {k: v for k, v in worst.items() if v > 1e-10}
            assert not bad, (layout, bad)


def _run(tmp_path, name: str, nproc: int, *extra: str, model=HYBRID, steps=STEPS) -> list[dict]:
    dump = tmp_path / name
    torchrun_train(
        [*model, "--training.steps", str(steps),
         "--validator.no-enable", "--metrics.no-enable-wandb", "--debug.deterministic", *extra],
        nproc=nproc, dump_folder=dump, timeout=600,
    )  # fmt: skip
    rows = read_metrics(dump)
    assert [r["step"] for r in rows] == list(range(1, steps + 1)), name
    return rows


def _worst(ref: list[dict], run: list[dict]) -> float:
    return max(
        abs(a[key] - b[key]) / abs(a[key])
        for a, b in zip(ref, run, strict=True)
        for key in ("loss", "grad_norm")
    )


def _resume(tmp_path, source: str, name: str, nproc: int, *extra: str) -> list[dict]:
    """Copy run ``source``'s dump, keep its step-5 checkpoint only, and resume it to step 10
    under another layout: the rows of steps 6-10."""
    shutil.copytree(tmp_path / source, tmp_path / name)
    shutil.rmtree(tmp_path / name / "checkpoint" / f"step-{STEPS}")
    rows = _run(tmp_path, name, nproc, *extra)
    return [r for r in rows if r["step"] > STEPS // 2]


def _export(tmp_path, name: str, step: int, model: list[str]) -> dict[str, torch.Tensor]:
    """Run ``name``'s step-``step`` DCP checkpoint (whatever its sharding) exported with
    scripts/export_hf.py: its HF tensors."""
    checkpoint = tmp_path / name / "checkpoint" / f"step-{step}"
    return export_tensors(checkpoint, tmp_path / f"{name}-hf", *model)


def test_tensor_parallel_parity_table(tmp_path):
    """The parity table of the hybrid model (dp1, tp2, cp2, cp2 x tp2), routing host against
    readback under cp2 x tp2, and DCP checkpoints across layouts: cp2 x tp2's step 5 resumed
    under cp2, and cp2's under cp2 x tp2, continue dp1's curve."""
    seed = seed_checkpoint(tmp_path, "--model.layer_pattern", PATTERN)
    common = ["--checkpoint.enable", "--checkpoint.initial_load_path", seed,
              "--checkpoint.interval", str(STEPS // 2)]  # fmt: skip
    ref = _run(tmp_path, "dp1", 1, *common)
    tp = ["--parallelism.tensor_parallel_degree", "2"]
    cp = ["--parallelism.context_parallel_degree", "2"]
    runs = {
        "tp2": _run(tmp_path, "tp2", 2, *common, *tp),
        "cp2": _run(tmp_path, "cp2", 2, *common, *cp),
        "cp2xtp2": _run(tmp_path, "cp2xtp2", 4, *common, *cp, *tp),
    }
    readback = _run(tmp_path, "cp2xtp2-readback", 4, *common, *cp, *tp,
                    "--linear_attention.routing_source", "device_readback")  # fmt: skip
    resumed = {
        "cp2xtp2->cp2": _resume(tmp_path, "cp2xtp2", "cp2xtp2-to-cp2", 2, *common, *cp),
        "cp2->cp2xtp2": _resume(tmp_path, "cp2", "cp2-to-cp2xtp2", 4, *common, *cp, *tp),
    }
    worst = {name: _worst(ref, rows) for name, rows in runs.items()}
    worst |= {name: _worst(ref[STEPS // 2 :], rows) for name, rows in resumed.items()}
    print("worst relative error against dp1:", worst)
    assert all(err <= REL for err in worst.values()), worst
    host = [(r["loss"], r["grad_norm"]) for r in runs["cp2xtp2"]]
    assert host == [(r["loss"], r["grad_norm"]) for r in readback]


def _seed(tmp_path, model: list[str]) -> str:
    python_train([*model, "--checkpoint.enable", "--checkpoint.create_seed_checkpoint",
                  "--metrics.no-enable-wandb"], dump_folder=tmp_path / "seed")  # fmt: skip
    return str(tmp_path / "seed" / "checkpoint" / "step-0")


def test_qwen35_tensor_parallel_parity(tmp_path):
    """Qwen3.5's dense debug model (GatedDeltaNet and gated attention layers): tp2 and
    cp2 x tp2 give dp1's loss and grad norm within 1e-5 relative over 10 steps; host and
    readback routing train bit for bit the same under cp2 x tp2; a cp2 x tp2 checkpoint's HF
    export (scripts/export_hf.py) is bit for bit the unsharded export of the same weights."""
    seed = _seed(tmp_path, QWEN35)
    common = ["--checkpoint.enable", "--checkpoint.initial_load_path", seed]
    tp = ["--parallelism.tensor_parallel_degree", "2"]
    cp = ["--parallelism.context_parallel_degree", "2"]
    ref = _run(tmp_path, "dp1", 1, *common, model=QWEN35)
    runs = {
        "tp2": _run(tmp_path, "tp2", 2, *common, *tp, model=QWEN35),
        "cp2xtp2": _run(tmp_path, "cp2xtp2", 4, *common, *cp, *tp, model=QWEN35),
    }
    readback_args = [*common, *cp, *tp, "--linear_attention.routing_source", "device_readback"]
    readback = _run(tmp_path, "cp2xtp2-readback", 4, *readback_args, model=QWEN35)
    worst = {name: _worst(ref, rows) for name, rows in runs.items()}
    print("qwen3_5: worst relative error against dp1:", worst)
    assert all(err <= REL for err in worst.values()), worst
    host = [(r["loss"], r["grad_norm"]) for r in runs["cp2xtp2"]]
    assert host == [(r["loss"], r["grad_norm"]) for r in readback]
    # HF export: a cp2 x tp2 step (FSDP x TP 2-D parameters, one full step run at learning
    # rate 0) exports bit for bit as the unsharded seed it holds. Trained runs are no bitwise
    # reference: Adam turns last-bit gradient differences into up to a step's size on
    # parameters with tiny gradients (after 10 steps: 7e-4 of A_log, docs/parallelism.md)
    _run(tmp_path, "cp2xtp2-lr0", 4, *common, *cp, *tp, *FROZEN, model=QWEN35, steps=1)
    seed_hf = export_tensors(seed, tmp_path / "seed-hf", *QWEN35)
    assert export_gap(seed_hf, _export(tmp_path, "cp2xtp2-lr0", 1, QWEN35)) == (0.0, "")


def test_qwen35_moe_expert_parallel_parity(tmp_path):
    """Qwen3.5's debugmodel_moe through torchtitan's MoE modules and all-to-all dispatcher:
    cp2 x ep2 (EP borrowed from CP) gives dp1's loss and grad norm, ep2 (borrowed from FSDP)
    fsdp2's (same data: two data-parallel ranks), within 1e-5 relative; an ep2 checkpoint's
    HF export is bit for bit the unsharded export of the same weights.

    Two steps, not ten: the MoE model's curves part under any change of sharding, CP alone
    included (cp2 against dp1, no EP: 2e-9, 6e-8, 2e-6 at steps 1-3, ~1e-3 by step 10), as
    last-bit differences flip near-tied top-k routes and Adam amplifies them; EP's runs part
    the same way (docs/parallelism.md). Steps 1-2 check the sharded gradients themselves."""
    seed = _seed(tmp_path, QWEN35_MOE)
    common = ["--checkpoint.enable", "--checkpoint.initial_load_path", seed]
    ep = ["--parallelism.expert_parallel_degree", "2"]
    cp = ["--parallelism.context_parallel_degree", "2"]
    moe = dict(model=QWEN35_MOE, steps=2)
    dp1 = _run(tmp_path, "dp1", 1, *common, **moe)
    fsdp2 = _run(tmp_path, "fsdp2", 2, *common, **moe)
    worst = {
        "cp2xep2": _worst(dp1, _run(tmp_path, "cp2xep2", 2, *common, *cp, *ep, **moe)),
        "ep2 (vs fsdp2)": _worst(fsdp2, _run(tmp_path, "ep2", 2, *common, *ep, **moe)),
    }
    print("qwen3_5 MoE: worst relative error:", worst)
    assert all(err <= REL for err in worst.values()), worst
    # HF export: an ep2 step (experts sharded over EP, one full step run at learning rate 0)
    # exports bit for bit as the unsharded seed it holds
    _run(tmp_path, "ep2-lr0", 2, *common, *ep, *FROZEN, model=QWEN35_MOE, steps=1)
    seed_hf = export_tensors(seed, tmp_path / "seed-hf", *QWEN35_MOE)
    assert export_gap(seed_hf, _export(tmp_path, "ep2-lr0", 1, QWEN35_MOE)) == (0.0, "")
