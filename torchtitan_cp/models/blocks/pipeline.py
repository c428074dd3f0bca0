"""Pipeline parallelism for the recipe's decoders: where the stage boundaries fall
(``StagePlan``, from ``parallelism.pipeline_parallel_split`` or the cost model) and the split
itself, through torchtitan 0.3.0's pipelining (its module split, its ``PipelineStage`` per
stage, its schedules).

Nothing about the routing crosses stages: every stage is called with each pipeline
microbatch's own ``seq_ctx`` (built on its host from the loader's metadata by the trainer's
preprocessor), so the stages exchange activations only.

The cost model of the default placement, per token of a row of ``seq_len`` tokens (training
FLOPs, forward and backward): a block costs ``6 x the parameters a token runs`` (its matmuls;
``params_per_token``: an MoE layer's top-k share of its experts) plus its mixer's
own ``LayerKind.flops(cfg, seq_len)``: softmax attention ``12 x heads x head_dim x seq_len``
(QK^T and PV over the causal context, documents not masked out, so an upper bound), the
linear-attention kinds a constant per token (their chunked recurrences' state work). The LM
head (``6 x dim x vocab``) counts on the last stage, the embedding (a lookup) as nothing. The
default cuts the pattern into contiguous stages that minimise the largest stage's cost.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = [
    "SPLIT_MARK",
    "StagePlan",
    "balanced_boundaries",
    "decoder_stage_plan",
    "params_per_token",
    "pipeline_decoder",
    "pipeline_stages",
    "schedule_problem",
    "stage_count",
]

SPLIT_MARK = "|"
"""The stage boundary in ``parallelism.pipeline_parallel_split`` (``KG|MRA``)."""

SPLIT_KEY = "parallelism.pipeline_parallel_split"


def stage_count(schedule: str, pp: int) -> tuple[int, str]:
    """The stages a ``pp``-rank pipeline of ``schedule`` (a torch schedule name) has by default,
    and what the schedule needs of them (for messages): single-stage schedules one per rank,
    the V schedules exactly two, the other looped ones two or more (default two)."""
    from torch.distributed.pipelining.schedules import (
        PipelineScheduleSingle,
        ScheduleDualPipeV,
        ScheduleZBVZeroBubble,
        get_schedule_class,
    )

    cls = get_schedule_class(schedule)
    if issubclass(cls, PipelineScheduleSingle):
        return pp, "one stage per rank"
    if cls in (ScheduleZBVZeroBubble, ScheduleDualPipeV):
        return 2 * pp, "exactly two stages per rank"
    return 2 * pp, "two or more stages per rank"


def pipeline_stages(parallelism: Any) -> int:
    """The stages of the run's pipeline: ``parallelism.pipeline_parallel_split``'s when set,
    else the schedule's default (``stage_count``)."""
    split = getattr(parallelism, "pipeline_parallel_split", "")
    if split:
        return len(split.split(SPLIT_MARK))
    return stage_count(
        parallelism.pipeline_parallel_schedule, parallelism.pipeline_parallel_degree
    )[0]


def schedule_problem(schedule: str, pp: int, n_stages: int, n_microbatches: int) -> str | None:
    """Why torch's ``schedule`` cannot run ``n_stages`` stages on ``pp`` ranks with
    ``n_microbatches`` pipeline microbatches (its own constructors' rules, found before any rank
    starts), or None."""
    from torch.distributed.pipelining.schedules import (
        PipelineScheduleSingle,
        ScheduleDualPipeV,
        ScheduleInterleaved1F1B,
        ScheduleInterleavedZeroBubble,
        ScheduleZBVZeroBubble,
        get_schedule_class,
    )

    cls = get_schedule_class(schedule)
    per_rank, need = n_stages // pp, stage_count(schedule, pp)[1]
    if n_stages % pp:
        return f"{n_stages} stages do not divide over {pp} pipeline ranks"
    single = issubclass(cls, PipelineScheduleSingle)
    v_shape = cls in (ScheduleZBVZeroBubble, ScheduleDualPipeV)
    if (single and per_rank != 1) or (v_shape and per_rank != 2) or (not single and per_rank < 2):
        return f"it runs {need}, and {n_stages} stages on {pp} ranks are {per_rank} per rank"
    if single and n_microbatches < pp:
        return f"it needs at least as many microbatches as stages ({pp}), got {n_microbatches}"
    if cls is ScheduleDualPipeV and n_microbatches < n_stages:
        return f"it needs at least {n_stages} microbatches (one per stage), got {n_microbatches}"
    if cls in (ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble):
        rounds = max(1, n_microbatches // pp)
        if n_microbatches % rounds:
            return (
                f"its microbatches come in rounds of {pp} (the pipeline ranks): "
                f"{n_microbatches} is not a multiple of its {rounds} rounds"
            )
    return None


def balanced_boundaries(costs: Sequence[float], n_stages: int) -> tuple[int, ...]:
    """Cut ``costs`` (one per unit, in order) into ``n_stages`` contiguous non-empty parts
    minimising the largest part's sum (ties: the earliest cuts); returns each part's first
    index after the first part's. Exact (dynamic programming over prefix sums, O(n^2 S))."""
    n = len(costs)
    assert 1 <= n_stages <= n, (n_stages, n)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[s][i]: the least largest part over cuts of the first i units into s parts
    best = [[inf] * (n + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, n_stages + 1):
        for i in range(s, n - (n_stages - s) + 1):
            for j in range(s - 1, i):
                worst = max(best[s - 1][j], prefix[i] - prefix[j])
                if worst < best[s][i]:
                    best[s][i], cut[s][i] = worst, j
    bounds, i = [], n
    for s in range(n_stages, 1, -1):
        i = cut[s][i]
        bounds.append(i)
    return tuple(reversed(bounds))


@dataclass(frozen=True)
class StagePlan:
    """Which layers each pipeline stage holds: ``pattern`` (one letter per layer) cut at
    ``boundaries`` (each stage's first layer, the first stage's 0 left out); ``costs``: each
    stage's training FLOPs per token under the cost model (the head's on the last)."""

    pattern: str
    boundaries: tuple[int, ...]
    costs: tuple[int, ...]
    source: str  # "parallelism.pipeline_parallel_split" or "cost model"

    @property
    def ranges(self) -> list[range]:
        edges = [0, *self.boundaries, len(self.pattern)]
        return [range(a, b) for a, b in zip(edges, edges[1:])]

    def split_text(self) -> str:
        """``KG|MRA``."""
        return SPLIT_MARK.join(self.pattern[r.start : r.stop] for r in self.ranges)

    def text(self) -> str:
        """One line for ``--check``: the split, its source and each stage's cost."""
        worst = max(self.costs)
        per = ", ".join(f"{c / 1e6:.3g}" for c in self.costs)
        return (
            f"{self.split_text()} ({self.source}; MFLOPs/token per stage {per}; the largest "
            f"{worst / (sum(self.costs) / len(self.costs)):.3f} x the mean)"
        )

    def module_names(self, layers: str = "layers") -> list[list[str]]:
        """torchtitan's ``module_fqns_per_model_part``: the embedding with the first stage,
        the final norm and the LM head with the last."""
        names = [[f"{layers}.{i}" for i in r] for r in self.ranges]
        names[0].insert(0, "tok_embeddings")
        names[-1] += ["norm", "lm_head"]
        return names

    @classmethod
    def build(
        cls,
        pattern: str,
        layer_costs: Sequence[int],
        head_cost: int,
        n_stages: int,
        split: str = "",
        pattern_name: str = "model.layer_pattern",
    ) -> StagePlan:
        """The plan of ``n_stages`` stages: ``split`` (the pattern with ``|`` at each boundary)
        when set, else the cost model's balance of ``layer_costs`` (the head's ``head_cost``
        on the last stage). A ValueError naming ``parallelism.pipeline_parallel_split`` for a
        split that is not the pattern, has an empty stage or another count of stages.
        ``pattern_name``: what the messages call the pattern (a model without a
        ``layer_pattern`` key names where its letters come from)."""
        n = len(pattern)
        if n_stages > n:
            raise ValueError(
                f"{n_stages} pipeline stages for {n} layers ({pattern_name} {pattern!r}): "
                "every stage needs a layer; use fewer stages (pipeline_parallel_degree, the "
                "schedule's stages per rank) or more layers"
            )
        if split:
            parts = split.split(SPLIT_MARK)
            if "".join(parts) != pattern or any(not p for p in parts):
                raise ValueError(
                    f"{SPLIT_KEY} {split!r} must be {pattern_name} {pattern!r} with "
                    f"'{SPLIT_MARK}' between stages (no empty stage)"
                )
            if len(parts) != n_stages:
                raise ValueError(
                    f"{SPLIT_KEY} {split!r} has {len(parts)} stages, but this pipeline has "
                    f"{n_stages}; mark {n_stages - 1} boundaries"
                )
            bounds, at = [], 0
            for p in parts[:-1]:
                at += len(p)
                bounds.append(at)
            boundaries, source = tuple(bounds), SPLIT_KEY
        else:
            costs = list(layer_costs)
            # the head is no layer: balance with it added to the last layer's cost
            costs[-1] += head_cost
            boundaries, source = balanced_boundaries(costs, n_stages), "cost model"
        edges = [0, *boundaries, n]
        stage_costs = [sum(layer_costs[a:b]) for a, b in zip(edges, edges[1:])]
        stage_costs[-1] += head_cost
        return cls(pattern, boundaries, tuple(stage_costs), source)


def params_per_token(block: nn.Module) -> int:
    """The parameters one token runs through in ``block``: all of them, except that an MoE
    layer (a module with ``routed_experts`` and a ``router`` of ``top_k`` of ``num_experts``,
    torchtitan's ``MoE``) counts ``top_k / num_experts`` of its routed experts (its router and
    shared experts in full). Counting all experts would weigh a 256-expert layer 32 times what
    a token computes and hide the attention cost that grows with the context."""
    total = sum(p.numel() for p in block.parameters())
    for module in block.modules():
        experts = getattr(module, "routed_experts", None)
        router: Any = getattr(module, "router", None)
        if not isinstance(experts, nn.Module) or not hasattr(router, "top_k"):
            continue
        routed = sum(p.numel() for p in experts.parameters())
        total -= routed - routed * router.top_k // router.num_experts
    return total


def decoder_stage_plan(
    model: nn.Module,
    pattern: str,
    mixer_flops: Sequence[int],
    head_cost: int,
    n_stages: int,
    split: str = "",
    pattern_name: str = "model.layer_pattern",
) -> StagePlan:
    """``StagePlan.build`` for a decoder whose blocks are ``model.layers.<i>``, one letter of
    ``pattern`` each: block ``i`` costs ``6 x params_per_token + mixer_flops[i]`` FLOPs per
    token (the cost model above; an MoE block its routed experts' top-k share), the head
    ``head_cost`` (``6 x dim x vocab``)."""
    layers = model.get_submodule("layers")
    costs = [
        6 * params_per_token(layers.get_submodule(str(i))) + flops
        for i, flops in enumerate(mixer_flops)
    ]
    return StagePlan.build(pattern, costs, head_cost, n_stages, split, pattern_name)


def pipeline_decoder(
    model: nn.Module,
    *,
    plan_fn: Callable[[nn.Module, int, int, str], StagePlan],
    parallelize_fn: Callable[..., nn.Module],
    loss_fn: Callable,
    device: torch.device,
    **titan: Any,
) -> tuple[Any, list[nn.Module], bool, bool]:
    """torchtitan's ``pipelining_fn`` for a decoder whose stages ``plan_fn(model, n_stages,
    seq_len, split)`` places (``split``: ``parallelism.pipeline_parallel_split``): torchtitan's
    module split (each rank's stages, the V order for the V schedules), each stage
    parallelized by ``parallelize_fn`` (TP, CP, FSDP as without PP, on this stage's modules),
    and torchtitan's schedule over them. ``titan``: the rest of torchtitan's keywords
    (``parallel_dims``, ``training``, ``parallelism``, and those ``parallelize_fn`` takes).
    Returns ``(schedule, model parts, has first stage, has last stage)``, as torchtitan's own."""
    from torchtitan.distributed import pipeline_parallel as tt_pp

    parallel_dims, training, parallelism = (
        titan["parallel_dims"],
        titan["training"],
        titan["parallelism"],
    )
    split = getattr(parallelism, "pipeline_parallel_split", "")
    plan = plan_fn(model, pipeline_stages(parallelism), training.seq_len, split)
    stages, parts = tt_pp._pipeline_module_split(
        model,
        parallel_dims.get_mesh("pp"),
        parallelism.pipeline_parallel_schedule,
        device,
        plan.module_names(),
        get_mesh=tt_pp._build_get_mesh_callback(parallel_dims),
    )
    keys = ("parallel_dims", "training", "parallelism", "compile_config", "ac_config")
    for i, part in enumerate(parts):
        parts[i] = parallelize_fn(
            part, **{k: titan[k] for k in keys}, dump_folder=titan["dump_folder"]
        )
        stages[i].submod = parts[i]  # the stage runs the parallelized module
    schedule = tt_pp._build_pipeline_schedule(
        parallelism=parallelism,
        local_batch_size=training.local_batch_size,
        stages=stages,
        loss_fn=loss_fn,
    )
    first = any(s.is_first for s in stages)
    last = any(s.is_last for s in stages)
    return schedule, parts, first, last
