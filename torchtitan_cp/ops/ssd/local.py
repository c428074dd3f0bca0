"""SSD's local (single-rank) kernel: checks and the backend choice (torch or fla).

Shapes and the recurrence: ``ops/ssd/recurrence.py``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from ..common import checks
from ..common.checks import Backend, TokenInput
from ..common.custom_ops import op_args
from . import custom_ops
from .fla_kernel import chunk_ssd_fla
from .torch_kernel import chunk_ssd_torch

__all__ = ["chunk_ssd"]


def chunk_ssd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    *,
    scale: float | None = None,
    initial_state: Tensor | Callable[[], Tensor | None] | None = None,
    output_final_state: bool = False,
    cu_seqlens: Tensor | None = None,
    cu_seqlens_cpu: Tensor | None = None,
    backend: Backend = "auto",
    chunk_indices: Tensor | None = None,
    chunk_offsets: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """SSD over packed sequences.

    Args:
        q, k: ``[1, T, H, K]`` (Mamba2's C and B, H groups); v: ``[1, T, HV, V]``, HV a
            multiple of H; g: natural-log decay ≤ 0, ``[1, T, HV]`` (a gate per head: Mamba2,
            simple GLA) or ``[1, T, HV, K]`` (per head and key: FLA's GLA).
        scale: query scale, default ``K ** -0.5`` (Mamba2 uses 1.0).
        initial_state: ``[N, HV, K, V]``, one per sequence (zeros when None), or a thunk
            returning it (the CP driver's, which waits for its all-gather): the eager torch
            kernel calls it once its state-independent work is issued, the others at once.
        cu_seqlens / cu_seqlens_cpu: ``[N+1]`` offsets on the device / host.
        backend: "auto" (fla on CUDA, torch otherwise), "torch" or "fla".
        chunk_indices, chunk_offsets: ``[NT, 2]`` int32 / ``[N+1]`` int64 chunk tables of
            cu_seqlens on its device (``DeviceRouting.chunk_indices`` ...), so the fla kernels
            derive nothing from cu_seqlens on the host; the torch backend does not need them.

    Returns:
        ``(o [1, T, HV, V], final_state [N, HV, K, V] float32/float64 or None)``.
    """
    gate = TokenInput(g, ("HV", "K") if g.dim() == 4 else ("HV",), " (per head or per key)")
    late = callable(initial_state)  # checked where made (the CP driver's fold)
    call = checks.check_local(
        q, k, v, {"g": gate}, None if late else initial_state, cu_seqlens, cu_seqlens_cpu, backend
    )
    if call.backend == "torch" and not torch.compiler.is_compiling():
        o, fin = chunk_ssd_torch(
            q,
            k,
            v,
            g,
            scale=scale,
            initial_state=initial_state,
            output_final_state=output_final_state,
            cu_seqlens=cu_seqlens,
            cu_seqlens_cpu=cu_seqlens_cpu,
        )
        assert o is not None
        return o, fin
    # The other kernels take the entry states up front.
    h0 = initial_state() if callable(initial_state) else initial_state
    if torch.compiler.is_compiling():
        # While dynamo traces, the kernel runs as the custom ops of ``ssd.custom_ops`` (opaque
        # to the compiler, no graph break); eager calls keep their plain autograd.
        a = op_args(call.backend, call.K, scale, cu_seqlens, cu_seqlens_cpu, h0, q.device)
        if call.backend == "fla":
            rep = call.HV // call.H  # as chunk_ssd_fla: one q/k head per value head
            q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
            o, final, _ = custom_ops.ssd_fla_op(
                q,
                k,
                v,
                g.float(),
                a.initial_state,
                a.cu_seqlens,
                a.cu_seqlens_cpu,
                chunk_indices,
                chunk_offsets,
                a.scale,
                output_final_state,
            )
        else:
            o, final = custom_ops.ssd_torch_op(
                q, k, v, g, a.initial_state, a.cu_seqlens_cpu, a.scale
            )
        return o, (final if output_final_state else None)
    return chunk_ssd_fla(
        q,
        k,
        v,
        g,
        scale,
        h0,
        output_final_state,
        cu_seqlens,
        cu_seqlens_cpu,
        chunk_indices=chunk_indices,
        chunk_offsets=chunk_offsets,
    )
