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
export of an ep2 checkpoint bitwise equal to the unsharded one. Cost: each test's runs are
forked from one launcher that imported the trainer once (tests/fork_launch.py), since process
start-ups (about 5 s of CPU per rank, 3 s per torchrun agent), not steps, were most of it; the
totals are in docs/parallelism.md."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed
from tests.launch import Launch, fork_train, read_metrics
from tests.test_export_hf import export_gap, export_tensors
from tests.test_train import DEFAULT

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


RUN = ["--validator.no-enable", "--metrics.no-enable-wandb", "--debug.deterministic"]


def _launch(name: str, nproc: int, model: list[str], *extra: str, steps=STEPS, **kw) -> Launch:
    """A training run of ``steps`` steps (``kw``: Launch's copy_from / remove)."""
    return Launch(name, nproc, [*model, "--training.steps", str(steps), *RUN, *extra], **kw)


def _seed_launch(model: list[str]) -> Launch:
    """One unsharded initialisation (``seed/checkpoint/step-0``) every run starts from."""
    args = [*model, "--checkpoint.enable", "--checkpoint.create_seed_checkpoint",
            "--metrics.no-enable-wandb"]  # fmt: skip
    return Launch("seed", 1, args)


def _run_all(tmp_path, launches: list[Launch]) -> None:
    """All launches from one process that imported the trainer once (tests/fork_launch.py):
    process start-ups, not steps, were most of these tests' CPU time."""
    print(fork_train(launches, folder=tmp_path))


def _rows(tmp_path, name: str, steps=STEPS) -> list[dict]:
    rows = read_metrics(tmp_path / name)
    assert [r["step"] for r in rows] == list(range(1, steps + 1)), name
    return rows


def _worst(ref: list[dict], run: list[dict]) -> float:
    return max(
        abs(a[key] - b[key]) / abs(a[key])
        for a, b in zip(ref, run, strict=True)
        for key in ("loss", "grad_norm")
    )


def _resume(source: str, name: str, nproc: int, model: list[str], *extra: str) -> Launch:
    """Run ``source``'s dump with its step-5 checkpoint only, resumed to step 10 under another
    layout (its rows of steps 6-10: ``_rows(...)[STEPS // 2:]``)."""
    return _launch(name, nproc, model, *extra, copy_from=source,
                   remove=(f"checkpoint/step-{STEPS}",))  # fmt: skip


def _export(tmp_path, name: str, step: int, model: list[str]) -> dict[str, torch.Tensor]:
    """Run ``name``'s step-``step`` DCP checkpoint (whatever its sharding) exported with
    scripts/export_hf.py: its HF tensors."""
    checkpoint = tmp_path / name / "checkpoint" / f"step-{step}"
    return export_tensors(checkpoint, tmp_path / f"{name}-hf", *model)


def test_tensor_parallel_parity_table(tmp_path):
    """The parity table of the hybrid model (dp1, tp2, cp2, cp2 x tp2), routing host against
    readback under cp2 x tp2, and DCP checkpoints across layouts: cp2 x tp2's step 5 resumed
    under cp2, and cp2's under cp2 x tp2, continue dp1's curve."""
    seed = str(tmp_path / "seed" / "checkpoint" / "step-0")
    common = ["--checkpoint.enable", "--checkpoint.initial_load_path", seed,
              "--checkpoint.interval", str(STEPS // 2)]  # fmt: skip
    tp = ["--parallelism.tensor_parallel_degree", "2"]
    cp = ["--parallelism.context_parallel_degree", "2"]
    layouts = {"tp2": (2, tp), "cp2": (2, cp), "cp2xtp2": (4, [*cp, *tp])}
    readback = ["--linear_attention.routing_source", "device_readback"]
    _run_all(tmp_path, [
        _seed_launch(HYBRID),
        _launch("dp1", 1, HYBRID, *common),
        *(_launch(name, n, HYBRID, *common, *extra) for name, (n, extra) in layouts.items()),
        _launch("cp2xtp2-readback", 4, HYBRID, *common, *cp, *tp, *readback),
        _resume(str(tmp_path / "cp2xtp2"), "cp2xtp2-to-cp2", 2, HYBRID, *common, *cp),
        _resume(str(tmp_path / "cp2"), "cp2-to-cp2xtp2", 4, HYBRID, *common, *cp, *tp),
    ])  # fmt: skip
    ref = _rows(tmp_path, "dp1")
    worst = {name: _worst(ref, _rows(tmp_path, name)) for name in layouts}
    for name in ("cp2xtp2-to-cp2", "cp2-to-cp2xtp2"):
        worst[name] = _worst(ref[STEPS // 2 :], _rows(tmp_path, name)[STEPS // 2 :])
    print("worst relative error against dp1:", worst)
    assert all(err <= REL for err in worst.values()), worst
    host = [(r["loss"], r["grad_norm"]) for r in _rows(tmp_path, "cp2xtp2")]
    assert host == [(r["loss"], r["grad_norm"]) for r in _rows(tmp_path, "cp2xtp2-readback")]


def test_qwen35_tensor_parallel_parity(tmp_path):
    """Qwen3.5's dense debug model (GatedDeltaNet and gated attention layers): tp2 and
    cp2 x tp2 give dp1's loss and grad norm within 1e-5 relative over 10 steps; host and
    readback routing train bit for bit the same under cp2 x tp2; a cp2 x tp2 checkpoint's HF
    export (scripts/export_hf.py) is bit for bit the unsharded export of the same weights."""
    seed = str(tmp_path / "seed" / "checkpoint" / "step-0")
    common = ["--checkpoint.enable", "--checkpoint.initial_load_path", seed]
    tp = ["--parallelism.tensor_parallel_degree", "2"]
    cp = ["--parallelism.context_parallel_degree", "2"]
    layouts = {"tp2": (2, tp), "cp2xtp2": (4, [*cp, *tp])}
    readback = ["--linear_attention.routing_source", "device_readback"]
    _run_all(tmp_path, [
        _seed_launch(QWEN35),
        _launch("dp1", 1, QWEN35, *common),
        *(_launch(name, n, QWEN35, *common, *extra) for name, (n, extra) in layouts.items()),
        _launch("cp2xtp2-readback", 4, QWEN35, *common, *cp, *tp, *readback),
        # HF export below: a cp2 x tp2 step (FSDP x TP 2-D parameters) run at learning rate 0
        _launch("cp2xtp2-lr0", 4, QWEN35, *common, *cp, *tp, *FROZEN, steps=1),
    ])  # fmt: skip
    ref = _rows(tmp_path, "dp1")
    worst = {name: _worst(ref, _rows(tmp_path, name)) for name in layouts}
    print("qwen3_5: worst relative error against dp1:", worst)
    assert all(err <= REL for err in worst.values()), worst
    host = [(r["loss"], r["grad_norm"]) for r in _rows(tmp_path, "cp2xtp2")]
    assert host == [(r["loss"], r["grad_norm"]) for r in _rows(tmp_path, "cp2xtp2-readback")]
    # HF export: the cp2 x tp2 step at learning rate 0 exports bit for bit as the unsharded
    # seed it holds. Trained runs are no bitwise reference: Adam turns last-bit gradient
    # differences into up to a step's size on parameters with tiny gradients (after 10 steps:
    # 7e-4 of A_log, docs/parallelism.md)
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
    seed = str(tmp_path / "seed" / "checkpoint" / "step-0")
    common = ["--checkpoint.enable", "--checkpoint.initial_load_path", seed]
    ep = ["--parallelism.expert_parallel_degree", "2"]
    cp = ["--parallelism.context_parallel_degree", "2"]
    _run_all(tmp_path, [
        _seed_launch(QWEN35_MOE),
        _launch("dp1", 1, QWEN35_MOE, *common, steps=2),
        _launch("fsdp2", 2, QWEN35_MOE, *common, steps=2),
        _launch("cp2xep2", 2, QWEN35_MOE, *common, *cp, *ep, steps=2),
        _launch("ep2", 2, QWEN35_MOE, *common, *ep, steps=2),
        # HF export below: an ep2 step (experts sharded over EP) run at learning rate 0
        _launch("ep2-lr0", 2, QWEN35_MOE, *common, *ep, *FROZEN, steps=1),
    ])  # fmt: skip
    dp1, fsdp2 = _rows(tmp_path, "dp1", 2), _rows(tmp_path, "fsdp2", 2)
    worst = {
        "cp2xep2": _worst(dp1, _rows(tmp_path, "cp2xep2", 2)),
        "ep2 (vs fsdp2)": _worst(fsdp2, _rows(tmp_path, "ep2", 2)),
    }
    print("qwen3_5 MoE: worst relative error:", worst)
    assert all(err <= REL for err in worst.values()), worst
    # HF export: the ep2 step at learning rate 0 exports bit for bit as the unsharded seed
    seed_hf = export_tensors(seed, tmp_path / "seed-hf", *QWEN35_MOE)
    assert export_gap(seed_hf, _export(tmp_path, "ep2-lr0", 1, QWEN35_MOE)) == (0.0, "")
