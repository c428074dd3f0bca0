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
from collections.abc import Generator

import torch
from torch import Tensor

__all__ = ["NS", "autograd_inside_op", "input_grads", "num_seqs"]

NS = "torchtitan_cp"
"""The custom ops' namespace (``torch.ops.torchtitan_cp``)."""


def num_seqs(cu_seqlens: Tensor | None) -> int:
    """N of ``cu_seqlens [N+1]`` (1 without offsets)."""
    # A shape, not a value: stays static (or symbolic) under tracing.
    return 1 if cu_seqlens is None else cu_seqlens.shape[0] - 1


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
