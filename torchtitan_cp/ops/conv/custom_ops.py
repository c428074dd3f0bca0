"""The short-conv kernels as ``torch.library`` custom ops (``ops/common/custom_ops.py`` says why):

==========================================  ==============================================
op (namespace ``torchtitan_cp``)            backward
==========================================  ==============================================
``causal_conv1d_torch`` (PyTorch)           ``causal_conv1d_torch_bwd``: re-runs the forward
                                            under autograd
``causal_conv1d_fla`` (fla-core, CUDA)      ``causal_conv1d_fla_bwd``: fla's
                                            ``causal_conv1d_bwd`` (no recompute)
==========================================  ==============================================

The fla ops hand fla's internal functions contiguous tensors only (``common.fla.contiguous``),
so compiled gradients equal eager ones and ``torch.library.opcheck`` passes
(tests/test_fla_interpreter.py). Shapes and conventions are those of ``ops.conv.local``
(docs/CONTRACTS.md).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..common.custom_ops import NS, autograd_inside_op, input_grads
from ..common.fla import contiguous, fla_chunk_indices
from .torch_kernel import causal_conv1d_torch

__all__ = ["causal_conv1d_fla_op", "causal_conv1d_torch_op"]


def _dense(t: Tensor) -> Tensor:
    """A contiguous tensor like ``t``: every op here returns contiguous outputs (the real ones
    call ``.contiguous()``, fla's kernels write contiguous buffers), so the fakes promise that
    layout, not the input's (``empty_like`` of a dense but permuted input would carry its
    strides, and inductor would plan for a layout the real op does not return)."""
    return t.new_empty(t.shape)


def _grads_fake(
    x: Tensor, weight: Tensor, bias: Tensor | None, initial_state: Tensor | None
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """A backward op's fake: ``(dx, dweight, dbias, dinitial_state)``, ``[0]`` where None."""
    db = _dense(bias) if bias is not None else x.new_empty(0)
    dh = _dense(initial_state) if initial_state is not None else x.new_empty(0)
    return _dense(x), _dense(weight), db, dh


# ----------------------------------------------------------------------------- conv, torch


@torch.library.custom_op(f"{NS}::causal_conv1d_torch", mutates_args=())
def causal_conv1d_torch_op(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    initial_state: Tensor | None,
    cu_seqlens_cpu: Tensor | None,
    activation: str,
) -> Tensor:
    """``causal_conv1d_torch`` (``activation`` "silu" or "none"); ``[1, T, D]``."""
    act = None if activation == "none" else activation
    return causal_conv1d_torch(
        x, weight, bias, cu_seqlens_cpu=cu_seqlens_cpu, initial_state=initial_state, activation=act
    ).contiguous()


@causal_conv1d_torch_op.register_fake
def _(x, weight, bias, initial_state, cu_seqlens_cpu, activation):
    return _dense(x)


@torch.library.custom_op(f"{NS}::causal_conv1d_torch_bwd", mutates_args=())
def causal_conv1d_torch_bwd_op(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    initial_state: Tensor | None,
    cu_seqlens_cpu: Tensor | None,
    dy: Tensor,
    activation: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(dx, dweight, dbias, dinitial_state)`` by re-running the forward under autograd;
    ``dbias`` / ``dinitial_state`` are empty ``[0]`` tensors where the input is None."""
    act = None if activation == "none" else activation
    present = [t for t in (x, weight, bias, initial_state) if t is not None]
    leaves = [t.detach().requires_grad_(True) for t in present]
    it = iter(leaves)
    lx, lw = next(it), next(it)
    lb = next(it) if bias is not None else None
    lh = next(it) if initial_state is not None else None
    with autograd_inside_op():
        y = causal_conv1d_torch(
            lx, lw, lb, cu_seqlens_cpu=cu_seqlens_cpu, initial_state=lh, activation=act
        )
        grads = iter(input_grads([y], [dy], leaves))
    dx, dw = next(grads), next(grads)
    db = next(grads) if bias is not None else x.new_empty(0)
    dh = next(grads) if initial_state is not None else x.new_empty(0)
    return dx.contiguous(), dw.contiguous(), db.contiguous(), dh.contiguous()


@causal_conv1d_torch_bwd_op.register_fake
def _(x, weight, bias, initial_state, cu_seqlens_cpu, dy, activation):
    return _grads_fake(x, weight, bias, initial_state)


def _setup_conv_torch(ctx, inputs, output) -> None:
    x, weight, bias, h0, cu_cpu, activation = inputs
    ctx.save_for_backward(x, weight, bias, h0, cu_cpu)
    ctx.activation = activation


def _backward_conv_torch(ctx, dy):
    x, weight, bias, h0, cu_cpu = ctx.saved_tensors
    dx, dw, db, dh = causal_conv1d_torch_bwd_op(x, weight, bias, h0, cu_cpu, dy, ctx.activation)
    return dx, dw, (db if bias is not None else None), (dh if h0 is not None else None), None, None


causal_conv1d_torch_op.register_autograd(_backward_conv_torch, setup_context=_setup_conv_torch)


# ----------------------------------------------------------------------------- conv, fla


@torch.library.custom_op(f"{NS}::causal_conv1d_fla", mutates_args=())
def causal_conv1d_fla_op(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    initial_state: Tensor | None,
    cu_seqlens: Tensor | None,
    cu_seqlens_cpu: Tensor | None,
    chunk_indices: Tensor | None,
    activation: str,
) -> Tensor:
    """fla-core's ``causal_conv1d_fwd`` (Triton); ``initial_state`` in fla's ``[N, D, W]``
    cache layout. ``[1, T, D]``."""
    from fla.modules.causal_conv1d.ops import causal_conv1d_fwd

    act = None if activation == "none" else activation
    # Contiguous inputs: fla's wrapper (not called here) would otherwise pick a layout fallback.
    x, weight, bias, initial_state = contiguous(x, weight, bias, initial_state)
    chunk_indices = fla_chunk_indices(cu_seqlens, cu_seqlens_cpu, chunk_indices, x.shape[1])
    y, _ = causal_conv1d_fwd(
        x=x,
        weight=weight,
        bias=bias,
        residual=None,
        initial_state=initial_state,
        output_final_state=False,
        activation=act,
        cu_seqlens=cu_seqlens,
        cu_seqlens_cpu=cu_seqlens_cpu,
        chunk_indices=chunk_indices,
    )
    return y


@causal_conv1d_fla_op.register_fake
def _(x, weight, bias, initial_state, cu_seqlens, cu_seqlens_cpu, chunk_indices, activation):
    return _dense(x)


@torch.library.custom_op(f"{NS}::causal_conv1d_fla_bwd", mutates_args=())
def causal_conv1d_fla_bwd_op(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    initial_state: Tensor | None,
    cu_seqlens: Tensor | None,
    cu_seqlens_cpu: Tensor | None,
    chunk_indices: Tensor | None,
    dy: Tensor,
    activation: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """fla-core's ``causal_conv1d_bwd``: ``(dx, dweight, dbias, dinitial_state)``, ``[0]`` for
    a missing bias / initial state."""
    from fla.modules.causal_conv1d.ops import causal_conv1d_bwd

    act = None if activation == "none" else activation
    x, weight, bias, initial_state, dy = contiguous(x, weight, bias, initial_state, dy)
    chunk_indices = fla_chunk_indices(cu_seqlens, cu_seqlens_cpu, chunk_indices, x.shape[1])
    dx, dw, db, _, dh0 = causal_conv1d_bwd(
        x=x,
        dy=dy,
        dht=None,
        weight=weight,
        bias=bias,
        residual=None,
        initial_state=initial_state,
        activation=act,
        cu_seqlens=cu_seqlens,
        cu_seqlens_cpu=cu_seqlens_cpu,
        chunk_indices=chunk_indices,
    )
    # Every gradient in its input's dtype, as the fake impl promises.
    db = db.to(bias.dtype) if (bias is not None and db is not None) else x.new_empty(0)
    if initial_state is not None and dh0 is not None:
        dh0 = dh0.to(initial_state.dtype)
    else:
        dh0 = x.new_empty(0)
    return dx.to(x.dtype), dw.to(weight.dtype), db, dh0


@causal_conv1d_fla_bwd_op.register_fake
def _(x, weight, bias, initial_state, cu_seqlens, cu_seqlens_cpu, chunk_indices, dy, activation):
    return _grads_fake(x, weight, bias, initial_state)


def _setup_conv_fla(ctx, inputs, output) -> None:
    x, weight, bias, h0, cu, cu_cpu, chunk_indices, activation = inputs
    ctx.save_for_backward(x, weight, bias, h0, cu, cu_cpu, chunk_indices)
    ctx.activation = activation


def _backward_conv_fla(ctx, dy):
    x, weight, bias, h0, cu, cu_cpu, chunk_indices = ctx.saved_tensors
    dx, dw, db, dh = causal_conv1d_fla_bwd_op(
        x, weight, bias, h0, cu, cu_cpu, chunk_indices, dy, ctx.activation
    )
    db = db if bias is not None else None
    dh = dh if h0 is not None else None
    return dx, dw, db, dh, None, None, None, None


causal_conv1d_fla_op.register_autograd(_backward_conv_fla, setup_context=_setup_conv_fla)
