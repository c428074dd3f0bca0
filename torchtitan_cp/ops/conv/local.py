"""Local (single-rank) short causal convolution with FLA conventions.

``backend="auto"`` picks fla-core's Triton kernel for CUDA tensors and the pure-PyTorch
implementation (``ops.conv.torch_kernel``) otherwise; ``backend="fla"`` takes CPU tensors only
while Triton's interpreter is on (the ``fla_interpreter`` test tier). See docs/CONTRACTS.md
("ops/ local kernels").
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from ..common import checks
from ..common.checks import Backend
from . import custom_ops
from .torch_kernel import causal_conv1d_torch

__all__ = ["causal_conv1d"]


def causal_conv1d(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    *,
    cu_seqlens: Tensor | None = None,
    cu_seqlens_cpu: Tensor | None = None,
    chunk_indices: Tensor | None = None,
    initial_state: Tensor | None = None,
    activation: Literal["silu"] | None = "silu",
    backend: Backend = "auto",
) -> Tensor:
    """Causal depthwise conv within every sequence, optional SiLU.

    Args:
        x: ``[1, T, D]``; weight ``[D, W]`` (column W-1 multiplies the current token);
            bias ``[D]`` or None.
        cu_seqlens / cu_seqlens_cpu: ``[N+1]`` offsets (device / host), as for chunk_delta_rule.
        chunk_indices: ``[NT, 2]`` int32 chunk table of cu_seqlens, as for chunk_delta_rule.
        initial_state: ``[N, D, W-1]``, the W-1 tokens before each sequence, oldest first
            (zeros where a sequence has no history; None = zeros everywhere).
        activation: "silu" or None.
        backend: "auto" (fla on CUDA, torch otherwise), "torch" or "fla".

    Returns:
        ``[1, T, D]`` in x's dtype.
    """
    if x.dim() != 3 or x.shape[0] != 1:
        raise ValueError(f"x must be [1, T, D], got shape {checks.shape(x)}")
    _, T, D = x.shape
    if weight.dim() != 2 or weight.shape[0] != D or weight.shape[1] < 1:
        raise ValueError(f"weight must be [D={D}, W], got shape {checks.shape(weight)}")
    W = weight.shape[1]
    if bias is not None and list(bias.shape) != [D]:
        raise ValueError(f"bias must be [{D}], got shape {checks.shape(bias)}")
    if activation not in ("silu", "swish", None):
        raise ValueError(f"activation must be 'silu' or None, got {activation!r}")
    N = checks.check_cu_seqlens(T, cu_seqlens, cu_seqlens_cpu)
    if initial_state is not None:
        ok = initial_state.dim() == 3 and list(initial_state.shape[1:]) == [D, W - 1]
        if not ok or (N is not None and initial_state.shape[0] != N):
            want = [N if N is not None else "N", D, W - 1]
            raise ValueError(
                f"initial_state must be {want}, got shape {checks.shape(initial_state)}"
            )
    kwargs = dict(
        cu_seqlens=cu_seqlens,
        cu_seqlens_cpu=cu_seqlens_cpu,
        initial_state=initial_state,
        activation=activation,
    )
    resolved = checks.resolve_backend(backend, x)
    if torch.compiler.is_compiling():
        return _compiled_conv(resolved, x, weight, bias, chunk_indices=chunk_indices, **kwargs)
    if resolved == "fla":
        from .fla_kernel import causal_conv1d_fla

        return causal_conv1d_fla(x, weight, bias, chunk_indices=chunk_indices, **kwargs)
    return causal_conv1d_torch(x, weight, bias, **kwargs)


# ----------------------------------------------------------------------------- torch.compile
# While dynamo traces, the kernel runs as the custom ops of ``conv.custom_ops`` (opaque to the
# compiler, no graph break); eager calls above keep their plain autograd.


def _compiled_conv(
    backend: str,
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    *,
    cu_seqlens: Tensor | None,
    cu_seqlens_cpu: Tensor | None,
    initial_state: Tensor | None,
    activation: str | None,
    chunk_indices: Tensor | None = None,
) -> Tensor:
    act = "none" if activation is None else "silu"
    cu_cpu = checks.host_offsets(cu_seqlens, cu_seqlens_cpu)
    if backend == "fla":
        from ..common.fla import device_cu_seqlens

        cu_dev, cu_cpu = device_cu_seqlens(cu_seqlens, cu_cpu, x.device)
        # fla's cache layout [N, D, W]: one leading zero column (see conv.fla_kernel).
        h0 = F.pad(initial_state.to(x.dtype), (1, 0)) if initial_state is not None else None
        return custom_ops.causal_conv1d_fla_op(
            x, weight, bias, h0, cu_dev, cu_cpu, chunk_indices, act
        )
    return custom_ops.causal_conv1d_torch_op(x, weight, bias, initial_state, cu_cpu, act)
