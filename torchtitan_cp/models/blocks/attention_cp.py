"""How softmax attention's keys/values cross CP ranks (``[model] attention_cp``), for every
attention layer of the recipe (the hybrid decoder's and Qwen3.5's).

``all_gather`` (the default): every rank gathers the whole stream's K/V (flex: torchtitan's
``apply_cp_to_forward``; sdpa: ``ops.context_parallel_attention``). ``pass_kv``:
``ops.pass_kv_attention``, each rank keeps its own K/V and blocks travel point to point between
the ranks whose documents meet, over the host-planned schedule the ``SequenceContext`` carries;
the per-pair kernel is plain math on sdpa, flex on flex (docs/cp.md, "Pass-KV attention").
The modes themselves are named beside ``SequenceContext`` (``models.context``), which the
preprocessor builds for them.
"""

from __future__ import annotations

from typing import Literal

import torch

from torchtitan_cp.models.context import (
    ATTENTION_CP_MODES,
    DEFAULT_ATTENTION_CP,
    AttentionCP,
    SequenceContext,
    check_attention_cp,
)
from torchtitan_cp.ops import pass_kv_attention_op

__all__ = [
    "ATTENTION_CP_MODES",
    "DEFAULT_ATTENTION_CP",
    "AttentionCP",
    "check_attention_cp",
    "routed_pass_kv",
]


def routed_pass_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ctx: SequenceContext,
    backend: Literal["flex", "sdpa"],
    scale: float | None = None,
) -> torch.Tensor:
    """Pass-KV attention of ``q [1, T, Hq, D]``, ``k``/``v [1, T, Hkv, ·]`` over ``ctx``'s
    schedule; the per-pair kernel is flex on the flex backend, plain math on sdpa (which returns
    no log-sum-exp). Runs as one custom op (``ops.pass_kv_attention_op``), eager or compiled:
    a compiled block sees q, k, v and the schedule's handle, never the schedule, so every
    layout runs the same graph."""
    if ctx.pass_kv_handle is None or ctx.group is None:
        raise ValueError(
            "model.attention_cp = 'pass_kv' under context parallelism needs a SequenceContext "
            "with the pass-KV schedule (SequencePreprocessor(attention_cp='pass_kv') builds one)"
        )
    kernel = "flex" if backend == "flex" else "math"
    return pass_kv_attention_op(q, k, v, ctx.pass_kv_handle, ctx.group, scale=scale, kernel=kernel)
