"""fla-core 0.6.0 compatibility: the one place that reaches below fla's public functions.

Imported only by ``ops.delta_rule.fla_kernel`` inside its function (it loads fla, hence Triton).

Reason: ``fla.ops.kda.chunk_kda`` 0.6.0 has no ``chunk_indices`` parameter; its autograd
Function always calls ``prepare_chunk_indices``, which ends in a blocking pageable host-to-device
copy (a host sync per call). :func:`chunk_kda_indexed` is the same computation with the chunk
table (and chunk offsets) supplied by the caller: fla's own ``chunk_kda_fwd`` /
``chunk_kda_bwd`` with every option chunk_kda would pass for our call (no in-kernel l2norm, gate
or beta sigmoid; no CP context; no graph mode). Tested in tests/test_fla_indices.py.
"""

from __future__ import annotations

import torch
from fla.ops.kda.chunk_bwd import chunk_kda_bwd
from fla.ops.kda.chunk_fwd import chunk_kda_fwd
from fla.utils import autocast_custom_bwd, autocast_custom_fwd, input_guard
from torch import Tensor

from .common.fla import FLA_CHUNK_SIZE, contiguous

__all__ = ["chunk_kda_indexed"]


class _ChunkKDAIndexed(torch.autograd.Function):
    # Saved-for-backward set and gradient dtypes follow fla's ChunkKDAFunction for these options.
    # fla's decorators are typed for functions returning one Tensor, hence the ignores.

    @staticmethod
    @input_guard  # pyrefly: ignore[bad-argument-type]
    @autocast_custom_fwd
    def forward(ctx, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                cu_seqlens_cpu, chunk_indices, chunk_offsets):  # fmt: skip
        o, final_state, g_cumsum, Aqk, Akk, *_ = chunk_kda_fwd(
            q=q,
            k=k,
            v=v,
            g=g,
            beta=beta,
            scale=scale,
            initial_state=initial_state,
            output_final_state=output_final_state,
            cu_seqlens=cu_seqlens,
            cu_seqlens_cpu=cu_seqlens_cpu,
            chunk_indices=chunk_indices,
            chunk_offsets=chunk_offsets,
            chunk_size=FLA_CHUNK_SIZE,
        )
        ctx.save_for_backward(q, k, v, g_cumsum, g, beta, Aqk, Akk, initial_state, cu_seqlens,
                              chunk_indices, chunk_offsets)  # fmt: skip
        ctx.scale = scale
        return o.type_as(q), final_state

    @staticmethod
    @input_guard  # pyrefly: ignore[bad-argument-type]
    @autocast_custom_bwd
    def backward(ctx, do, dht):  # pyrefly: ignore[bad-override]
        q, k, v, g_cumsum, g, beta, Aqk, Akk, h0, cu, ci, co = ctx.saved_tensors
        # Explicit, not left to input_guard: chunk_kda_bwd assumes contiguous rows, and the
        # cotangents can be expanded views (a reduction's backward). A no-op when contiguous.
        q, k, v, g_cumsum, beta, Aqk, Akk, h0, do, dht = contiguous(
            q, k, v, g_cumsum, beta, Aqk, Akk, h0, do, dht
        )
        dq, dk, dv, db, dg, dh0, _, _ = chunk_kda_bwd(
            q=q,
            k=k,
            v=v,
            beta=beta,
            Aqk=Aqk,
            Akk=Akk,
            scale=ctx.scale,
            initial_state=h0,
            do=do,
            dht=dht,
            g=g_cumsum,
            cu_seqlens=cu,
            chunk_indices=ci,
            chunk_offsets=co,
            chunk_size=FLA_CHUNK_SIZE,
        )
        grads = (dq.to(q), dk.to(k), dv.to(v), dg.to(g), db.to(beta), None, dh0)  # pyrefly: ignore[missing-attribute]
        return grads + (None,) * 5


# Opaque to dynamo exactly like the public chunk_kda it stands in for.
@torch.compiler.disable
def chunk_kda_indexed(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    scale: float | None,
    initial_state: Tensor | None,
    output_final_state: bool,
    cu_seqlens: Tensor,
    cu_seqlens_cpu: Tensor | None,
    chunk_indices: Tensor,
    chunk_offsets: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """``chunk_kda`` (pre-computed natural-log gate, post-sigmoid beta, normalised q/k) over
    packed sequences with the caller's chunk table.

    Shapes as ``chunk_kda``: q, k ``[1,T,H,K]``; v ``[1,T,HV,V]``; g ``[1,T,HV,K]``; beta
    ``[1,T,HV]``; initial_state float32 ``[N,HV,K,V]``; cu_seqlens ``[N+1]`` on q's device;
    chunk_indices ``[NT,2]`` and chunk_offsets ``[N+1]`` (``routing.chunks`` with
    ``FLA_CHUNK_SIZE``) on q's device. Returns ``(o [1,T,HV,V], final_state [N,HV,K,V] | None)``.
    """
    K = q.shape[-1]
    if K > 256:
        raise ValueError(f"fla's KDA kernels support head dim K <= 256, got K={K}")
    if initial_state is not None and initial_state.dtype != torch.float32:
        raise ValueError(f"initial_state must be float32 for fla, got {initial_state.dtype}")
    # Contiguous before fla's forward (which saves them for chunk_kda_bwd); v is usually a
    # split view of the conv output.
    q, k, v, g, beta, initial_state = contiguous(q, k, v, g, beta, initial_state)
    return _ChunkKDAIndexed.apply(
        q,
        k,
        v,
        g,
        beta,
        K**-0.5 if scale is None else scale,
        initial_state,
        output_final_state,
        cu_seqlens,
        cu_seqlens_cpu,
        chunk_indices,
        chunk_offsets,
    )
