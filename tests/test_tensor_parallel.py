"""Tensor and expert parallelism, alone and composed with CP: the parity table (slow;
docs/parallelism.md has the numbers).

The model: the float64 hybrid debug model with one layer of each kind (``KGMRA``; Mamba2 with
4 heads in 2 B/C groups, so each TP rank holds a group of 2 heads) under tp2 and cp2 x tp2
equals the unsharded model (loss and gradients, 1e-10). The trainer: every run starts
from one seed checkpoint, float32 on gloo, 10 AdamW steps. Hybrid: fsdp2, tp2, cp2 and
cp2 x tp2 give dp1's loss and grad norm within 1e-5 relative, host and device-readback routing
train bit for bit the same under cp2 x tp2 (one routing per CP rank, shared by its TP ranks),
and a DCP checkpoint of one layout resumes under the other. Qwen3.5 dense: fsdp2, cp2, tp2 and
cp2 x tp2 against dp1, routing bitwise, and the HF export of a cp2 x tp2 checkpoint bitwise
equal to the unsharded export of the same weights. Qwen3.5 MoE: fsdp2, cp2, tp2, cp2 x tp2,
ep2, cp2 x ep2 and tp2 x ep2 against dp1 over 5 steps (1e-5 through step 2, after which its
routes start to flip; see MOE_EXACT_STEPS), the HF export of an ep2 and of a cp2 x tp2
checkpoint bitwise equal to the unsharded one. fsdp2 runs read a corpus made so that two
data-parallel ranks see dp1's global batches (``_fsdp_data``). Cost: each test's
runs are forked from one launcher that imported the trainer once (tests/fork_launch.py), since
process start-ups (about 5 s of CPU per rank, 3 s per torchrun agent), not steps, were most of
it; the totals are in docs/parallelism.md."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed
from tests.helpers import row_aligned_corpus
from tests.launch import Launch, fork_train, read_metrics
from tests.test_export_hf import export_gap, export_tensors
from tests.test_train import DEFAULT

pytestmark = pytest.mark.slow

PATTERN = "KGMRA"
# Mamba2 sizes at dim 64: 4 heads of 32 channels in 2 B/C groups (TP 2 holds one group of 2
# heads per rank), state 32 (the reference's 128 would only cost CPU here).
MAMBA2 = {"head_dim": 32, "state_dim": 32, "n_groups": 2}
HYBRID = [
    *DEFAULT,
    "--model.layer_pattern",
    PATTERN,
    *(a for k, v in MAMBA2.items() for a in (f"--model.layer_options.mamba2.{k}", str(v))),
]
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
    from torchtitan_cp.models.hybrid.layers import LayerOptions
    from torchtitan_cp.models.hybrid.parallelize import apply_tensor_parallel
    from torchtitan_cp.models.mixers.mamba2 import Mamba2Options
    from torchtitan_cp.models.sequence import SequencePreprocessor

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("cp", "tp"))
    torch.manual_seed(0)
    options = LayerOptions(mamba2=Mamba2Options(**MAMBA2))
    with torch.device("cpu"):
        model = model_config(
            "debug", layer_pattern=pattern, vocab_size=97, layer_options=options
        ).build()
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
    """Every registered kind (``LAYERS``: K, G, P, A, M, R) in one model, float64: loss and
    gradients under tp2 and cp2 x tp2 equal the unsharded model's to 1e-10."""
    from torchtitan_cp.models.hybrid.layers import LAYERS

    for per_layout in run_distributed(_tp_model, 4, "".join(LAYERS)):
        for layout, worst in per_layout.items():
            bad = {k: v for k, v in worst.items() if v > 1e-10}
            assert not bad, (layout, bad)


RUN = ["--validator.no-enable", "--metrics.no-enable-wandb", "--debug.deterministic"]


def _launch(name: str, nproc: int, model: list[str], *extra: str, steps=STEPS, **kw) -> Launch:
    """A training run of ``steps`` steps (``kw``: Launch's copy_from / remove)."""
    return Launch(name, nproc, [*model, "--training.steps", str(steps), *RUN, *extra], **kw)


def _seed_launch(model: list[str]) -> Launch:
    """One unsharded initialisation (``seed/checkpoint/step-0``) every run starts from."""
    args = [
        *model,
        "--checkpoint.enable",
        "--checkpoint.create_seed_checkpoint",
        "--metrics.no-enable-wandb",
    ]
    return Launch("seed", 1, args)


def _run_all(tmp_path, launches: list[Launch]) -> None:
    """All launches from one process that imported the trainer once (tests/fork_launch.py):
    process start-ups, not steps, were most of these tests' CPU time."""
    print(fork_train(launches, folder=tmp_path))


def _rows(tmp_path, name: str, steps=STEPS) -> list[dict]:
    rows = read_metrics(tmp_path / name)
    assert [r["step"] for r in rows] == list(range(1, steps + 1)), name
    return rows


def _per_step(ref: list[dict], run: list[dict]) -> list[float]:
    """Per step, the larger relative error of the loss and the grad norm."""
    return [
        max(abs(a[key] - b[key]) / abs(a[key]) for key in ("loss", "grad_norm"))
        for a, b in zip(ref, run, strict=True)
    ]


def _worst(ref: list[dict], run: list[dict]) -> float:
    return max(_per_step(ref, run))


def _fsdp_data(tmp_path) -> tuple[list[str], list[str]]:
    """The data of the fsdp2 rows: the command-line flags of one rank reading two rows a step
    (the reference ``dp1-aligned``) and of two data-parallel ranks reading one row each, each
    rank its own rows, the same global batch (tests/helpers.row_aligned_corpus). The bundled
    corpus gives every data-parallel rank a contiguous share of the documents, so fsdp2's
    global batch there is not dp1's."""
    split, interleaved = tmp_path / "split.jsonl", tmp_path / "interleaved.jsonl"
    row_aligned_corpus(split, interleaved, seq_len=256, rows=STEPS)
    flags = ["--dataloader.dataset", "jsonl", "--dataloader.dataset_path"]
    return [*flags, str(interleaved)], [*flags, str(split), "--training.local_batch_size", "1"]


def _resume(source: str, name: str, nproc: int, model: list[str], *extra: str) -> Launch:
    """Run ``source``'s dump with its step-5 checkpoint only, resumed to step 10 under another
    layout (its rows of steps 6-10: ``_rows(...)[STEPS // 2:]``)."""
    return _launch(
        name, nproc, model, *extra, copy_from=source, remove=(f"checkpoint/step-{STEPS}",)
    )


def _export(tmp_path, name: str, step: int, model: list[str]) -> dict[str, torch.Tensor]:
    """Run ``name``'s step-``step`` DCP checkpoint (whatever its sharding) exported with
    scripts/export_hf.py: its HF tensors."""
    checkpoint = tmp_path / name / "checkpoint" / f"step-{step}"
    return export_tensors(checkpoint, tmp_path / f"{name}-hf", *model)


TP = ["--parallelism.tensor_parallel_degree", "2"]
CP = ["--parallelism.context_parallel_degree", "2"]
READBACK = ["--linear_attention.routing_source", "device_readback"]


def _layout_table(tmp_path, model, common, layouts, *extra: Launch) -> dict[str, float]:
    """Run the seed, dp1, each of ``layouts`` (name -> ranks, flags), cp2 x tp2 with readback
    routing, fsdp2 on dp1's global batches (against its ``dp1-aligned`` run), then ``extra``,
    all from one launcher. Checks host and readback routing bitwise; returns every layout's
    and fsdp2's worst relative error against dp1."""
    one_rank, two_ranks = _fsdp_data(tmp_path)
    _run_all(tmp_path, [
        _seed_launch(model),
        _launch("dp1", 1, model, *common),
        *(_launch(name, n, model, *common, *flags) for name, (n, flags) in layouts.items()),
        _launch("cp2xtp2-readback", 4, model, *common, *CP, *TP, *READBACK),
        _launch("dp1-aligned", 1, model, *common, *one_rank),
        _launch("fsdp2", 2, model, *common, *two_ranks),
        *extra,
    ])  # fmt: skip # a table, laid out by hand to read across
    host = [(r["loss"], r["grad_norm"]) for r in _rows(tmp_path, "cp2xtp2")]
    assert host == [(r["loss"], r["grad_norm"]) for r in _rows(tmp_path, "cp2xtp2-readback")]
    ref = _rows(tmp_path, "dp1")
    worst = {name: _worst(ref, _rows(tmp_path, name)) for name in layouts}
    worst["fsdp2"] = _worst(_rows(tmp_path, "dp1-aligned"), _rows(tmp_path, "fsdp2"))
    return worst


def test_tensor_parallel_parity_table(tmp_path):
    """The parity table of the hybrid model (dp1, fsdp2, tp2, cp2, cp2 x tp2), routing host
    against readback under cp2 x tp2, and DCP checkpoints across layouts: cp2 x tp2's step 5
    resumed under cp2, and cp2's under cp2 x tp2, continue dp1's curve."""
    seed = str(tmp_path / "seed" / "checkpoint" / "step-0")
    common = [
        "--checkpoint.enable",
        "--checkpoint.initial_load_path",
        seed,
        "--checkpoint.interval",
        str(STEPS // 2),
    ]
    layouts = {"tp2": (2, TP), "cp2": (2, CP), "cp2xtp2": (4, [*CP, *TP])}
    worst = _layout_table(
        tmp_path,
        HYBRID,
        common,
        layouts,
        _resume(str(tmp_path / "cp2xtp2"), "cp2xtp2-to-cp2", 2, HYBRID, *common, *CP),
        _resume(str(tmp_path / "cp2"), "cp2-to-cp2xtp2", 4, HYBRID, *common, *CP, *TP),
    )
    ref = _rows(tmp_path, "dp1")
    for name in ("cp2xtp2-to-cp2", "cp2-to-cp2xtp2"):
        worst[name] = _worst(ref[STEPS // 2 :], _rows(tmp_path, name)[STEPS // 2 :])
    print("worst relative error against dp1:", worst)
    assert all(err <= REL for err in worst.values()), worst


def test_qwen35_tensor_parallel_parity(tmp_path):
    """Qwen3.5's dense debug model (GatedDeltaNet and gated attention layers): fsdp2, cp2, tp2
    and cp2 x tp2 give dp1's loss and grad norm within 1e-5 relative over 10 steps; host and
    readback routing train bit for bit the same under cp2 x tp2; a cp2 x tp2 checkpoint's HF
    export (scripts/export_hf.py) is bit for bit the unsharded export of the same weights."""
    seed = str(tmp_path / "seed" / "checkpoint" / "step-0")
    common = ["--checkpoint.enable", "--checkpoint.initial_load_path", seed]
    layouts = {"cp2": (2, CP), "tp2": (2, TP), "cp2xtp2": (4, [*CP, *TP])}
    # HF export below: a cp2 x tp2 step (FSDP x TP 2-D parameters) run at learning rate 0
    frozen = _launch("cp2xtp2-lr0", 4, QWEN35, *common, *CP, *TP, *FROZEN, steps=1)
    worst = _layout_table(tmp_path, QWEN35, common, layouts, frozen)
    print("qwen3_5: worst relative error against dp1:", worst)
    assert all(err <= REL for err in worst.values()), worst
    # HF export: the cp2 x tp2 step at learning rate 0 exports bit for bit as the unsharded
    # seed it holds. Trained runs are no bitwise reference: Adam turns last-bit gradient
    # differences into up to a step's size on parameters with tiny gradients (after 10 steps:
    # 7e-4 of A_log, docs/parallelism.md)
    seed_hf = export_tensors(seed, tmp_path / "seed-hf", *QWEN35)
    assert export_gap(seed_hf, _export(tmp_path, "cp2xtp2-lr0", 1, QWEN35)) == (0.0, "")


# The MoE model's curves part after a few steps under any change of sharding, plain FSDP on the
# same global batches included (measured over 10 steps with torchtitan's load-balancing hook
# moving the expert bias: up to 3.1e-7 relative through step 2, 1.2e-5 at step 3, 4.5e-3 by
# step 10; docs/parallelism.md): last-bit differences of the reductions flip near-tied top-k
# routes, and Adam amplifies them. Every row holds 1e-5 through MOE_EXACT_STEPS (the sharded
# gradients and the first optimizer step and bias update); the later steps stay within
# MOE_LATE, a guard against a run that goes wrong later (a wrong gradient parts by far more at
# step 1).
MOE_EXACT_STEPS = 2
MOE_LATE = 1e-2
# Steps of the MoE rows: the exact ones and three for the guard (a run that goes wrong parts by
# far more than MOE_LATE within a step or two; 10 steps cost 30 % more of this test's CPU)
MOE_STEPS = 5


def test_qwen35_moe_parallel_parity(tmp_path):
    """Qwen3.5's debugmodel_moe through torchtitan's MoE modules, its TP sharding and its
    all-to-all dispatcher, MOE_STEPS steps: cp2, tp2 (each expert's hidden units split), cp2 x tp2,
    cp2 x ep2 (EP borrowed from CP) and tp2 x ep2 (EP borrowed from TP, the tokens
    sequence-sharded) against dp1, fsdp2 and ep2 (EP borrowed from FSDP) against dp1 on the
    same global batches, ep2 against fsdp2; the HF export of an ep2 and of a cp2 x tp2
    checkpoint (experts FSDP x TP 2-D) is bit for bit the unsharded export of the same
    weights."""
    seed = str(tmp_path / "seed" / "checkpoint" / "step-0")
    common = ["--checkpoint.enable", "--checkpoint.initial_load_path", seed]
    ep = ["--parallelism.expert_parallel_degree", "2"]
    one_rank, two_ranks = _fsdp_data(tmp_path)
    _run_all(tmp_path, [
        _seed_launch(QWEN35_MOE),
        _launch("dp1", 1, QWEN35_MOE, *common, steps=MOE_STEPS),
        _launch("cp2", 2, QWEN35_MOE, *common, *CP, steps=MOE_STEPS),
        _launch("tp2", 2, QWEN35_MOE, *common, *TP, steps=MOE_STEPS),
        _launch("cp2xtp2", 4, QWEN35_MOE, *common, *CP, *TP, steps=MOE_STEPS),
        _launch("cp2xep2", 2, QWEN35_MOE, *common, *CP, *ep, steps=MOE_STEPS),
        _launch("tp2xep2", 2, QWEN35_MOE, *common, *TP, *ep, steps=MOE_STEPS),
        _launch("dp1-aligned", 1, QWEN35_MOE, *common, *one_rank, steps=MOE_STEPS),
        _launch("fsdp2", 2, QWEN35_MOE, *common, *two_ranks, steps=MOE_STEPS),
        _launch("ep2", 2, QWEN35_MOE, *common, *ep, *two_ranks, steps=MOE_STEPS),
        # HF export below: an ep2 step (experts sharded over EP) and a cp2 x tp2 step (experts
        # FSDP x TP) run at learning rate 0
        _launch("ep2-lr0", 2, QWEN35_MOE, *common, *ep, *FROZEN, steps=1),
        _launch("cp2xtp2-lr0", 4, QWEN35_MOE, *common, *CP, *TP, *FROZEN, steps=1),
    ])  # fmt: skip # a table, laid out by hand to read across
    dp1, aligned, fsdp2 = (_rows(tmp_path, n, MOE_STEPS) for n in ("dp1", "dp1-aligned", "fsdp2"))
    per_step = {
        name: _per_step(dp1, _rows(tmp_path, name, MOE_STEPS))
        for name in ("cp2", "tp2", "cp2xtp2", "cp2xep2", "tp2xep2")
    }
    per_step |= {
        "fsdp2": _per_step(aligned, fsdp2),
        "ep2": _per_step(aligned, _rows(tmp_path, "ep2", MOE_STEPS)),
        "ep2 (vs fsdp2)": _per_step(fsdp2, _rows(tmp_path, "ep2", MOE_STEPS)),
    }
    print(
        "qwen3_5 MoE: relative error per step:",
        {k: [f"{e:.1e}" for e in v] for k, v in per_step.items()},
    )
    exact = {k: max(v[:MOE_EXACT_STEPS]) for k, v in per_step.items()}
    late = {k: max(v[MOE_EXACT_STEPS:]) for k, v in per_step.items()}
    assert all(err <= REL for err in exact.values()), exact
    assert all(err <= MOE_LATE for err in late.values()), late
    # HF export: the ep2 and cp2 x tp2 steps at learning rate 0 export bit for bit as the
    # unsharded seed
    seed_hf = export_tensors(seed, tmp_path / "seed-hf", *QWEN35_MOE)
    for name in ("ep2-lr0", "cp2xtp2-lr0"):
        assert export_gap(seed_hf, _export(tmp_path, name, 1, QWEN35_MOE)) == (0.0, ""), name
