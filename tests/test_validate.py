"""Validation before launching: every bad value or file is one line naming the key and the fix,
exit status 2, no traceback, and no process started (``train --check``, which
``./scripts/train.sh`` runs before torchrun, and the same check inside the trainer)."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time

import pytest
import torch

from tests.launch import REPO, torchrun_cmd
from torchtitan_cp.data import jsonl
from torchtitan_cp.train import main

ON_CUDA = torch.cuda.is_available()


def check(capsys, *args: str, nproc: str = "2") -> tuple[int, str, str]:
    """``python -m torchtitan_cp.train --check --nproc N ARGS`` in this process."""
    code = main(["--check", "--nproc", nproc, *args])
    out, err = capsys.readouterr()
    return code, out, err


def jsonl_data(path, loader: str = "dataloader") -> list[str]:
    """The arguments that make ``loader`` (``dataloader``, ``validator.dataloader``) read the
    jsonl file ``path``."""
    return [f"--{loader}.dataset", "jsonl", f"--{loader}.dataset_path", str(path)]


def assert_one_line(code: int, err: str, *needles: str) -> None:
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("torchtitan_cp.train: error: "), err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in err, (needle, err)


def test_default_config_passes_and_prints_the_process_count(capsys, tmp_path):
    code, out, err = check(capsys, "--dump_folder", str(tmp_path / "run"), nproc="2")
    assert (code, out, err) == (0, "2\n", "[mesh] dp_shard 2 (2 processes)\n")
    assert not (tmp_path / "run").exists(), "the check creates nothing"
    code, out, _ = check(capsys, "--dump_folder", str(tmp_path), nproc="auto")
    assert code == 0 and int(out) == (torch.cuda.device_count() if ON_CUDA else 2)


def test_check_reports_the_mesh(capsys, tmp_path):
    """``--check`` names the mesh torchtitan will build (stderr; stdout stays the count)."""
    args = [
        "--parallelism.context_parallel_degree",
        "2",
        "--parallelism.tensor_parallel_degree",
        "2",
        "--dump_folder",
        str(tmp_path),
    ]
    code, out, err = check(capsys, *args, nproc="4")
    assert (code, out, err) == (0, "4\n", "[mesh] cp 2 x tp 2 (4 processes)\n")
    code, out, err = check(capsys, *args, "--nnodes", "2", nproc="4")
    assert (code, err) == (0, "[mesh] dp_shard 2 x cp 2 x tp 2 (8 processes)\n")


def test_qwen35_moe_under_tp_and_ep_x_tp_passes_the_check(capsys, tmp_path):
    """Qwen3.5's MoE flavor runs under TP (each expert's hidden units split) and EP x TP
    (torchtitan's EP borrows the TP ranks); ``--check`` names the mesh."""
    args = [
        "--config_file",
        "configs/qwen35_debug_cpu.toml",
        "--model.flavor",
        "debugmodel_moe",
        "--parallelism.tensor_parallel_degree",
        "2",
        "--dump_folder",
        str(tmp_path),
    ]
    assert check(capsys, *args) == (0, "2\n", "[mesh] tp 2 (2 processes)\n")
    code, out, err = check(capsys, *args, "--parallelism.expert_parallel_degree", "2")
    assert (code, err) == (0, "[mesh] tp 2, ep 2 (inside dp_shard x cp x tp) (2 processes)\n")


# Each row: the flags, the process count, and what the line must say (the key and the fix).
PP_MB1 = ["--parallelism.pipeline_parallel_microbatch_size", "1"]
BAD_VALUES = [
    (["--training.steps", "-3"], "2", ["training.steps must be >= 0, got -3"]),
    (["--optimizer.param_groups.0.optimizer_kwargs.lr", "-0.001"], "2",
     ["optimizer.param_groups.0.optimizer_kwargs.lr must be >= 0"]),
    (["--training.seq_len", "0"], "2", ["training.seq_len must be >= 1"]),
    (["--training.seq_len", "100"], "2", ["loss.num_chunks (8)", "use seq_len 96 or 104"]),
    (["--training.seq_len", "66", "--parallelism.context_parallel_degree", "2"], "2",
     ["training.seq_len (66) must be divisible by 2 x context_parallel_degree (2)", "64 or 68"]),
    (["--training.seq_len", "128", "--parallelism.context_parallel_degree", "2",
      "--parallelism.context_parallel_load_balancer", "ptrr"], "2",
     ["ptrr_block_size x context_parallel_degree (128 x 2)", "use 256"]),
    (["--parallelism.context_parallel_load_balancer", "zigzag"], "2",
     ["context_parallel_load_balancer must be one of"]),
    (["--training.local_batch_size", "0"], "2", ["training.local_batch_size must be >= 1"]),
    (["--compile.enable", "--compile.backend", "nosuch"], "2",
     ["compile.backend 'nosuch' is not a torch.compile backend"]),
    (["--training.global_batch_size", "3"], "2",
     ["training.global_batch_size (3) must be a positive multiple of", "(2 x 2 = 4)"]),
    (["--parallelism.context_parallel_degree", "4"], "2",
     ["context_parallel_degree (4)", "does not divide the 2 processes"]),
    (["--parallelism.data_parallel_shard_degree", "3"], "2",
     ["data_parallel_shard_degree (3)", "but 2 processes run"]),
    # issue 22: the mesh (TP heads, TP x CP inside a node, EP, PP) before any rank starts
    (["--parallelism.tensor_parallel_degree", "4"], "4",
     ["tensor_parallel_degree = 4 does not divide model.n_heads = 2 (layer K", "[1, 2]"]),
    # Mamba2: TP holds whole B/C groups (Megatron-Core's rule); the default has one group
    (["--model.layer_pattern", "KMA", "--parallelism.tensor_parallel_degree", "2"], "2",
     ["tensor_parallel_degree = 2 does not divide model.layer_options.mamba2.n_groups = 1 "
      "(layer M, Mamba2", "whole B/C groups", "use a degree in [1]"]),
    # 8 heads in 2 groups: TP 4 divides the heads, not the groups
    (["--model.layer_pattern", "M", "--model.layer_options.mamba2.head_dim", "16",
      "--model.layer_options.mamba2.n_groups", "2", "--parallelism.tensor_parallel_degree",
      "4"], "4",
     ["tensor_parallel_degree = 4 does not divide model.layer_options.mamba2.n_groups = 2 "
      "(layer M", "[1, 2]"]),
    (["--parallelism.tensor_parallel_degree", "2", "--parallelism.context_parallel_degree", "2",
      "--nnodes", "2"], "2",
     ["tensor_parallel_degree (2) x context_parallel_degree (2) = 4 ranks do not fit inside "
      "a node of 2 processes"]),
    (["--parallelism.tensor_parallel_degree", "2", "--training.seq_len", "255"], "2",
     ["training.seq_len (255) must be divisible by context_parallel_degree x "
      "tensor_parallel_degree (1 x 2)"]),
    (["--parallelism.tensor_parallel_degree", "2", "--model.enable_weight_tying", "True"], "2",
     ["model.enable_weight_tying cannot be combined with parallelism.tensor_parallel_degree"]),
    (["--parallelism.tensor_parallel_degree", "2"], "3",
     ["tensor_parallel_degree (2)", "does not divide the 3 processes"]),
    (["--parallelism.expert_parallel_degree", "2"], "2",
     ["expert_parallel_degree = 2: the hybrid decoder has no experts"]),
    (["--config_file", "configs/qwen35_debug_cpu.toml", "--model.flavor", "debugmodel_moe",
      "--parallelism.expert_parallel_degree", "3"], "3",
     ["expert_parallel_degree = 3 does not divide the 8 experts of qwen3_5", "[1, 2, 4, 8]"]),
    (["--config_file", "configs/qwen35_debug_cpu.toml", "--model.flavor", "debugmodel_moe",
      "--parallelism.expert_parallel_degree", "4"], "2",
     ["expert_parallel_degree (4) must divide data_parallel_shard_degree x "
      "context_parallel_degree x tensor_parallel_degree (2 x 1 x 1)"]),
    (["--config_file", "configs/qwen35_debug_cpu.toml", "--model.flavor", "debugmodel_moe",
      "--parallelism.tensor_parallel_degree", "2", "--parallelism.expert_parallel_degree", "4"],
     "2", ["expert_parallel_degree (4) must divide data_parallel_shard_degree x "
           "context_parallel_degree x tensor_parallel_degree (1 x 1 x 2)"]),
    (["--config_file", "configs/qwen35_debug_cpu.toml", "--parallelism.expert_parallel_degree",
      "2"], "2", ["expert_parallel_degree = 2: this qwen3_5 flavor has no experts"]),
    # issue 37: pipeline parallelism (the hybrid decoder; KGKA, 2 rows a step)
    (["--config_file", "configs/qwen35_debug_cpu.toml", "--parallelism.pipeline_parallel_degree",
      "2", *PP_MB1, "--parallelism.pipeline_parallel_split", "GG|AG"], "2",
     ["pipeline_parallel_split 'GG|AG' must be the qwen3_5 layers (G: GatedDeltaNet, A: "
      "attention; model.n_layers keeps the first) 'GGGA' with '|'"]),
    (["--config_file", "configs/qwen35_debug_cpu.toml", "--model.vision",
      "--parallelism.pipeline_parallel_degree", "2", *PP_MB1], "2",
     ["model.vision = true cannot run under pipeline parallelism"]),
    (["--parallelism.pipeline_parallel_degree", "2", "--training.local_batch_size", "1"], "2",
     ["pipeline_parallel_schedule = '1F1B' cannot run this pipeline", "1 microbatches of 1 rows",
      "at least as many microbatches as stages (2)"]),
    (["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size",
      "3"], "2", ["training.local_batch_size (2) must be evenly divisible by "
                  "parallelism.pipeline_parallel_microbatch_size (3)"]),
    (["--parallelism.pipeline_parallel_degree", "2", *PP_MB1, "--parallelism.pipeline_parallel_split",
      "K|GK|A"], "2", ["pipeline_parallel_split 'K|GK|A' places 3 stages, which "
                       "pipeline_parallel_degree 2 does not divide"]),
    (["--parallelism.pipeline_parallel_degree", "2", *PP_MB1, "--parallelism.pipeline_parallel_split",
      "KG|AK"], "2", ["pipeline_parallel_split 'KG|AK' must be model.layer_pattern 'KGKA' with '|'"]),
    (["--parallelism.pipeline_parallel_degree", "2", *PP_MB1, "--parallelism.pipeline_parallel_split",
      "KG|KA", "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"], "2",
     ["schedule = 'Interleaved1F1B' cannot run this pipeline", "two or more stages per rank, and 2 "
      "stages on 2 ranks are 1 per rank"]),
    (["--parallelism.pipeline_parallel_degree", "2", *PP_MB1, "--parallelism.pipeline_parallel_schedule",
      "ZBVZeroBubble", "--model.layer_pattern", "KGA"], "2",
     ["4 pipeline stages for 3 layers (model.layer_pattern 'KGA')", "exactly two stages per rank "
      "with ZBVZeroBubble"]),
    (["--parallelism.pipeline_parallel_degree", "2", *PP_MB1, "--parallelism.pipeline_parallel_schedule",
      "Zigzag"], "2", ["parallelism.pipeline_parallel_schedule: Unknown schedule name 'Zigzag'"]),
    (["--parallelism.pipeline_parallel_degree", "2", *PP_MB1, "--parallelism.pipeline_parallel_schedule",
      "ZBVZeroBubble", "--parallelism.pipeline_parallel_split", "K|G|K|A"], "4",
     ["schedule = 'ZBVZeroBubble' with FSDP (data_parallel_shard_degree x context_parallel_degree "
      "= 2 x 1)"]),
    (["--parallelism.pipeline_parallel_split", "KG|KA"], "2",
     ["pipeline_parallel_split 'KG|KA' places pipeline stages, but pipeline_parallel_degree is 1"]),
    (["--validator.freq", "0"], "2", ["validator.freq must be >= 1", "--validator.no-enable"]),
    (["--validator.steps", "0"], "2", ["[validator] validation steps must be positive or -1"]),
    (["--metrics.log_freq", "0"], "2", ["metrics.log_freq must be >= 1"]),
    (["--training.gc_freq", "0"], "2", ["training.gc_freq must be >= 1"]),
    (["--lr_scheduler.warmup_steps", "-1"], "2", ["lr_scheduler.warmup_steps must be >= 0"]),
    (["--lr_scheduler.min_lr_factor", "2"], "2", ["lr_scheduler.min_lr_factor must be in [0, 1]"]),
    (["--training.seq_len", "262144"], "2", ["exceeds the model's max_seq_len"]),
    (["--model.vocab_size", "100"], "2",
     ["model.vocab_size (100) is smaller than the tokenizer's 4096", "--model.vocab_size 4096"]),
    ([], "0", ["NPROC must be a whole number >= 1", "'0'"]),
    ([], "two", ["NPROC must be a whole number >= 1", "'two'"]),
    (["--training.stepz", "3"], "2",
     ["command line: Unrecognized options: --training.stepz", "did you mean --training.steps?"]),
    (["--training.steps", "three"], "2", ["Error parsing --training.steps", "'three'"]),
    (["--linear_attention.plan_cache_size", "0"], "2", ["plan_cache_size must be >= 1"]),
    (["--checkpoint.enable", "--checkpoint.interval", "0"], "2", ["interval"]),
    (["--dataloader.dataset", "c5"], "2", ["dataloader.dataset 'c5' is unknown", "bundled"]),
    (["--dataloader.dataset", "jsonl"], "2", ["'jsonl' needs dataloader.dataset_path"]),
    (["--hf_assets_path", "/nonexistent/tok"], "2", ["hf_assets_path /nonexistent/tok: no such"]),
    (["--checkpoint.enable", "--checkpoint.initial_load_path", "/nonexistent/step-0"], "2",
     ["checkpoint.initial_load_path /nonexistent/step-0: no such"]),
    # issue 15: values that passed the check and then failed (or were ignored) inside the run
    (["--optimizer.param_groups.0.optimizer_kwargs.lr", "inf"], "2",
     ["optimizer.param_groups.0.optimizer_kwargs.lr must be a finite number, got inf"]),
    (["--optimizer.param_groups.0.optimizer_kwargs.eps", "nan"], "2",
     ["optimizer.param_groups.0.optimizer_kwargs.eps must be a finite number, got nan"]),
    (["--spike_guard.factor", "inf"], "2", ["spike_guard.factor must be 0 (off) or a finite"]),
    (["--checkpoint.enable", "--checkpoint.load_step", "-5"], "2",
     ["checkpoint.load_step must be -1 (the newest step) or a step number >= 0, got -5"]),
    (["--checkpoint.initial_load_path", "/tmp"], "2",
     ["checkpoint.initial_load_path = /tmp is ignored without checkpointing",
      "add --checkpoint.enable"]),
    (["--checkpoint.enable", "--checkpoint.create_seed_checkpoint"], "2",
     ["checkpoint.create_seed_checkpoint needs --checkpoint.enable and one process (NPROC=1), "
      "got 2 process(es)"]),
    (["--training.seq_len", "1000000000", "--model.max_seq_len", "1000000000"], "2",
     ["one row of training.seq_len = 1000000000 tokens needs over 64 passes over "
      "data-parallel rank 0's", "use a shorter training.seq_len"]),
    (["configs/debug_cpu.toml"], "2",
     ["unexpected argument 'configs/debug_cpu.toml'", "--config_file configs/debug_cpu.toml"]),
    (["--config_file", "configs"], "2", ["config file configs is a folder"]),
]  # fmt: skip # a table, laid out by hand to read across
if not ON_CUDA:
    BAD_VALUES += [
        (["--linear_attention.backend", "fla"], "2",
         ["linear_attention.backend = 'fla' needs CUDA", "use 'torch' or 'auto'"]),
        (["--model.attention_backend", "flex"], "2", ["attention_backend = 'flex' cannot train"]),
    ]  # fmt: skip # a table, laid out by hand to read across


@pytest.mark.parametrize(
    "args, nproc, needles", BAD_VALUES, ids=[" ".join(r[0]) or f"NPROC={r[1]}" for r in BAD_VALUES]
)
def test_bad_value_is_one_line_naming_the_key(
    capsys, tmp_path, args, nproc, needles, interpreter_off
):
    code, out, err = check(capsys, "--dump_folder", str(tmp_path), *args, nproc=nproc)
    assert out == ""
    assert_one_line(code, err, *needles)


DEGREES = (
    "tensor_parallel_degree",
    "context_parallel_degree",
    "expert_parallel_degree",
    "data_parallel_replicate_degree",
    "pipeline_parallel_degree",
    "data_parallel_shard_degree",
)


@pytest.mark.parametrize(
    "config, degree",
    [("configs/debug_cpu.toml", d) for d in DEGREES]
    + [
        (c, d)
        for c in (
            "configs/debug_mamba2_cpu.toml",
            "configs/qwen35_debug_cpu.toml",
            "configs/kimi_linear_debug_cpu.toml",
        )
        for d in ("tensor_parallel_degree", "expert_parallel_degree")
    ],
)
def test_a_degree_of_zero_is_refused_as_every_bad_degree(capsys, tmp_path, config, degree):
    """Every parallelism degree 0 (and the degrees the model checks use, on every model):
    one line naming the key. Before, the
    hybrid decoder's head-count check ran before the ``>= 1`` check and divided by it:
    ``--parallelism.tensor_parallel_degree 0`` was a 16-line ZeroDivisionError, exit 1."""
    code, out, err = check(
        capsys,
        "--config_file",
        config,
        "--dump_folder",
        str(tmp_path),
        f"--parallelism.{degree}",
        "0",
    )
    bound = "-1 (the rest of the processes) or >= 1" if "shard" in degree else ">= 1"
    assert_one_line(code, err, f"parallelism.{degree} must be {bound}, got 0")


@pytest.mark.skipif(ON_CUDA, reason="on CUDA 'fla' is the normal backend")
def test_fla_on_cpu_passes_only_under_the_interpreter(capsys, tmp_path, monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # what the fla_interpreter tier's ranks run with
    code, out, err = check(
        capsys, "--dump_folder", str(tmp_path), "--linear_attention.backend", "fla"
    )
    assert (code, out.strip()) == (0, "2"), err


def test_unwritable_dump_folder(capsys, tmp_path):
    (tmp_path / "file").write_text("x")
    code, _, err = check(capsys, "--dump_folder", str(tmp_path / "file" / "run"))
    assert_one_line(code, err, f"dump_folder {tmp_path}/file/run", "is a file, not a folder")
    probe = "/sys/torchtitan-cp-run"  # /sys is a read-only mount, also for root
    if os.path.isdir("/sys") and _read_only("/sys"):
        code, _, err = check(capsys, "--dump_folder", probe)
        assert_one_line(code, err, f"dump_folder {probe}: not writable (its parent /sys")


def _read_only(folder: str) -> bool:
    try:
        with tempfile.TemporaryFile(dir=folder):
            return False
    except OSError:
        return True


def _unwritable_file(tmp_path) -> str | None:
    """A file this process cannot append to: a 0444 file, or for root (who writes 0444 files) a
    read-only sysfs attribute; None when there is none."""
    if os.geteuid() != 0:
        path = tmp_path / "ro.txt"
        path.write_text("")
        path.chmod(0o444)
        return str(path)
    for path in ("/sys/kernel/uevent_seqnum", "/proc/version"):
        try:
            with open(path, "a"):
                pass
        except OSError:
            return path
    return None


def test_read_only_metrics_jsonl_is_caught_before_launch(capsys, tmp_path):
    """Before: it passed the check and the run died at its first log line with an OSError."""
    target = _unwritable_file(tmp_path)
    if target is None:
        pytest.skip("no file this process cannot write")
    (tmp_path / "metrics.jsonl").symlink_to(target)
    code, _, err = check(capsys, "--dump_folder", str(tmp_path))
    assert_one_line(code, err, f"metrics.jsonl_file {tmp_path}/metrics.jsonl: cannot be appended")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_read_only_checkpoint_folder(capsys, tmp_path):
    ckpt = tmp_path / "checkpoint"
    ckpt.mkdir()
    ckpt.chmod(0o555)
    try:
        code, _, err = check(capsys, "--dump_folder", str(tmp_path), "--checkpoint.enable")
    finally:
        ckpt.chmod(0o755)
    assert_one_line(code, err, "checkpoint.folder", "not writable")


# ------------------------------------------------------------------------ data files

# Each row: file bytes, and the "path:line: problem" the check and the loader both report.
BAD_FILES = [
    (b"", ": empty file: no documents"),
    (b'{"text": "a"}\n{"text": "b"\n', ':2: malformed JSON: Expecting \',\' delimiter'),
    (b'{"text": "a"}\n{"body": "b"}\n', ':2: no "text" key (keys: body)'),
    (b'{"text": "a"}\n{"text": null}\n', ':2: "text" is null, expected a string'),
    (b'{"text": "a"}\n{"text": 5}\n', ':2: "text" is int, expected a string'),
    (b'{"text": "a"}\n{"text": "caf\xe9"}\n', ":2: not UTF-8 (byte 14 of the line)"),
    (b'{"text": "a"}\n\n{"text": "b"}\n', ":2: blank line"),
    (b'{"text": "a"}\n{"text": "b"}\n\n', ":3: blank line"),
    (b'["a"]\n', ':1: expected a JSON object {"text": ...}, got list'),
    (b'{"text": ""}\n{"text": ""}\n', ': all 2 documents have an empty "text": no tokens'),
]  # fmt: skip # a table, laid out by hand to read across
FILE_IDS = [
    "empty",
    "malformed",
    "no-text",
    "null",
    "int",
    "utf8",
    "blank",
    "trailing-blank",
    "list",
    "all-empty",
]


@pytest.mark.parametrize("data, message", BAD_FILES, ids=FILE_IDS)
def test_bad_data_file_names_file_and_line(capsys, tmp_path, data, message):
    path = tmp_path / "data.jsonl"
    path.write_bytes(data)
    code, _, err = check(capsys, "--dump_folder", str(tmp_path), *jsonl_data(path))
    assert_one_line(code, err, f"dataloader.dataset_path: {path}{message}")


def test_bad_validation_file_is_named_under_its_own_key(capsys, tmp_path):
    path = tmp_path / "val.jsonl"
    path.write_bytes(b'{"text": "a"}\n{"txt": "b"}\n')
    code, _, err = check(
        capsys, "--dump_folder", str(tmp_path), *jsonl_data(path, "validator.dataloader")
    )
    assert_one_line(code, err, f'validator.dataloader.dataset_path: {path}:2: no "text" key')


@pytest.mark.parametrize(
    "texts, message",
    [
        # One document for two data-parallel ranks.
        (["a single document"], "1 document(s) for 2 data-parallel ranks"),
        # The check finds what the loader would find on one rank only (the other rank would see a
        # lost connection): rank 0's two documents are empty.
        (
            ["", "", "real words here", "and more words"],
            'the 2 documents of data-parallel rank 0 all have an empty "text"',
        ),
    ],
)
def test_dataset_too_small_for_the_data_parallel_ranks(capsys, tmp_path, texts, message):
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    args = ["--dump_folder", str(tmp_path), *jsonl_data(path)]
    code, _, err = check(capsys, *args, nproc="2")
    assert_one_line(code, err, message)
    # With CP = 2 the two processes are one data-parallel rank: the file is enough.
    code, _, err = check(capsys, *args, "--parallelism.context_parallel_degree", "2", nproc="2")
    assert code == 0, err


# Fewer documents than ranks is refused before any split (datasets raises IndexError there).
@pytest.mark.parametrize(
    "documents, world", [(d, w) for d in (1, 2, 5, 7, 8, 13) for w in (1, 2, 3, 4) if d >= w]
)
def test_rank_share_matches_datasets_split(documents, world):
    from datasets import Dataset
    from datasets.distributed import split_dataset_by_node

    ds = Dataset.from_dict({"i": list(range(documents))})
    for rank in range(world):
        want = split_dataset_by_node(ds, rank=rank, world_size=world)["i"]
        assert list(jsonl.rank_share(documents, world, rank)) == want


def test_scan_reads_only_up_to_its_limit(tmp_path):
    path = tmp_path / "big.jsonl"
    path.write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(100)))
    full = jsonl.scan(str(path), max_bytes=None)
    assert (full.documents, full.nonempty, full.complete) == (100, 100, True)
    part = jsonl.scan(str(path), max_bytes=100)
    assert not part.complete and 0 < part.documents < 100


# ------------------------------------------------------------------------ real entry points


def run_train_sh(*args: str, nproc: str | None = None) -> tuple[subprocess.CompletedProcess, float]:
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="offline", WANDB_SILENT="true")
    env.pop("NPROC", None)
    if nproc is not None:
        env["NPROC"] = nproc
    t0 = time.perf_counter()
    proc = subprocess.run(
        [str(REPO / "scripts" / "train.sh"), *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return proc, time.perf_counter() - t0


@pytest.mark.slow
@pytest.mark.parametrize(
    "args, nproc, needle",
    [
        (["--training.steps", "-3"], None, "training.steps must be >= 0"),
        (["--parallelism.context_parallel_degree", "4"], "2", "does not divide the 2 processes"),
        ([], "0", "NPROC must be a whole number >= 1"),
        (["--dataloader.dataset", "jsonl", "--dataloader.dataset_path", "{bad}"], None, ":2: "),
        # a config file of any name (before: "Unrecognized options: path" unless it ended in .toml)
        (["{conf}"], None, "training.steps must be >= 0, got -3"),
    ],
    ids=["steps", "cp-degree", "NPROC=0", "data-file", "config-not-toml"],
)
def test_train_sh_refuses_before_torchrun(tmp_path, args, nproc, needle):
    """Through ./scripts/train.sh: exit 2, the one line, no torchrun block (torchrun never ran:
    before, each of these started both ranks and ended in a 40-line ChildFailedError, exit 1)."""
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"text": "a"}\n{"text": 1}\n')
    conf = tmp_path / "run.conf"
    conf.write_text("[training]\nsteps = -3\n")
    args = [a.replace("{bad}", str(bad)).replace("{conf}", str(conf)) for a in args]
    proc, seconds = run_train_sh(*args, "--dump_folder", str(tmp_path / "run"), nproc=nproc)
    lines = [line for line in proc.stderr.splitlines() if not line.startswith("[env]")]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(lines) == 1 and needle in lines[0], proc.stderr[-3000:]
    assert proc.stdout == "" and "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists()
    print(f"refused in {seconds:.1f} s: {lines[0]}")


def torchrun(*args: str, nproc: int = 2) -> subprocess.CompletedProcess:
    """``torchrun -m torchtitan_cp.train``, bypassing train.sh's check: the trainer's own."""
    cmd, env = torchrun_cmd(list(args), nproc=nproc)
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_direct_torchrun_runs_the_same_validation(tmp_path):
    proc = torchrun("--validator.freq", "0", "--dump_folder", str(tmp_path))
    assert proc.returncode != 0
    # The line of each rank that got to its check before torchrun stopped it on the first
    # rank's exit (one or both), and torchrun's failure block carries it as the root cause.
    lines = proc.stderr.splitlines()
    errors = [line for line in lines if line.startswith("torchtitan_cp.train: error:")]
    assert 1 <= len(errors) <= 2, proc.stderr[-3000:]
    assert all("validator.freq must be >= 1" in e for e in errors), errors
    assert "traceback : torchtitan_cp.train: error: validator.freq must be >= 1" in proc.stderr
    assert "ZeroDivisionError" not in proc.stderr


@pytest.mark.slow
def test_one_document_on_two_ranks_names_documents_and_ranks(tmp_path):
    """Bypassing the pre-launch scan, the loader itself stops a rank with one line naming the
    file and the ranks (before: rank 1 raised IndexError and rank 0 saw only gloo's "Connection
    closed by peer")."""
    path = tmp_path / "one.jsonl"
    path.write_text(json.dumps({"text": "a single document"}) + "\n")
    proc = torchrun(
        *jsonl_data(path),
        "--validator.no-enable",
        "--metrics.no-enable-wandb",
        "--dump_folder",
        str(tmp_path / "run"),
    )
    assert proc.returncode != 0
    # As above: one line per rank that got there, and the root cause of torchrun's block.
    lines = proc.stderr.splitlines()
    errors = [line for line in lines if line.startswith("torchtitan_cp.train: error:")]
    want = f"{path}: 1 document(s) for 2 data-parallel ranks"
    assert 1 <= len(errors) <= 2 and all(want in e for e in errors), proc.stderr[-3000:]
    assert f"traceback : torchtitan_cp.train: error: {want}" in proc.stderr, proc.stderr[-3000:]
    assert "IndexError" not in proc.stderr and "Connection closed" not in proc.stderr


@pytest.mark.parametrize("name", ["gpu_kda_1b", "gpu_gdn_1b"])
@pytest.mark.parametrize("cp", ["1", "2"])
def test_shipped_gpu_configs_pass_the_size_checks(name, cp):
    """The rules are not stricter than the shipped runs: 8 GPUs, with and without CP (ptrr).
    (Device, tokenizer and data checks need the GPU machine's files: see docs/gpu.md.)"""
    from torchtitan_cp.models import model_config
    from torchtitan_cp.train import load_config
    from torchtitan_cp.trainer import validate as v

    config = load_config(
        [
            "--config_file",
            str(REPO / "configs" / f"{name}.toml"),
            "--parallelism.context_parallel_degree",
            cp,
            "--parallelism.context_parallel_load_balancer",
            "ptrr",
        ]
    )
    model_cfg = model_config(config.model.flavor, **config.model.overrides())
    v._check_numbers(config, v._dp_degree(config, 8))
    v._check_seq_len(config, model_cfg)


@pytest.mark.parametrize(
    "seq_len, cp, ranks, mesh",
    [("131072", "8", 16, "dp_shard 2 x cp 8, ep 8"), ("1048576", "32", 32, "cp 32, ep 8")],
)
def test_shipped_kimi_linear_48b_config_passes_the_checks(seq_len, cp, ranks, mesh):
    """configs/gpu_kimi_linear_48b_cp.toml as shipped (128k, CP 8 x EP 8 on 16 ranks) and at
    1M tokens (CP 32 on 32 ranks): the model, parallelism (EP divides the 256 experts and
    dp_shard x cp) and size checks pass. The HF folder, tokenizer and data checks need the GPU
    machine's files, so the initial HF load is off here."""
    from torchtitan_cp.models import recipe_model_spec
    from torchtitan_cp.train import load_config
    from torchtitan_cp.trainer import validate as v

    config = load_config(
        [
            "--config_file",
            str(REPO / "configs" / "gpu_kimi_linear_48b_cp.toml"),
            "--checkpoint.no-initial-load-in-hf",
            "--training.seq_len",
            seq_len,
            "--parallelism.context_parallel_degree",
            cp,
        ]
    )
    assert config.model.name == "kimi_linear" and config.parallelism.expert_parallel_degree == 8
    assert not config.compile.enable
    model_cfg = recipe_model_spec(config.model).model
    v._check_numbers(config, v._dp_degree(config, ranks))
    v._check_seq_len(config, model_cfg)
    assert v.mesh_text(config, ranks).startswith(mesh)
