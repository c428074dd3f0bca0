"""What the op families' ``torch.library`` custom ops share, so ``torch.compile`` keeps them opaque.

Under ``torch.compile`` (torchtitan compiles every block with ``fullgraph=True``) the kernels
cannot be traced: the pure-PyTorch ones read their ``cu_seqlens_cpu`` back as Python ints and
loop over them, fla-core's entry points are ``torch.compiler.disable``d. Each kernel is therefore
a custom op (``ops/<family>/custom_ops.py``) with a fake (shape-only) implementation and a
registered autograd formula whose backward is another custom op.

Eager runs do not go through these ops (the local kernels call them only while compiling), so the
eager path keeps its plain autograd. Every op takes optional tensors as ``Tensor | None``
arguments, so a new precomputed index (fla's ``chunk_indices``, ...) is one more optional argument
on the forward op, saved in ``_setup_*`` and passed on by its backward op. An argument's shape is
part of the compiled graph's guards, though: an index whose length follows the layout (fla's chunk
indices are ``[number of chunks, 2]``) recompiles per layout unless it is padded to a fixed size.
So ``DeviceRouting.chunk_indices`` is padded to a layout-independent row count when the routing
has caps, and ``common.fla.fla_chunk_indices`` cuts it to the real chunk count inside the op (from
the host offsets, where shapes are invisible to the compiler); given no table, the op falls back
to fla's own helper (a host sync per call).

Only APIs present since torch 2.4 are used (``torch.library.custom_op``, ``register_fake``,
``register_autograd``), so the ops load on the GPU image's torch 2.11 as well.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator
from typing import Any, NamedTuple

import torch
from torch import Tensor

from . import checks
from .dtypes import compute_dtype
from .fla import device_cu_seqlens

__all__ = [
    "OpArgs",
    "NS",
    "absent_state",
    "autograd_inside_op",
    "fla_final_fake",
    "fla_grads_fake",
    "fla_state_grad",
    "input_grads",
    "num_seqs",
    "op_args",
    "op_offsets",
    "op_outputs",
    "recompute_grads",
    "recompute_grads_fake",
    "register_recompute_autograd",
    "state_like",
]

NS = "torchtitan_cp"
"""The custom ops' namespace (``torch.ops.torchtitan_cp``)."""


def num_seqs(cu_seqlens: Tensor | None) -> int:
    """N of ``cu_seqlens [N+1]`` (1 without offsets)."""
    # A shape, not a value: stays static (or symbolic) under tracing.
    return 1 if cu_seqlens is None else cu_seqlens.shape[0] - 1


def op_offsets(
    backend: str, cu_seqlens: Tensor | None, cu_seqlens_cpu: Tensor | None, device: torch.device
) -> tuple[Tensor | None, Tensor | None]:
    """``(device offsets, host offsets)`` as a family's ops take them under torch.compile: the
    host copy always (``checks.host_offsets``), the device copy for the fla ops only."""
    cu_cpu = checks.host_offsets(cu_seqlens, cu_seqlens_cpu)
    if backend != "fla":
        return None, cu_cpu
    return device_cu_seqlens(cu_seqlens, cu_cpu, device)


class OpArgs(NamedTuple):
    """The arguments every family's custom ops share (``op_args``)."""

    scale: float
    cu_seqlens: Tensor | None
    cu_seqlens_cpu: Tensor | None
    initial_state: Tensor | None


def op_args(
    backend: str,
    K: int,
    scale: float | None,
    cu_seqlens: Tensor | None,
    cu_seqlens_cpu: Tensor | None,
    initial_state: Tensor | None,
    device: torch.device,
) -> OpArgs:
    """What a local kernel passes its custom op while dynamo traces: the scale (default
    ``K ** -0.5``, a float in the schema), ``op_offsets`` and the initial state (float32 for the
    fla ops, whose kernels keep states in float32)."""
    scale = K**-0.5 if scale is None else float(scale)
    cu_dev, cu_cpu = op_offsets(backend, cu_seqlens, cu_seqlens_cpu, device)
    if backend == "fla" and initial_state is not None:
        initial_state = initial_state.float()
    return OpArgs(scale, cu_dev, cu_cpu, initial_state)


@contextlib.contextmanager
def autograd_inside_op() -> Generator[None]:
    """Record autograd inside a custom op's kernel. The dispatcher runs kernels with the
    autograd keys excluded (and grad mode off); the recomputing backward ops need both back."""
    keys = torch._C.DispatchKeySet(torch._C.DispatchKey.AutogradFunctionality) | (
        torch._C.DispatchKeySet(torch._C.DispatchKey.ADInplaceOrView)
    )
    include = torch._C._dispatch_tls_local_include_set()
    exclude = torch._C._dispatch_tls_local_exclude_set() - keys
    with torch._C._ForceDispatchKeyGuard(include, exclude), torch.enable_grad():
        yield


def input_grads(
    outputs: list[Tensor], cotangents: list[Tensor | None], inputs: list[Tensor]
) -> list[Tensor]:
    """``d outputs / d inputs`` for the given cotangents; zeros where an input is unused."""
    pairs = [(o, c) for o, c in zip(outputs, cotangents) if c is not None and o.requires_grad]
    if not pairs:
        return [torch.zeros_like(x) for x in inputs]
    got = torch.autograd.grad(
        [o for o, _ in pairs], inputs, [c for _, c in pairs], allow_unused=True
    )
    return [torch.zeros_like(x) if g is None else g for x, g in zip(inputs, got)]


# ------------------------------------------------------------------ fla-core kernels as ops
# fla returns None for a state it was not asked for; an op's schema output cannot be None, so
# the fla ops of every family return ``[0]`` float32 in its place.


def absent_state(like: Tensor) -> Tensor:
    """The ``[0]`` float32 an fla op returns for a state fla did not compute."""
    return like.new_empty(0, dtype=torch.float32)


def fla_final_fake(q: Tensor, v: Tensor, cu_seqlens: Tensor | None, wanted: bool) -> Tensor:
    """The fake of an fla forward op's final states: float32 ``[N, HV, K, V]`` when ``wanted``
    (``output_final_state``), else ``absent_state``."""
    if not wanted:
        return absent_state(q)
    return q.new_empty(
        num_seqs(cu_seqlens), v.shape[2], q.shape[3], v.shape[3], dtype=torch.float32
    )


def fla_state_grad(dh0: Tensor | None, initial_state: Tensor | None, like: Tensor) -> Tensor:
    """An fla backward op's entry-state gradient: in the initial state's dtype, or
    ``absent_state`` when the forward had none."""
    if dh0 is None or initial_state is None:
        return absent_state(like)
    return dh0.to(initial_state.dtype)


def fla_grads_fake(inputs: tuple[Tensor, ...], initial_state: Tensor | None) -> tuple[Tensor, ...]:
    """The fake of an fla backward op: each input's gradient, then ``fla_state_grad``'s."""
    if initial_state is None:
        dh0 = absent_state(inputs[0])
    else:
        dh0 = initial_state.new_empty(initial_state.shape)
    return (*(x.new_empty(x.shape) for x in inputs), dh0)


# ------------------------------------------------- PyTorch kernels as ops (recompute backward)
# The torch kernels of every family (delta rule, SSD) take ``(q, k, v, ...)`` with q ``[1, T, H,
# K]`` and v ``[1, T, HV, V]``, keep states ``[N, HV, K, V]`` in the compute dtype, and run as a
# forward op that always returns the final state plus a backward op that re-runs the forward
# under autograd. What is the same for all of them lives here.

Kernel = Callable[..., tuple[Tensor | None, Tensor | None]]
"""``kernel(*inputs, initial_state=h0) -> (o, final)`` with the output and the final state."""


def state_like(
    inputs: tuple[Tensor, ...], cu_seqlens: Tensor | None, zeros: bool = False
) -> Tensor:
    """A state ``[N, HV, K, V]`` for ``inputs = (q, k, v, ...)`` in q's compute dtype: empty
    (for a fake) or zeros (the entry state when the caller gives none)."""
    q, v = inputs[0], inputs[2]
    new = q.new_zeros if zeros else q.new_empty
    shape = (num_seqs(cu_seqlens), v.shape[2], q.shape[3], v.shape[3])
    return new(shape, dtype=compute_dtype(q.dtype))


def op_outputs(
    o: Tensor | None, final: Tensor | None, initial_state: Tensor | None
) -> tuple[Tensor, Tensor]:
    """A forward op's ``(o, final)``; ``final`` copied where the kernel returned the entry state
    itself (zero-length sequences): an op output must not alias an input."""
    assert o is not None and final is not None  # output_final_state=True
    if initial_state is not None and final.data_ptr() == initial_state.data_ptr():
        final = final.clone()
    return o.contiguous(), final.contiguous()


def recompute_grads(
    kernel: Kernel,
    inputs: tuple[Tensor, ...],
    initial_state: Tensor | None,
    cu_seqlens_cpu: Tensor | None,
    do: Tensor | None,
    dfinal: Tensor | None,
) -> tuple[Tensor, ...]:
    """A backward op's body: ``(d inputs..., dh0)`` by re-running ``kernel`` under autograd, each
    in its input's dtype; without an initial state, dh0 ``[N, HV, K, V]`` is the gradient at a
    zero entry state."""
    h0 = state_like(inputs, cu_seqlens_cpu, zeros=True) if initial_state is None else initial_state
    primals = (*inputs, h0)
    leaves = [x.detach().requires_grad_(True) for x in primals]
    with autograd_inside_op():
        o, final = kernel(*leaves[:-1], initial_state=leaves[-1])
        assert o is not None and final is not None
        grads = input_grads([o, final], [do, dfinal], leaves)
    # Contiguous whatever the inputs' strides: the fakes say so (``new_empty``).
    return tuple(gr.to(x.dtype).contiguous() for gr, x in zip(grads, primals))


def recompute_grads_fake(
    inputs: tuple[Tensor, ...], initial_state: Tensor | None, cu_seqlens_cpu: Tensor | None
) -> tuple[Tensor, ...]:
    """The fake of ``recompute_grads``: its outputs' shapes and dtypes."""
    if initial_state is None:
        dh0 = state_like(inputs, cu_seqlens_cpu)
    else:
        dh0 = initial_state.new_empty(initial_state.shape)
    return tuple(x.new_empty(x.shape) for x in inputs) + (dh0,)


def register_recompute_autograd(op: Any, backward_op: Any, num_options: int) -> None:
    """Register ``op``'s autograd as a call of ``backward_op``, the pattern of every torch-kernel
    op pair: ``op(*inputs, initial_state, cu_seqlens_cpu, *options)`` saves its tensors (None
    allowed) and keeps its ``num_options`` trailing non-tensor arguments;
    ``backward_op(*tensors, do, dfinal, *options)`` returns ``(d inputs..., dh0)``, and dh0 is
    dropped when the op had no initial state (offsets and options have no gradient)."""

    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        cut = len(inputs) - num_options
        ctx.save_for_backward(*inputs[:cut])
        ctx.options = inputs[cut:]

    def backward(ctx: Any, do: Tensor, dfinal: Tensor) -> tuple[Tensor | None, ...]:
        saved = ctx.saved_tensors
        *grads, dh0 = backward_op(*saved, do, dfinal, *ctx.options)
        h0 = saved[-2]  # (..., initial_state, cu_seqlens_cpu)
        return (*grads, dh0 if h0 is not None else None, None, *(None,) * num_options)

    op.register_autograd(backward, setup_context=setup_context)
