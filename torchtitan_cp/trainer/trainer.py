"""The hybrid-model trainer: torchtitan's ``Trainer`` with CP routing built per microbatch.

What changes against torchtitan 0.3.0's trainer:
* ``post_dataloading_process`` hands the batch to one ``SequencePreprocessor``
  (``models.sequence``, shared with the validator) in one call: it takes the batch's
  ``HostMetadata`` out, shards the batch for this CP rank and builds the microbatch's
  ``SequenceContext``; the model gets ``positions`` and ``seq_ctx``.
* ``train_step`` moves batches to the device pinned and ``non_blocking`` and takes the
  valid-token count from the loader's host metadata: no synchronisation outside log steps.
* ``[model]`` (a ``ModelRecipe``) is the single source of the model spec.
* Metrics add ``routing/*`` counters, a JSONL file and optional parameter checksums
  (``trainer.metrics``).
* Runs hold their dump folder (``run.start.start_run``: lock, verified resume plan), checkpoints carry
  sha256 manifests (``run.checkpoint.HybridCheckpointManager``, ``run.manifest``), and an optional loss-spike guard
  acts before the optimizer step (``run.spike_guard``).

The torchtitan 0.3.0 shims (``compat.apply``) are applied by the entry point before torchtitan's
trainer code runs, and again (idempotent) when a ``HybridTrainer`` is built.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torchtitan.components.loss import IGNORE_INDEX, ChunkedLossWrapper, CrossEntropyLoss
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
from torchtitan.components.validate import Validator
from torchtitan.config import CompileConfig as _TitanCompileConfig
from torchtitan.config import ParallelismConfig, TrainingConfig
from torchtitan.distributed import utils as dist_utils
from torchtitan.observability import structured_logger as sl
from torchtitan.tools.logging import logger
from torchtitan.trainer import Trainer

from torchtitan_cp import compat
from torchtitan_cp.data.loader import PackedTextDataLoader, PackedValidationDataLoader
from torchtitan_cp.models.recipe import ModelRecipe
from torchtitan_cp.models.sequence import SequencePreprocessor
from torchtitan_cp.routing.host_metadata import HOST_METADATA_KEY, HostMetadata
from torchtitan_cp.run.checkpoint import HybridCheckpointManager
from torchtitan_cp.run.spike_guard import (
    SpikeGuard,
    SpikeGuardConfig,
    non_finite_error,
    resume_hint,
)
from torchtitan_cp.run.start import RunContext, run_header, start_run
from torchtitan_cp.trainer.compile import CAP_KEYS, check_compile, compile_counters
from torchtitan_cp.trainer.config import LinearAttentionConfig
from torchtitan_cp.trainer.metrics import (
    DebugConfig,
    HybridMetricsProcessor,
    tensors_sha256,
)
from torchtitan_cp.trainer.validate import check_model

ASSETS = Path(__file__).resolve().parents[1] / "assets"


@dataclass(kw_only=True, slots=True)
class CompileConfig(_TitanCompileConfig):
    """torchtitan's ``[compile]``, its backend documented."""

    backend: str = "inductor"
    """torch.compile backend, a name of torch._dynamo.list_backends() (inductor, aot_eager,
    eager, ...); another is an error before launch."""


@dataclass(kw_only=True, slots=True)
class RecipeParallelism(ParallelismConfig):
    """torchtitan's ``[parallelism]`` with the pipeline's stage placement."""

    pipeline_parallel_split: str = ""
    """Where the pipeline stages fall: model.layer_pattern with '|' between stages (KG|MRA:
    stage 0 holds layers 0-1 and the embedding, stage 1 layers 2-4, the norm and the LM head),
    as many stages as the schedule runs (pipeline_parallel_degree x its stages per rank).
    Empty: the cost model's balance (models/blocks/pipeline.py; --check prints the split)."""


class HybridValidator(Validator):
    """torchtitan's validator, preprocessing batches with the trainer's SequencePreprocessor."""

    @dataclass(kw_only=True, slots=True)
    class Config(Validator.Config):
        # A narrower config type than the parent's field, as torchtitan's own subclasses do.
        dataloader: PackedValidationDataLoader.Config = field(  # pyrefly: ignore[bad-override-mutable-attribute]
            default_factory=PackedValidationDataLoader.Config
        )

    sequence: SequencePreprocessor | None = None

    def post_dataloading_process(self, input_dict, labels, model_parts):
        assert self.sequence is not None, "HybridTrainer sets the validator's preprocessor"
        return self.sequence.preprocess(input_dict, labels)


_NONE = 2**62  # _note_finite's marker: no non-finite step yet


def _host_valid_tokens(input_dict: dict[str, Any], labels: torch.Tensor) -> int:
    """Labels that count in the loss: the loader's host count, else counted on the loader's
    (host) labels, as torchtitan does."""
    host = input_dict.get(HOST_METADATA_KEY)
    if isinstance(host, HostMetadata) and host.valid_tokens is not None:
        return host.valid_tokens
    return int((labels != IGNORE_INDEX).sum())


def _persist_fla_autotune(setting: str) -> None:
    """Before any kernel runs: fla's autotune once per machine, not once per process
    (``[linear_attention] fla_autotune_dir``; CUDA only, where Triton autotunes)."""
    import torch

    if not torch.cuda.is_available():
        return
    from torchtitan_cp.ops.common import fla_autotune

    folder = fla_autotune.resolve_dir(setting)
    if folder is not None:
        fla_autotune.persist(folder)


class HybridTrainer(Trainer):
    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        model: ModelRecipe = field(default_factory=ModelRecipe)
        linear_attention: LinearAttentionConfig = field(default_factory=LinearAttentionConfig)
        # Narrower config types than the parent's fields (the subclasses this recipe builds).
        debug: DebugConfig = field(default_factory=DebugConfig)  # pyrefly: ignore[bad-override-mutable-attribute]
        compile: CompileConfig = field(default_factory=CompileConfig)  # pyrefly: ignore[bad-override-mutable-attribute]
        metrics: HybridMetricsProcessor.Config = field(  # pyrefly: ignore[bad-override-mutable-attribute]
            default_factory=HybridMetricsProcessor.Config
        )
        validator: HybridValidator.Config = field(default_factory=HybridValidator.Config)  # pyrefly: ignore[bad-override-mutable-attribute]
        checkpoint: HybridCheckpointManager.Config = field(  # pyrefly: ignore[bad-override-mutable-attribute]
            default_factory=HybridCheckpointManager.Config
        )
        spike_guard: SpikeGuardConfig = field(default_factory=SpikeGuardConfig)
        parallelism: RecipeParallelism = field(default_factory=RecipeParallelism)  # pyrefly: ignore[bad-override-mutable-attribute]

    run: RunContext

    def __init__(self, config: Config):
        compat.apply()  # torchtitan 0.3.0's shims (idempotent; the entry point applies them first)
        _persist_fla_autotune(config.linear_attention.fla_autotune_dir)
        spec, flex = check_model(config)
        model_cfg = spec.model  # HybridDecoder.Config or Qwen35TextModel.Config
        config.model_spec = spec
        # The loss is sized by the model's vocabulary, whichever flavor or override set it.
        loss_fn_cfg = getattr(config.loss, "loss_fn", config.loss)
        if hasattr(loss_fn_cfg, "global_vocab_size"):
            setattr(loss_fn_cfg, "global_vocab_size", model_cfg.vocab_size)  # noqa: B010
        caps = check_compile(config, model_cfg)  # fixed routing shapes when compiling
        super().__init__(config)
        pd = self.parallel_dims
        cp_group = pd.get_mesh("cp").get_group() if pd.cp_enabled else None
        self.sequence = SequencePreprocessor(
            device=self.device,
            cp_group=cp_group,
            load_balancer=config.parallelism.context_parallel_load_balancer,
            routing_source=config.linear_attention.routing_source,
            plan_cache_size=config.linear_attention.plan_cache_size,
            conv_history=model_cfg.conv_width - 1,
            ptrr_block_size=config.linear_attention.ptrr_block_size,
            flex_attention=flex,
            attention_cp=getattr(model_cfg, "attention_cp", "all_gather"),
            caps=caps,
            cap_keys=CAP_KEYS,
        )
        self.report_compile = caps is not None
        if config.validator.enable:
            cast(HybridValidator, self.validator).sequence = self.sequence
        metrics = cast(HybridMetricsProcessor, self.metrics_processor)
        metrics.extra_metrics_fn = self._extra_metrics
        metrics.validation_metrics_fn = self._validation_metrics
        self.param_checksums = config.debug.param_checksums
        ckpt = self.checkpointer
        if isinstance(ckpt, HybridCheckpointManager):
            ckpt.run_id = self.run.run_id
            ckpt.plan = self.run.plan
            ckpt.on_loaded = self._start_metrics_run
            ckpt.train_timeout = timedelta(seconds=config.comm.train_timeout_seconds)
            ckpt.before_save = lambda step: self._stop_if_not_finite()
        self.spike_guard = SpikeGuard(config.spike_guard) if config.spike_guard.enabled else None
        self._step_loss: torch.Tensor | None = None
        self._update_skipped = False  # this step's update dropped by the spike guard
        # This rank's loss sum and valid tokens of the step (after CP sharding), for the
        # rank-normalised global_max_loss.
        self._rank_loss_sum: torch.Tensor | None = None
        self._rank_tokens: torch.Tensor | None = None
        # The first step since the last check whose update applied a non-finite loss, kept on
        # the device (``_note_finite``) and read at log steps, before a save and at the end.
        self._first_non_finite: torch.Tensor | None = None
        if self.spike_guard is not None:
            self.optimizers.register_step_pre_hook(lambda *args, **kwargs: self._guard_step())

    def init_distributed(self):
        parallel_dims = super().init_distributed()
        # Before anything is built: the dump folder's lock, a writable checkpoint folder and a
        # verified resume plan, so a second run or a bad checkpoint folder fails in seconds.
        cfg = self.config
        self.run = start_run(
            dump_folder=cfg.dump_folder,
            checkpoint=cfg.checkpoint,
            training_steps=cfg.training.steps,
            timeout=timedelta(seconds=cfg.comm.init_timeout_seconds),
        )
        for line in self.run.lines:
            logger.warning(line)
        return parallel_dims

    def _start_metrics_run(self, resumed_from: int) -> None:
        world = dist.get_world_size() if dist.is_initialized() else 1
        header = run_header(self.run, resumed_from=resumed_from, world_size=world)
        cast(HybridMetricsProcessor, self.metrics_processor).start_run(header, resumed_from)

    def train(self):
        plan = self.run.plan
        if plan is not None and plan.complete:
            logger.info(
                f"Nothing to train: checkpoint step-{plan.step} already reached training.steps "
                f"= {self.config.training.steps} (raise --training.steps to continue)"
            )
            return
        super().train()  # its checkpointer.load() starts the metrics run (on_loaded)
        self._stop_if_not_finite()  # the steps after the last log step and save

    def close(self) -> None:
        try:
            super().close()
        finally:
            if hasattr(self, "run"):
                self.run.close()

    def forward_backward_step(self, *, input_dict, labels, global_valid_tokens):
        loss = super().forward_backward_step(
            input_dict=input_dict, labels=labels, global_valid_tokens=global_valid_tokens
        )
        # loss = this rank's loss sum / the data-parallel batch's valid tokens
        loss_sum = loss.detach() * global_valid_tokens
        self._rank_loss_sum = (
            loss_sum if self._rank_loss_sum is None else self._rank_loss_sum + loss_sum
        )
        if self.spike_guard is not None:
            # local loss sum / global valid tokens; summed over the loss mesh it is the
            # global average torchtitan logs
            loss_d = loss.detach()
            self._step_loss = (
                loss_d.clone() if self._step_loss is None else self._step_loss + loss_d
            )
        return loss

    def _guard_step(self) -> None:
        """Optimizer pre-step hook: the spike guard's verdict on this step's global loss."""
        assert self.spike_guard is not None and self._step_loss is not None
        pd = self.parallel_dims
        mesh = pd.get_optional_mesh("loss") if pd.dp_cp_enabled else None
        loss = dist_utils.dist_sum(self._step_loss, mesh)
        self._step_loss = None
        skipped = self.spike_guard.check(self.step, loss, resume=self._resume_hint())
        self._update_skipped = skipped is not None
        if skipped is not None:
            logger.warning(skipped)
            # No gradients: AdamW leaves parameters and moments of every parameter alone.
            self.optimizers.zero_grad(set_to_none=True)

    def _resume_hint(self) -> str:
        """Where this run can go on from (``spike_guard.resume_hint``)."""
        ckpt = self.checkpointer
        if not ckpt.enable or not isinstance(ckpt, HybridCheckpointManager):
            return resume_hint(None, None)
        return resume_hint(ckpt.folder, ckpt.newest_step)

    def post_dataloading_process(self, input_dict, labels):
        inputs, labels, extra = self.sequence.preprocess(input_dict, labels)
        # Count after CP sharding so ntokens reflects what this rank processes.
        self.ntokens_seen += labels.numel()
        if torch.is_grad_enabled():  # training, not validation
            valid = (labels != IGNORE_INDEX).sum()
            self._rank_tokens = valid if self._rank_tokens is None else self._rank_tokens + valid
        return inputs, labels, extra

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        """A loader tensor on the device without waiting for it: copied from pinned memory (the
        loader's own with ``[dataloader] pin_memory``, else pinned here), ``non_blocking``."""
        if self.device.type == "cuda" and not t.is_pinned():
            t = t.pin_memory()
        return t.to(self.device, non_blocking=True)

    def train_step(self, data_iterator):
        """torchtitan 0.3.0's ``Trainer.train_step`` without its two synchronisations (the step is
        one function there, so it is restated here in its order):

        * inputs, labels and positions go to the device pinned and ``non_blocking``
          (``to_device``), not with a blocking ``.to(device)`` each;
        * the valid-token count is the batches' ``HostMetadata.valid_tokens`` (counted by the
          loader) and reaches the device as a fill, not a blocking copy of a host tensor.

        Under pipeline parallelism each gradient-accumulation step is
        ``num_pipeline_parallel_microbatches`` loader batches (each one pipeline microbatch
        with its own host metadata), handed to the schedule together, as torchtitan does.

        The loss, gradient norm and (with data parallelism) the global token count are still read
        at log steps (every ``metrics.log_freq`` steps), as torchtitan does; see
        docs/PERFORMANCE.md. ``scripts/gpu_check.sh --all`` (``trainer_sync``) checks whole steps.
        """
        self.sequence.stats.take()  # counters cover this step only (not validation before it)
        self._step_loss = None
        self._rank_loss_sum = self._rank_tokens = None  # global_max_loss counts this step only
        self._update_skipped = False
        pd = self.parallel_dims
        self.optimizers.zero_grad(set_to_none=self.config.training.disable_cuda_graphs)
        lr_metrics = self.lr_schedulers.get_metrics()
        should_log = self.metrics_processor.should_log(self.step)

        groups: list[list[tuple[dict[str, Any], torch.Tensor]]] = []
        local_valid_tokens = 0
        for _ in range(self.gradient_accumulation_steps):
            group = []
            for _ in range(self.num_pipeline_parallel_microbatches):
                with sl.log_trace_span("fetching_batch"):
                    input_dict, labels = next(data_iterator)
                local_valid_tokens += _host_valid_tokens(input_dict, labels)
                group.append((input_dict, labels))
            groups.append(group)
        sl.log_trace_scalar({"local_valid_tokens": local_valid_tokens})
        count = torch.full((), local_valid_tokens, dtype=torch.int64, device=self.device)
        if pd.dp_enabled:
            count = dist_utils.dist_sum_tensor(count, pd.get_mesh("batch"))
        global_valid_tokens = count

        accumulated_loss: torch.Tensor | None = None
        for group in groups:
            inputs = [
                {k: self.to_device(v) if isinstance(v, torch.Tensor) else v for k, v in d.items()}
                for d, _ in group
            ]
            labels = [self.to_device(lab) for _, lab in group]
            loss = self.forward_backward_step(
                input_dict=inputs if pd.pp_enabled else inputs[0],
                labels=labels if pd.pp_enabled else labels[0],
                global_valid_tokens=global_valid_tokens,
            )
            if should_log:
                loss = loss.detach()
                accumulated_loss = (
                    loss.clone() if accumulated_loss is None else (accumulated_loss.add_(loss))
                )

        with sl.log_trace_span("optim"):
            grad_norm = dist_utils.clip_grad_norm_(
                [p for m in self.model_parts for p in m.parameters()],
                self.config.training.max_norm,
                foreach=True,
                pp_mesh=pd.get_optional_mesh("pp"),
                ep_enabled=pd.ep_enabled,
            )
            self.checkpointer.maybe_wait_for_staging()
            self.optimizers.step()
            self.lr_schedulers.step()
        if not self._update_skipped:
            self._note_finite()
        if should_log:
            assert accumulated_loss is not None
            self._log_step(
                accumulated_loss, global_valid_tokens, local_valid_tokens, grad_norm, lr_metrics
            )

    def _log_step(
        self,
        accumulated_loss: torch.Tensor,
        global_valid_tokens: torch.Tensor,
        local_valid_tokens: int,
        grad_norm: torch.Tensor,
        lr_metrics: dict[str, Any],
    ) -> None:
        """torchtitan's end of a log step: global average and max loss, tokens seen, the
        finite-loss check. These read the device (the step's only synchronisations)."""
        pd = self.parallel_dims
        self._stop_if_not_finite()  # this step's, and those since the last log step
        with sl.log_trace_span("collect_dist_metrics"):
            total = int(global_valid_tokens) if pd.dp_enabled else local_valid_tokens
            sl.log_trace_scalar({"global_valid_tokens": total})
            if pd.dp_cp_enabled:
                # accumulated_loss = local loss sum / global valid tokens: summed over the loss
                # mesh it is the global average; rescaled by the local count, the local one.
                mesh = pd.get_optional_mesh("loss")
                ntokens = torch.tensor(self.ntokens_seen, dtype=torch.int64, device=self.device)
                global_avg_loss = dist_utils.dist_sum(accumulated_loss, mesh)
                global_max_loss = self._global_max_loss()  # per-rank averages, one all-reduce
                global_ntokens_seen = dist_utils.dist_sum(ntokens, mesh)
            else:  # one rank: its own average is the maximum
                global_avg_loss = global_max_loss = float(accumulated_loss.item())
                global_ntokens_seen = self.ntokens_seen
        if not math.isfinite(global_avg_loss) and not self._update_skipped:
            # torchtitan's NaN guard, as one line naming the step and where to resume
            raise non_finite_error(self.step, global_avg_loss, resume=self._resume_hint())
        self.metrics_processor.log(
            self.step,
            global_avg_loss,
            global_max_loss,
            float(grad_norm.item()),
            extra_metrics={"n_tokens_seen": global_ntokens_seen, **lr_metrics},
        )

    def _note_finite(self) -> None:
        """Remember on the device whether this step applied an update from a non-finite loss,
        without reading it: between log steps (``metrics.log_freq`` > 1) torchtitan reads no
        loss, and a step that leaves nan in the parameters must still never be saved.
        ``_first_non_finite`` holds ``2 * step + isinf`` of the first such step (nan before
        inf within a step), ``_NONE`` while there is none."""
        loss = self._rank_loss_sum
        if loss is None:
            return
        loss = loss.detach().sum()
        key = torch.where(
            torch.isfinite(loss), _NONE, 2 * self.step + torch.isinf(loss).to(torch.int64)
        )
        first = self._first_non_finite
        self._first_non_finite = key if first is None else torch.minimum(first, key)

    def _stop_if_not_finite(self) -> None:
        """The one read of ``_note_finite``'s marker, on every rank together (at log steps,
        before a checkpoint is written, after the last step): a minimum over all ranks (under
        pipeline parallelism only the last stage has a loss), then the run's one line."""
        if self._first_non_finite is None:
            return
        key = self._first_non_finite.clone()
        self._first_non_finite = None
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(key, op=dist.ReduceOp.MIN)
        first = int(key.item())
        if first != _NONE:
            loss = math.inf if first % 2 else math.nan
            raise non_finite_error(first // 2, loss, resume=self._resume_hint())

    def _global_max_loss(self) -> float:
        """The largest per-rank average loss of the step: each rank's loss sum over its own
        valid tokens (its CP shard of its data-parallel batch), maximised over the loss mesh.
        torchtitan's own divides a CP shard's loss by the whole row's tokens, which under CP
        falls below the average loss."""
        assert self._rank_loss_sum is not None and self._rank_tokens is not None
        local = self._rank_loss_sum / self._rank_tokens.clamp(min=1)
        pd = self.parallel_dims
        mesh = pd.get_optional_mesh("loss") if pd.dp_cp_enabled else None
        return dist_utils.dist_max(local, mesh) if mesh is not None else float(local.item())

    def _routing_metrics(self, prefix: str) -> dict[str, Any]:
        """Routing counters since the last call; readbacks and build time are the worst rank's
        (a collective: every rank calls this at the same log step). On the training device: on
        CUDA the default group is NCCL only, which has no CPU backend."""
        stats = self.sequence.stats.take()
        cache = self.sequence.cache.stats()
        local = torch.tensor(
            [stats["readbacks"], stats["build_ms"]], dtype=torch.float64, device=self.device
        )
        if dist.is_initialized():
            dist.all_reduce(local, op=dist.ReduceOp.MAX)
        local = local.cpu()  # one copy for both values (a log step synchronises anyway)
        return {
            f"{prefix}/source": stats["source"],
            f"{prefix}/microbatches": stats["microbatches"],
            f"{prefix}/readbacks": int(local[0]),
            f"{prefix}/build_ms": float(local[1]),
            f"{prefix}/cache_hits": cache["hits"],
            f"{prefix}/cache_misses": cache["misses"],
            f"{prefix}/cache_evictions": cache["evictions"],
        }

    def _extra_metrics(self) -> dict[str, Any]:
        out = self._routing_metrics("routing")
        if self.report_compile:
            out.update(compile_counters())
        if self.spike_guard is not None:
            out["spike_guard/skipped_steps"] = self.spike_guard.skipped
        if self.param_checksums:
            out["params_sha256"] = tensors_sha256(self.model_parts, grads=False)
            out["grads_sha256"] = tensors_sha256(self.model_parts, grads=True)
        return out

    def _validation_metrics(self) -> dict[str, Any]:
        return self._routing_metrics("validation_routing")


def recipe_config() -> HybridTrainer.Config:
    """Recipe defaults (the TOML and the command line override any field)."""
    return HybridTrainer.Config(
        hf_assets_path=str(ASSETS / "tokenizer"),
        model=ModelRecipe(),
        loss=ChunkedLossWrapper.Config(loss_fn=CrossEntropyLoss.Config(global_vocab_size=1)),
        optimizer=default_adamw(lr=3e-3),
        lr_scheduler=LRSchedulersContainer.Config(
            warmup_steps=2, decay_ratio=0.8, decay_type="linear", min_lr_factor=0.1
        ),
        training=TrainingConfig(
            local_batch_size=2,
            seq_len=256,
            steps=20,
            # The model takes a per-microbatch SequenceContext kwarg, which CUDA-graph capture
            # of the forward/backward rejects.
            disable_cuda_graphs=True,
        ),
        dataloader=PackedTextDataLoader.Config(),
        metrics=HybridMetricsProcessor.Config(log_freq=1),
        parallelism=RecipeParallelism(
            spmd_backend="partial_dtensor", context_parallel_load_balancer="headtail"
        ),
        checkpoint=HybridCheckpointManager.Config(interval=10, last_save_model_only=False),
        activation_checkpoint=None,
        validator=HybridValidator.Config(freq=10, steps=4),
    )
