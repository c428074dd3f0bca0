"""The SSD kernels as ``torch.library`` custom ops (``ops/common/custom_ops.py`` says why):

==========================================  ==============================================
op (namespace ``torchtitan_cp``)            backward
==========================================  ==============================================
``ssd_torch`` (PyTorch)                     ``ssd_torch_bwd``: re-runs the forward under
                                            autograd (costs one extra forward)
``ssd_fla`` (fla-core's simple GLA or GLA,  ``ssd_fla_bwd``: fla's own backward on the
CUDA)                                       cumulative gate the forward returned (GLA's
                                            intra-chunk scores recomputed, one kernel)
==========================================  ==============================================

The fla ops hand fla's internal functions contiguous tensors only (``common.fla.contiguous``)
and return only memory fla wrote (tests/test_fla_interpreter.py checks both on CPU, with
opcheck and compiled against eager).

Shapes and conventions are those of ``ops.ssd.local`` (docs/CONTRACTS.md), except that the fla
ops take q/k already repeated to the value heads (fla's GLA has one q/k head per value head;
the repeat stays in the traced graph, so autograd sums its gradient) and a float32 gate. The fla
ops call fla's forward and backward pieces inside ``fla_compat.chunk_tables`` (the routing's
chunk tables, no host sync), with fla's chunk size ``FLA_CHUNK_SIZE``.
"""

from __future__ import annotations

import importlib
from functools import partial
from typing import Any

import torch
from torch import Tensor

from ..common import custom_ops as shared
from ..common.custom_ops import NS
from ..common.fla import FLA_CHUNK_SIZE, chunk_table, contiguous, fla_chunk_indices
from .torch_kernel import chunk_ssd_torch

__all__ = ["ssd_fla_op", "ssd_torch_op"]


# ----------------------------------------------------------------------------- SSD, torch


@torch.library.custom_op(f"{NS}::ssd_torch", mutates_args=())
def ssd_torch_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    initial_state: Tensor | None,
    cu_seqlens_cpu: Tensor | None,
    scale: float,
) -> tuple[Tensor, Tensor]:
    """``chunk_ssd_torch``; returns ``(o [1,T,HV,V], final_state [N,HV,K,V])`` (the final state
    always: it costs nothing extra here and keeps one output signature)."""
    o, final = chunk_ssd_torch(
        q,
        k,
        v,
        g,
        scale=scale,
        initial_state=initial_state,
        output_final_state=True,
        cu_seqlens_cpu=cu_seqlens_cpu,
    )
    return shared.op_outputs(o, final, initial_state)


@ssd_torch_op.register_fake
def _(q, k, v, g, initial_state, cu_seqlens_cpu, scale):
    return v.new_empty(v.shape), shared.state_like((q, k, v), cu_seqlens_cpu)


@torch.library.custom_op(f"{NS}::ssd_torch_bwd", mutates_args=())
def ssd_torch_bwd_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    initial_state: Tensor | None,
    cu_seqlens_cpu: Tensor | None,
    do: Tensor | None,
    dfinal: Tensor | None,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients ``(dq, dk, dv, dg, dh0)`` by re-running the forward under autograd (dh0 is
    ``[N,HV,K,V]`` zeros without an initial state)."""
    kernel = partial(
        chunk_ssd_torch, scale=scale, output_final_state=True, cu_seqlens_cpu=cu_seqlens_cpu
    )
    grads = shared.recompute_grads(kernel, (q, k, v, g), initial_state, cu_seqlens_cpu, do, dfinal)
    return grads  # type: ignore[return-value]


@ssd_torch_bwd_op.register_fake
def _(q, k, v, g, initial_state, cu_seqlens_cpu, do, dfinal, scale):
    return shared.recompute_grads_fake((q, k, v, g), initial_state, cu_seqlens_cpu)


shared.register_recompute_autograd(ssd_torch_op, ssd_torch_bwd_op, num_options=1)  # scale


# ----------------------------------------------------------------------------- SSD, fla


def _fla(name: str) -> Any:
    """fla-core 0.6.0's ``fla.ops.<module>:<function>``, imported at the call (fla loads Triton);
    typed Any: fla's decorators hide its internal functions' signatures."""
    module, function = name.split(":")
    return getattr(importlib.import_module(f"fla.ops.{module}"), function)


def _tables(
    cu_seqlens: Tensor | None,
    cu_seqlens_cpu: Tensor | None,
    chunk_indices: Tensor | None,
    chunk_offsets: Tensor | None,
    num_tokens: int,
) -> tuple[Tensor | None, Tensor | None]:
    """The routing's chunk table cut to its real rows (or fla's own, a host sync) and the chunk
    offsets checked against the host offsets; None, None for a single sequence."""
    if cu_seqlens is None:
        return None, None
    if chunk_offsets is not None:
        chunk_table(cu_seqlens_cpu, num_tokens, None, chunk_offsets)  # shape check only
    return fla_chunk_indices(cu_seqlens, cu_seqlens_cpu, chunk_indices, num_tokens), chunk_offsets


@torch.library.custom_op(f"{NS}::ssd_fla", mutates_args=())
def ssd_fla_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    initial_state: Tensor | None,
    cu_seqlens: Tensor | None,
    cu_seqlens_cpu: Tensor | None,
    chunk_indices: Tensor | None,
    chunk_offsets: Tensor | None,
    scale: float,
    output_final_state: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """fla-core's simple-GLA (g ``[1,T,HV]``) or GLA (g ``[1,T,HV,K]``) forward on q, k, v
    ``[1,T,HV,·]`` and a float32 gate. Returns ``(o, final_state, g_cumsum)``: the output in
    q's dtype, the float32 final states ``[N,HV,K,V]`` (``[0]`` when not requested) and the
    chunk-local cumulative gate fla's backward reads instead of recomputing. (GLA's
    intra-chunk scores are not returned: fla writes only their causal part, and an op output
    must be fully written; the backward recomputes them.)"""
    from fla.ops.utils.constant import RCP_LN2

    from ..fla_compat import chunk_tables

    q, k, v, g, initial_state = contiguous(q, k, v, g, initial_state)
    ci, co = _tables(cu_seqlens, cu_seqlens_cpu, chunk_indices, chunk_offsets, q.shape[1])
    kw = dict(
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        cu_seqlens=cu_seqlens,
        chunk_size=FLA_CHUNK_SIZE,
        chunk_indices=ci,
    )
    with chunk_tables(cu_seqlens, cu_seqlens_cpu, ci, co):
        if g.dim() == 4:
            g_cum, _, _, final, o = _fla("gla.chunk:chunk_gla_fwd")(q, k, v, g, None, **kw)
        else:  # fla pre-scales the gate by 1/ln 2 so its kernels use exp2
            g_cum = _fla("utils:chunk_local_cumsum")(
                g, chunk_size=FLA_CHUNK_SIZE, scale=RCP_LN2, cu_seqlens=cu_seqlens, chunk_indices=ci
            )
            o, final = _fla("simple_gla.chunk:chunk_simple_gla_fwd")(q, k, v, g_cum, **kw)
    if final is None:
        final = shared.absent_state(q)
    return o.to(q.dtype), final, g_cum


@ssd_fla_op.register_fake
def _(
    q,
    k,
    v,
    g,
    initial_state,
    cu_seqlens,
    cu_seqlens_cpu,
    chunk_indices,
    chunk_offsets,
    scale,
    output_final_state,
):
    final = shared.fla_final_fake(q, v, cu_seqlens, output_final_state)
    return q.new_empty(v.shape), final, g.new_empty(g.shape, dtype=torch.float32)


@torch.library.custom_op(f"{NS}::ssd_fla_bwd", mutates_args=())
def ssd_fla_bwd_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g_cumsum: Tensor,
    initial_state: Tensor | None,
    cu_seqlens: Tensor | None,
    cu_seqlens_cpu: Tensor | None,
    chunk_indices: Tensor | None,
    chunk_offsets: Tensor | None,
    do: Tensor,
    dfinal: Tensor | None,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """fla-core's own simple-GLA or GLA backward: ``(dq, dk, dv, dg, dh0)``, dg float32 for the
    forward's gate, dh0 ``[0]`` without an initial state."""
    from ..fla_compat import chunk_tables

    ci, co = _tables(cu_seqlens, cu_seqlens_cpu, chunk_indices, chunk_offsets, q.shape[1])
    q, k, v, g_cumsum, initial_state, do, dfinal = contiguous(
        q, k, v, g_cumsum, initial_state, do, dfinal
    )
    kw = dict(cu_seqlens=cu_seqlens, chunk_size=FLA_CHUNK_SIZE, chunk_indices=ci)
    with chunk_tables(cu_seqlens, cu_seqlens_cpu, ci, co):
        if g_cumsum.dim() == 4:
            A = _fla("gla.chunk:chunk_gla_fwd_intra_gk")(q, k, g_cumsum, scale, **kw)
            dq, dk, dv, dg, dh0 = _fla("gla.chunk:chunk_gla_bwd")(
                q, k, v, None, g_cumsum, scale, initial_state, None, A, do, dfinal, **kw
            )
        else:
            dq, dk, dv, dg, dh0 = _fla("simple_gla.chunk:chunk_simple_gla_bwd")(
                q, k, v, g_cumsum, None, initial_state, do, dfinal, scale, **kw
            )
            dg = _fla("utils:chunk_local_cumsum")(
                dg, chunk_size=FLA_CHUNK_SIZE, reverse=True, cu_seqlens=cu_seqlens, chunk_indices=ci
            )
    dh0 = shared.fla_state_grad(dh0, initial_state, q)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dg.float(), dh0


@ssd_fla_bwd_op.register_fake
def _(
    q,
    k,
    v,
    g_cumsum,
    initial_state,
    cu_seqlens,
    cu_seqlens_cpu,
    chunk_indices,
    chunk_offsets,
    do,
    dfinal,
    scale,
):
    return shared.fla_grads_fake((q, k, v, g_cumsum), initial_state)


def _setup_ssd_fla(ctx, inputs, output) -> None:
    q, k, v, g, h0, cu, cu_cpu, ci, co, scale, _ = inputs
    ctx.save_for_backward(q, k, v, output[2], h0, cu, cu_cpu, ci, co)
    ctx.scale, ctx.g_dtype = scale, g.dtype


def _backward_ssd_fla(ctx, do, dfinal, _):
    q, k, v, g_cum, h0, cu, cu_cpu, ci, co = ctx.saved_tensors
    if dfinal is not None and dfinal.numel() == 0:
        dfinal = None
    dq, dk, dv, dg, dh0 = ssd_fla_bwd_op(
        q, k, v, g_cum, h0, cu, cu_cpu, ci, co, do, dfinal, ctx.scale
    )
    dh0 = dh0 if h0 is not None else None
    return dq, dk, dv, dg.to(ctx.g_dtype), dh0, None, None, None, None, None, None


ssd_fla_op.register_autograd(_backward_ssd_fla, setup_context=_setup_ssd_fla)
