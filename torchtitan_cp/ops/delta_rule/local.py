"""Local (single-rank) delta-rule kernel with FLA conventions.

``backend="auto"`` picks fla-core's Triton kernels for CUDA tensors and the pure-PyTorch
implementation (``ops.delta_rule.torch_kernel``) otherwise. ``backend="fla"`` takes CPU tensors
only while Triton's interpreter is on (``TRITON_INTERPRET=1``: the ``fla_interpreter`` test
tier). See docs/CONTRACTS.md ("ops/ local kernels") for the exact contract and docs/kernels.md
for the algorithm.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from ..common import checks
from ..common.checks import Backend, TokenInput
from ..common.custom_ops import op_args
from ..cp.recurrence import SequenceTables
from . import custom_ops, fla_kernel
from .torch_kernel import chunk_delta_rule_torch

Kind = Literal["kda", "gdn"]

__all__ = ["Backend", "Kind", "chunk_delta_rule"]


def chunk_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    kind: Kind,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Tensor | None = None,
    cu_seqlens_cpu: Tensor | None = None,
    chunk_indices: Tensor | None = None,
    chunk_offsets: Tensor | None = None,
    backend: Backend = "auto",
) -> tuple[Tensor, Tensor | None]:
    """Gated delta rule over packed sequences (KDA per-channel gate or GDN scalar gate).

    Per sequence and value head: ``S_t = (I - beta_t k_t k_tᵀ) Diag(exp g_t) S_{t-1}
    + beta_t k_t v_tᵀ``, ``o_t = S_tᵀ (scale q_t)``.

    Args:
        q, k: ``[1, T, H, K]`` (already l2-normalised by the caller).
        v: ``[1, T, HV, V]``, HV a multiple of H.
        g: natural-log decay ≤ 0: ``[1, T, HV, K]`` (kda) or ``[1, T, HV]`` (gdn).
        beta: ``[1, T, HV]``.
        scale: query scale, default ``K ** -0.5``.
        initial_state: ``[N, HV, K, V]``, one per sequence (zeros when None).
        output_final_state: also return the state after every sequence.
        cu_seqlens: ``[N+1]`` int offsets on the tensors' device; cu_seqlens_cpu: the same on
            the host (avoids a device→host copy). Zero-length sequences are allowed.
        chunk_indices, chunk_offsets: ``[NT, 2]`` int32 / ``[N+1]`` int64 chunk tables of
            cu_seqlens on its device (``DeviceRouting.chunk_indices`` ...), so the fla kernels
            derive nothing from cu_seqlens on the host; the torch backend does not need them.
        backend: "auto" (fla on CUDA, torch otherwise), "torch" or "fla".

    Returns:
        ``(o [1, T, HV, V], final_state [N, HV, K, V] float32/float64 or None)``.
    """
    if kind not in ("kda", "gdn"):
        raise ValueError(f"kind must be 'kda' or 'gdn', got {kind!r}")
    gate = TokenInput(g, ("HV", "K") if kind == "kda" else ("HV",), f" for kind={kind!r}")
    call = checks.check_local(
        q,
        k,
        v,
        {"g": gate, "beta": TokenInput(beta, ("HV",))},
        initial_state,
        cu_seqlens,
        cu_seqlens_cpu,
        backend,
    )
    if torch.compiler.is_compiling():
        # While dynamo traces, the kernel runs as the custom ops of ``delta_rule.custom_ops``
        # (opaque to the compiler, no graph break); eager calls keep their plain autograd.
        a = op_args(
            call.backend, call.K, scale, cu_seqlens, cu_seqlens_cpu, initial_state, q.device
        )
        if call.backend == "fla":
            inputs = (q, k, v, g, beta)
            factors = custom_ops.prepare_op_call(inputs, a, chunk_indices, kind)
            return custom_ops.local_op_call(
                inputs, factors, a, chunk_indices, kind, output_final_state
            )
        o, final = custom_ops.delta_rule_torch_op(
            q, k, v, g, beta, a.initial_state, a.cu_seqlens_cpu, kind, a.scale
        )
        return o, (final if output_final_state else None)
    if call.backend == "fla":
        # No offsets (None, None): one dense sequence, as fla takes it.
        tables = SequenceTables(cu_seqlens, cu_seqlens_cpu, chunk_indices, chunk_offsets)  # pyrefly: ignore[bad-argument-type]
        return fla_kernel.chunk_delta_rule_fla(
            (q, k, v, g, beta),
            tables,
            kind=kind,
            scale=scale,
            initial_state=initial_state,
            output_final_state=output_final_state,
        )
    return chunk_delta_rule_torch(
        q,
        k,
        v,
        g,
        beta,
        kind=kind,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        cu_seqlens=cu_seqlens,
        cu_seqlens_cpu=cu_seqlens_cpu,
    )
