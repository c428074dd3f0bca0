"""Every check a run's configuration can pass before any process group exists.

``validate(config, world_size, device_type)`` raises a ``ConfigError`` whose message is one line
naming the key (or file) and the fix. ``./scripts/train.sh`` runs it in one process before it
starts torchrun (``python -m torchtitan_cp.train --check``), and every rank runs it again before
building the trainer, for launches that call torchrun directly. It reads files (dataset,
tokenizer) and probes folders, but builds no model and starts no process group.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
from typing import Any

from torchtitan_cp import compat
from torchtitan_cp.data import jsonl
from torchtitan_cp.models.recipe import recipe_model, recipe_model_spec
from torchtitan_cp.ops import check_flex_shape
from torchtitan_cp.routing import get_balancer
from torchtitan_cp.run.paths import existing_parent, probe_write
from torchtitan_cp.trainer.config import ConfigError

__all__ = [
    "check_attention_backend",
    "check_model",
    "mesh_text",
    "parse_nnodes",
    "parse_nproc",
    "pipeline_text",
    "validate",
]


def _whole_number(text: str, what: str, meaning: str) -> int:
    """``text`` as a whole number >= 1, else a ConfigError naming ``what`` and its ``meaning``."""
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1 or str(n) != text.strip():
        raise ConfigError(f"{what} must be a whole number >= 1 ({meaning}), got {text!r}")
    return n


def parse_nproc(text: str, *, device_type: str) -> int:
    """``NPROC`` as train.sh passes it: a whole number >= 1, or ``auto`` (one process per GPU,
    else 2 on CPU)."""
    if text in ("", "auto"):
        if device_type == "cuda":
            import torch

            return torch.cuda.device_count()
        return 2
    return _whole_number(text, "NPROC", "processes to start")


def parse_nnodes(text: str) -> int:
    """``NNODES`` as train.sh passes it: a whole number >= 1 (machines in the run)."""
    return _whole_number(text, "NNODES", "machines in the run")


def _need(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _check_degrees(p: Any) -> None:
    """Every parallelism degree >= 1 (the shard degree: -1 or >= 1), before anything divides
    by one (the model checks, the mesh)."""
    for key in (
        "data_parallel_replicate_degree",
        "context_parallel_degree",
        "tensor_parallel_degree",
        "pipeline_parallel_degree",
        "expert_parallel_degree",
    ):
        d = getattr(p, key)
        _need(d >= 1, f"parallelism.{key} must be >= 1, got {d}")
    shard = p.data_parallel_shard_degree
    _need(
        shard == -1 or shard >= 1,
        f"parallelism.data_parallel_shard_degree must be -1 (the "
        f"rest of the processes) or >= 1, got {shard}",
    )


def _dp_degree(config: Any, world_size: int) -> int:
    """Data-parallel (batch) degree torchtitan derives from the parallelism section."""
    p = config.parallelism
    _check_degrees(p)
    shard = p.data_parallel_shard_degree
    tp, pp = p.tensor_parallel_degree, p.pipeline_parallel_degree
    others = p.data_parallel_replicate_degree * p.context_parallel_degree * tp * pp
    if shard == -1:
        _need(
            world_size % others == 0,
            f"parallelism.context_parallel_degree ({p.context_parallel_degree}) x "
            f"tensor_parallel_degree ({tp}) x pipeline_parallel_degree ({pp}) x "
            f"data_parallel_replicate_degree ({p.data_parallel_replicate_degree}) = {others} "
            f"does not divide the {world_size} processes; use a divisor of {world_size} or "
            f"start a multiple of {others} processes (NPROC x NNODES)",
        )
        shard = world_size // others
    else:
        _need(
            shard * others == world_size,
            f"parallelism: data_parallel_shard_degree ({shard}) x replicate "
            f"({p.data_parallel_replicate_degree}) x context_parallel_degree "
            f"({p.context_parallel_degree}) x tensor_parallel_degree ({tp}) x "
            f"pipeline_parallel_degree ({pp}) = {shard * others}, but {world_size} processes "
            "run; make the product equal NPROC x NNODES or set data_parallel_shard_degree = -1",
        )
    ep = p.expert_parallel_degree
    # torchtitan's EP borrows its ranks from dp_shard x cp x tp (its efsdp x ep mesh)
    _need(
        ep == 1 or (shard * p.context_parallel_degree * tp) % ep == 0,
        f"parallelism.expert_parallel_degree ({ep}) must divide data_parallel_shard_degree x "
        f"context_parallel_degree x tensor_parallel_degree ({shard} x "
        f"{p.context_parallel_degree} x {tp}): experts are split over those ranks",
    )
    return shard * p.data_parallel_replicate_degree


def mesh_text(config: Any, world_size: int) -> str:
    """The device mesh torchtitan builds for ``world_size`` processes, in its order (pp,
    dp_replicate, dp_shard, cp, tp; ep borrowed from dp_shard x cp x tp), e.g.
    ``dp_shard 1 x cp 2 x tp 2 (4 processes)``."""
    p = config.parallelism
    tp, cp = p.tensor_parallel_degree, p.context_parallel_degree
    rep = p.data_parallel_replicate_degree
    shard = p.data_parallel_shard_degree
    if shard == -1:
        shard = world_size // max(1, rep * cp * tp * p.pipeline_parallel_degree)
    axes = [
        ("pp", p.pipeline_parallel_degree),
        ("dp_replicate", rep),
        ("dp_shard", shard),
        ("cp", cp),
        ("tp", tp),
    ]
    text = " x ".join(f"{name} {d}" for name, d in axes if d > 1) or "one rank"
    if p.expert_parallel_degree > 1:
        text += f", ep {p.expert_parallel_degree} (inside dp_shard x cp{' x tp' * (tp > 1)})"
    return f"{text} ({world_size} processes)"


def _check_tp_cp_within_node(config: Any, world_size: int, per_node: int) -> None:
    """TP and CP are the innermost mesh axes: a TP x CP group of ranks exchanges activations
    every layer, so by default it must fit inside one node (NPROC_PER_NODE)."""
    p = config.parallelism
    tp, cp = p.tensor_parallel_degree, p.context_parallel_degree
    if tp == 1 or world_size == per_node:
        return
    _need(
        per_node % (tp * cp) == 0,
        f"parallelism.tensor_parallel_degree ({tp}) x context_parallel_degree ({cp}) = "
        f"{tp * cp} ranks do not fit inside a node of {per_node} processes (NPROC_PER_NODE); "
        f"make tensor_parallel_degree x context_parallel_degree divide {per_node}",
    )


def _check_cp_within_nodes(config: Any, world_size: int, per_node: int) -> None:
    """CP is the innermost mesh axis but TP (torchtitan orders pp, dp_replicate, dp_shard, cp,
    tp), so (without TP) ranks r..r+CP-1 form a CP group and torchrun numbers each node's
    processes consecutively: a group stays inside a node when CP divides the processes per
    node, or covers whole nodes when they divide CP. Anything else splits a group unevenly
    across nodes."""
    _check_tp_cp_within_node(config, world_size, per_node)
    cp = config.parallelism.context_parallel_degree
    if world_size == per_node or cp <= 1 or per_node % cp == 0 or cp % per_node == 0:
        return
    raise ConfigError(
        f"parallelism.context_parallel_degree ({cp}) and the {per_node} processes per node "
        f"(NPROC_PER_NODE) divide neither way: CP groups would straddle nodes; use a CP degree "
        f"that divides {per_node} (CP inside a node) or a multiple of it (whole nodes)"
    )


PIPELINE_MODELS = "hybrid, qwen3_5, kimi_linear"
"""The models with pipeline parallelism (a ``RecipeModel.stage_plan``), for messages
(tests/test_pipeline_placement.py holds it to the registry)."""


ZERO_BUBBLE = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
"""torch's schedules with a separate weight-gradient pass."""


def _check_pipeline(config: Any, model_cfg: Any, world_size: int) -> Any:
    """Pipeline parallelism against the model, the schedule and the batch: the run's
    ``StagePlan`` (None without PP), or a ConfigError naming the key."""
    from torch.distributed.pipelining.schedules import get_schedule_class

    from torchtitan_cp.models.blocks.pipeline import (
        pipeline_stages,
        schedule_problem,
        stage_count,
    )

    p = config.parallelism
    pp, split = p.pipeline_parallel_degree, p.pipeline_parallel_split
    if pp == 1:
        _need(
            not split,
            f"parallelism.pipeline_parallel_split {split!r} places pipeline stages, but "
            "pipeline_parallel_degree is 1; set the degree or drop the split",
        )
        return None
    entry = recipe_model(config.model.name)
    stage_plan = entry.stage_plan
    _need(
        stage_plan is not None,
        f"parallelism.pipeline_parallel_degree = {pp}: model.name = {config.model.name!r} has no "
        f"pipeline parallelism in this recipe (it has: {PIPELINE_MODELS}); set it to 1",
    )
    schedule = p.pipeline_parallel_schedule
    try:
        get_schedule_class(schedule)
    except ValueError as e:
        raise ConfigError(f"parallelism.pipeline_parallel_schedule: {e}") from None
    _need(
        not p.pipeline_parallel_schedule_csv,
        "parallelism.pipeline_parallel_schedule_csv: a schedule from a file is not supported "
        "with this recipe's stage placement; name a schedule instead",
    )
    _need(
        p.module_fqns_per_model_part is None and p.pipeline_parallel_layers_per_stage is None,
        "parallelism.module_fqns_per_model_part / pipeline_parallel_layers_per_stage: this recipe "
        "places stages by parallelism.pipeline_parallel_split (the layer pattern with '|'); "
        "unset them",
    )
    lbs, mb = config.training.local_batch_size, p.pipeline_parallel_microbatch_size
    _need(
        mb >= 1 and lbs % mb == 0,
        f"training.local_batch_size ({lbs}) must be a multiple of parallelism."
        f"pipeline_parallel_microbatch_size ({mb}): each pipeline microbatch is that many rows",
    )
    n_stages = pipeline_stages(p)
    if split:
        _need(
            n_stages % pp == 0,
            f"parallelism.pipeline_parallel_split {split!r} places {n_stages} stages, which "
            f"pipeline_parallel_degree {pp} does not divide; place a multiple of {pp} stages",
        )
    problem = schedule_problem(schedule, pp, n_stages, lbs // mb)
    _need(
        problem is None,
        f"parallelism.pipeline_parallel_schedule = {schedule!r} cannot run this pipeline "
        f"(pipeline_parallel_degree {pp}, {n_stages} stages, {lbs // mb} microbatches of "
        f"{mb} rows): {problem}",
    )
    _need(
        not getattr(model_cfg, "enable_weight_tying", False),
        "model.enable_weight_tying cannot be combined with parallelism.pipeline_parallel_degree "
        "> 1 (the embedding is on the first stage, the LM head on the last); set one of them off",
    )
    _need(
        not config.spike_guard.enabled,
        "spike_guard.enabled with parallelism.pipeline_parallel_degree > 1: only the last stage "
        "sees the loss, and every stage must agree to skip; turn one of them off",
    )
    shard = p.data_parallel_shard_degree
    if shard == -1:
        rest = p.data_parallel_replicate_degree * p.context_parallel_degree * pp
        shard = world_size // max(1, rest * p.tensor_parallel_degree)
    _need(
        schedule not in ZERO_BUBBLE or shard * p.context_parallel_degree == 1,
        f"parallelism.pipeline_parallel_schedule = {schedule!r} with FSDP (data_parallel_shard_"
        f"degree x context_parallel_degree = {shard} x {p.context_parallel_degree}): its separate "
        "weight-gradient pass loses gradients under FSDP here (pp2 x fsdp2: step 1's grad norm "
        "3 % low); use 1F1B, Interleaved1F1B or GPipe, or no FSDP and no CP",
    )
    _need(
        not (config.activation_checkpoint is not None and schedule in ZERO_BUBBLE),
        f"activation_checkpoint with parallelism.pipeline_parallel_schedule = {schedule!r}: its "
        "separate weight-gradient pass re-runs checkpointed forwards (not supported here); use "
        "1F1B, Interleaved1F1B or GPipe, or no activation checkpointing",
    )
    try:
        assert stage_plan is not None
        return stage_plan(model_cfg, n_stages, config.training.seq_len, split)
    except ValueError as e:
        raise ConfigError(f"{e} ({stage_count(schedule, pp)[1]} with {schedule})") from None


def pipeline_text(config: Any, world_size: int) -> str | None:
    """``--check``'s line on the pipeline (the stage split and its costs), or None without PP."""
    if config.parallelism.pipeline_parallel_degree == 1:
        return None
    plan = _check_pipeline(config, recipe_model_spec(config.model).model, world_size)
    return plan.text()


def _check_numbers(config: Any, dp: int) -> None:
    t = config.training
    _need(t.steps >= 0, f"training.steps must be >= 0, got {t.steps}")
    _need(
        t.local_batch_size >= 1, f"training.local_batch_size must be >= 1, got {t.local_batch_size}"
    )
    _need(t.seq_len >= 1, f"training.seq_len must be >= 1 (tokens per row), got {t.seq_len}")
    _need(t.gc_freq >= 1, f"training.gc_freq must be >= 1, got {t.gc_freq}")
    gbs = t.global_batch_size
    if gbs >= 0:
        per_step = t.local_batch_size * dp
        _need(
            gbs >= 1 and gbs % per_step == 0,
            f"training.global_batch_size ({gbs}) must be a positive multiple of "
            f"local_batch_size x data-parallel degree ({t.local_batch_size} x {dp} = "
            f"{per_step}); use -1 for exactly that",
        )
    for i, group in enumerate(config.optimizer.param_groups):
        lr = group.optimizer_kwargs.get("lr")
        if isinstance(lr, (int, float)):
            _need(lr >= 0, f"optimizer.param_groups.{i}.optimizer_kwargs.lr must be >= 0, got {lr}")
    s = config.lr_scheduler
    _need(s.warmup_steps >= 0, f"lr_scheduler.warmup_steps must be >= 0, got {s.warmup_steps}")
    _need(
        s.total_steps is None or s.total_steps >= 1,
        f"lr_scheduler.total_steps must be >= 1 or unset, got {s.total_steps}",
    )
    _need(
        s.decay_ratio is None or 0 <= s.decay_ratio <= 1,
        f"lr_scheduler.decay_ratio must be in [0, 1] or unset, got {s.decay_ratio}",
    )
    _need(
        0 <= s.min_lr_factor <= 1,
        f"lr_scheduler.min_lr_factor must be in [0, 1], got {s.min_lr_factor}",
    )
    _need(
        config.metrics.log_freq >= 1,
        f"metrics.log_freq must be >= 1, got {config.metrics.log_freq}",
    )
    v = config.validator
    if v.enable:
        _need(
            v.freq >= 1,
            f"validator.freq must be >= 1 (validate every N steps), got {v.freq}; "
            "use --validator.no-enable to turn validation off",
        )
        _need(
            v.steps == -1 or v.steps >= 1,
            f"validator.steps must be >= 1, or -1 for the whole split, got {v.steps}",
        )


def _check_seq_len(config: Any, model_cfg: Any) -> None:
    """``training.seq_len`` against CP, the load balancer, the loss chunking and the model."""
    seq = config.training.seq_len
    cp = config.parallelism.context_parallel_degree
    try:
        balancer = get_balancer(
            config.parallelism.context_parallel_load_balancer,
            ptrr_block_size=config.linear_attention.ptrr_block_size,
        )
    except ValueError as e:
        raise ConfigError(str(e)) from None
    max_len = getattr(model_cfg, "max_seq_len", None)
    if max_len is not None:
        _need(
            seq <= max_len, f"training.seq_len ({seq}) exceeds the model's max_seq_len ({max_len})"
        )
    tp = config.parallelism.tensor_parallel_degree
    if tp > 1:
        # Sequence parallelism splits each row's local span over the TP ranks.
        _need(
            seq % (max(cp, 1) * tp) == 0,
            f"training.seq_len ({seq}) must be divisible by context_parallel_degree x "
            f"tensor_parallel_degree ({max(cp, 1)} x {tp}): sequence parallelism splits each "
            "CP rank's tokens over its TP ranks",
        )
    if cp > 1:
        # torchtitan's trainer asks for 2 x CP whatever the balancer; the balancer adds its own.
        torchtitan_rule = (2 * cp, f"2 x context_parallel_degree ({cp})")
        try:
            balancer.check(seq, cp, also=[torchtitan_rule])
        except ValueError as e:
            raise ConfigError(str(e)) from None
    chunks = getattr(config.loss, "num_chunks", None)
    if chunks is not None:
        local = seq // max(cp, 1)
        if local % chunks:
            step = chunks * max(cp, 1)
            lower, upper = seq - seq % step, seq - seq % step + step
            hint = f"{lower} or {upper}" if lower else f"{upper}"
            raise ConfigError(
                f"training.seq_len ({seq}) / context_parallel_degree ({cp}) = {local} tokens "
                f"per rank must be divisible by loss.num_chunks ({chunks}), the chunked loss's "
                f"pieces: use seq_len {hint}, or change --loss.num_chunks"
            )


def _check_backends(config: Any, model_cfg: Any, device_type: str, local_world: int) -> None:
    backend = config.linear_attention.backend
    if backend == "fla":
        from torchtitan_cp.ops.common.fla import triton_interpreter_on

        # On CPU only under Triton's interpreter (the fla_interpreter test tier).
        _need(
            device_type == "cuda" or (device_type == "cpu" and triton_interpreter_on()),
            "linear_attention.backend = 'fla' needs CUDA (fla-core's "
            f"kernels are Triton) but this machine runs on {device_type}; use 'torch' or "
            "'auto'",
        )
    if backend in ("fla", "auto") and device_type == "cuda":
        _need(
            importlib.util.find_spec("fla") is not None,
            f"linear_attention.backend = "
            f"'{backend}' uses fla-core on CUDA, which is not installed; pip install "
            "fla-core==0.6.0, or use 'torch'",
        )
    refused = _fla_refused(model_cfg) if backend == "fla" and device_type == "cuda" else []
    if refused:  # one fla kernel today, so one reason; every refused kind is named
        layers = " and ".join(name for name, _ in refused)
        raise ConfigError(
            f"linear_attention.backend = 'fla' for {layers}: {refused[0][1]}; "
            "or use 'auto' (those layers on the PyTorch kernels)"
        )
    if device_type == "cuda":
        import torch

        gpus = torch.cuda.device_count()
        _need(
            local_world <= gpus,
            f"{local_world} processes on this machine but {gpus} GPU(s): "
            "one process per GPU; set NPROC (or --nproc_per_node) to at most "
            f"{gpus}",
        )
    # The trainer runs the same model checks (check_model), so the pre-launch check and the
    # trainer agree.
    check_attention_backend(config, model_cfg, device_type=device_type)


def _fla_refused(model_cfg: Any) -> list[tuple[str, str]]:
    """``(layers, reason)`` for each kind of the model's layers whose recurrence's fla kernels
    are refused here (``Recurrence.fla_refusal``): the hybrid's letters by their kind's
    recurrence, Qwen3.5's GatedDeltaNets (the ``gdn`` recurrence)."""
    from torchtitan_cp.models.hybrid.layers import LAYERS
    from torchtitan_cp.ops.cp.recurrence import recurrence

    kinds = [LAYERS[c] for c in dict.fromkeys(getattr(model_cfg, "layer_pattern", ""))]
    named = [(f"{k.description} layers", k.recurrence) for k in kinds if k.recurrence]
    if any(getattr(lay, "delta_net", None) is not None for lay in getattr(model_cfg, "layers", ())):
        named.append(("GatedDeltaNet layers", "gdn"))
    found = [(layers, recurrence(name).fla_refusal()) for layers, name in named]
    return [(layers, reason) for layers, reason in found if reason is not None]


def _check_torch(config: Any, world_size: int) -> None:
    """What this torch can run: torch 2.11-2.13 train one process (compat.py's shims)."""
    try:
        compat.check_trainer_torch(world_size)
    except compat.TorchVersionError as e:
        raise ConfigError(str(e)) from None
    _need(
        not config.metrics.enable_tensorboard or compat.tensorboard_available(),
        "metrics.enable_tensorboard = true needs the tensorboard package, which is not "
        "installed here; pip install tensorboard or set it to false",
    )


def _probe_writable(folder: str, key: str) -> None:
    """``folder`` exists and takes a new file, or can be created (its nearest existing parent
    takes one). Probes with a real file: ``os.access`` says yes to root on read-only mounts."""
    path = os.path.abspath(folder)
    probe = existing_parent(path)
    if not os.path.isdir(probe):
        raise ConfigError(f"{key} {folder}: {probe} is a file, not a folder; choose another path")
    try:
        probe_write(probe)
    except OSError as e:
        where = "" if probe == path else f" (its parent {probe} cannot be written)"
        raise ConfigError(
            f"{key} {folder}: not writable{where}: {e.strerror or e}; choose "
            "another folder or fix its permissions"
        ) from None


def _check_paths(config: Any) -> None:
    _probe_writable(config.dump_folder, "dump_folder")
    jsonl_file = getattr(config.metrics, "jsonl_file", "")
    if jsonl_file:
        path = os.path.join(config.dump_folder, jsonl_file)
        stem = path[: -len(".jsonl")] if path.endswith(".jsonl") else path
        for existing in (path, stem + ".superseded.jsonl"):
            _probe_appendable(existing, "metrics.jsonl_file")
    ckpt = config.checkpoint
    if ckpt.enable:
        _probe_writable(os.path.join(config.dump_folder, ckpt.folder), "checkpoint.folder")
        if ckpt.initial_load_path and "://" not in ckpt.initial_load_path:
            _need(
                os.path.isdir(ckpt.initial_load_path),
                f"checkpoint.initial_load_path {ckpt.initial_load_path}: no such checkpoint folder",
            )


def _probe_appendable(path: str, key: str) -> None:
    """An existing ``path`` takes appended lines (opened for appending, nothing written)."""
    if not os.path.lexists(path):
        return
    if os.path.isdir(path):
        raise ConfigError(f"{key} {path}: a folder, not a file; remove it or choose another name")
    try:
        with open(path, "a"):
            pass
    except OSError as e:
        raise ConfigError(
            f"{key} {path}: cannot be appended to ({e.strerror or e}); make it writable, or "
            "pass another --dump_folder or --metrics.jsonl_file"
        ) from None


def _non_finite(node: Any, path: str = "") -> tuple[str, float] | None:
    """The first float of the config tree (dataclass fields, dict values, list items) that is
    inf or nan, with its dotted key."""
    if isinstance(node, float):
        return None if math.isfinite(node) else (path, node)
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        items: Any = ((f.name, getattr(node, f.name, None)) for f in dataclasses.fields(node))
    elif isinstance(node, dict):
        items = node.items()
    elif isinstance(node, (list, tuple)):
        items = enumerate(node)
    else:
        return None
    for key, value in items:
        found = _non_finite(value, f"{path}.{key}" if path else str(key))
        if found:
            return found
    return None


def _check_run_options(config: Any, world_size: int) -> None:
    """Keys whose wrong values would otherwise be ignored or fail only inside the ranks."""
    bad = _non_finite(config)
    if bad is not None:
        raise ConfigError(f"{bad[0]} must be a finite number, got {bad[1]}")
    ckpt = config.checkpoint
    _need(
        ckpt.load_step >= -1,
        f"checkpoint.load_step must be -1 (the newest step) or a step number >= 0, got "
        f"{ckpt.load_step}",
    )
    if ckpt.initial_load_path and not ckpt.enable:
        raise ConfigError(
            f"checkpoint.initial_load_path = {ckpt.initial_load_path} is ignored without "
            "checkpointing: add --checkpoint.enable (with --checkpoint.load_only to load without "
            "saving)"
        )
    if ckpt.create_seed_checkpoint:
        _need(
            ckpt.enable and world_size == 1,
            "checkpoint.create_seed_checkpoint needs --checkpoint.enable and one process "
            f"(NPROC=1), got {world_size} process(es)"
            + ("" if ckpt.enable else " and checkpointing off"),
        )


def _tokenizer_vocab(path: str) -> int | None:
    """The tokenizer's vocabulary size from the files torchtitan's HuggingFaceTokenizer reads
    (``tokenizer.json``, else ``vocab.json`` / ``vocab.txt``), or a ConfigError."""
    key = "hf_assets_path"
    _need(os.path.isdir(path), f"{key} {path}: no such folder (it must hold tokenizer.json)")
    tok_json = os.path.join(path, "tokenizer.json")
    if os.path.isfile(tok_json):
        try:
            from tokenizers import Tokenizer

            return Tokenizer.from_file(tok_json).get_vocab_size()
        except Exception as e:  # tokenizers raises its own exception types
            raise ConfigError(f"{key} {tok_json}: cannot be read as a tokenizer: {e}") from None
    if os.path.isfile(os.path.join(path, "vocab.json")):
        try:
            with open(os.path.join(path, "vocab.json"), encoding="utf-8") as f:
                return len(json.load(f))
        except (OSError, ValueError) as e:
            raise ConfigError(f"{key} {path}/vocab.json: cannot be read: {e}") from None
    if os.path.isfile(os.path.join(path, "vocab.txt")):
        return None
    raise ConfigError(f"{key} {path}: no tokenizer.json, vocab.json or vocab.txt in it")


def _check_data(config: Any, model_cfg: Any, dp: int, *, scan: bool) -> None:
    from torchtitan_cp.data.loader import local_jsonl_path

    vocab = _tokenizer_vocab(config.hf_assets_path)
    if vocab is not None and vocab > model_cfg.vocab_size:
        raise ConfigError(
            f"model.vocab_size ({model_cfg.vocab_size}) is smaller than the tokenizer's {vocab} "
            f"tokens ({config.hf_assets_path}); set --model.vocab_size {vocab} or larger"
        )
    loaders = [("dataloader", config.dataloader)]
    if config.validator.enable:
        loaders.append(("validator.dataloader", config.validator.dataloader))
    from torchtitan.hf_datasets.text_datasets import DATASETS

    for key, loader in loaders:
        name = loader.dataset.lower()
        _need(
            name in DATASETS,
            f"{key}.dataset '{loader.dataset}' is unknown (known: {', '.join(sorted(DATASETS))})",
        )
        path = local_jsonl_path(name, loader.dataset_path)
        if name == "jsonl" and not path:
            raise ConfigError(f"{key}.dataset = 'jsonl' needs {key}.dataset_path (a .jsonl file)")
        if not path:
            continue
        try:
            if not scan:
                jsonl.check_jsonl_file(path)
                continue
            summary = jsonl.scan(path)
            if summary.complete:
                jsonl.check_documents_for_ranks(path, summary.documents, dp)
                jsonl.check_rank_shares(summary, dp)
                jsonl.check_row_fits(summary, dp, config.training.seq_len)
        except jsonl.DataError as e:
            raise ConfigError(f"{key}.dataset_path: {e}") from None


def validate(
    config: Any,
    world_size: int,
    device_type: str,
    *,
    local_world_size: int | None = None,
    scan_data: bool = True,
) -> None:
    """Check ``config`` (a ``HybridTrainer.Config``) for a run of ``world_size`` processes
    (``local_world_size`` of them on this machine; default all) on ``device_type``.

    Raises ConfigError (one line: key, value, fix). ``scan_data`` reads local JSONL datasets line
    by line (up to ``jsonl.SCAN_LIMIT_BYTES``); without it only their presence is checked (the
    loader checks the content itself)."""
    _need(world_size >= 1, f"the run needs at least one process, got {world_size} (NPROC)")
    _check_torch(config, world_size)
    try:  # the hybrid decoder or torchtitan's Qwen3.5, as [model] name says
        model_cfg = recipe_model_spec(config.model).model
    except ValueError as e:
        raise ConfigError(str(e)) from None
    _check_run_options(config, world_size)
    dp = _dp_degree(config, world_size)
    _check_cp_within_nodes(config, world_size, local_world_size or world_size)
    _check_pipeline(config, model_cfg, world_size)
    _check_numbers(config, dp)
    _check_seq_len(config, model_cfg)
    _check_backends(config, model_cfg, device_type, local_world_size or world_size)
    _check_paths(config)
    _check_data(config, model_cfg, dp, scan=scan_data)


def check_model(config: Any) -> tuple[Any, bool]:
    """Build ``[model]``'s spec and check it against the run's parallelism and device (the
    model's own ``RecipeModel.check``, and its HF folder when the run starts from one);
    returns ``(spec, flex)``. Every problem is a one-line ConfigError naming the key."""
    _check_degrees(config.parallelism)  # the model checks below divide by them
    try:
        entry = recipe_model(config.model.name)
        spec = recipe_model_spec(config.model)
        entry.check(spec.model, config)
        ckpt = config.checkpoint
        if ckpt.enable and ckpt.initial_load_in_hf and entry.hf is not None:
            spec = entry.hf.read(spec, ckpt.initial_load_path or config.hf_assets_path)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return spec, check_attention_backend(config, spec.model)


def check_attention_backend(config: Any, model_cfg: Any, *, device_type: str | None = None) -> bool:
    """Whether this run's attention layers use flex; a ConfigError where flex cannot run:
    training off CUDA (no flex backward there) or, on the all-gather CP path, a CP shard that
    is not whole mask blocks.
    ``device_type`` defaults to this machine's."""
    device = device_type or compat.device_type()
    if not model_cfg.uses_flex_attention(device):
        return False
    if device != "cuda":
        raise ConfigError(
            f"model.attention_backend = 'flex' cannot train on {device}: flex attention has no "
            "backward there; use 'sdpa' (or 'auto', which picks sdpa off CUDA)"
        )
    cp = config.parallelism.context_parallel_degree
    if getattr(model_cfg, "attention_cp", "all_gather") == "pass_kv" and cp > 1:
        return True  # per-pair masks of any length: no whole-block rule
    try:
        check_flex_shape(config.training.seq_len, cp)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return True
