"""The short conv on fla-core's Triton ``causal_conv1d`` (CUDA; CPU tensors only under Triton's
interpreter, in the fla_interpreter test tier). fla loads on first call."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from ..common.fla import chunk_table, device_cu_seqlens

__all__ = ["causal_conv1d_fla"]


def causal_conv1d_fla(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    *,
    cu_seqlens: Tensor | None = None,
    cu_seqlens_cpu: Tensor | None = None,
    chunk_indices: Tensor | None = None,
    initial_state: Tensor | None = None,
    activation: str | None = "silu",
) -> Tensor:
    """``fla.modules.causal_conv1d.causal_conv1d`` (Triton backend) with our state layout.

    ``chunk_indices [NT, 2]`` int32 on x's device: the chunk table of ``cu_seqlens`` (fla's conv
    uses the same 64-token chunks as the delta-rule kernels, forward and backward).

    Our ``initial_state`` is ``[N, D, W-1]`` (the W-1 tokens before each sequence, oldest first);
    FLA's cache is ``[N, D, W]`` whose last W-1 columns are those same tokens (column 0 is never
    read by the forward), so we left-pad by one zero column. Autograd slices the gradient back.
    """
    from fla.modules.causal_conv1d import causal_conv1d

    cu_seqlens, cu_seqlens_cpu = device_cu_seqlens(cu_seqlens, cu_seqlens_cpu, x.device)
    if cu_seqlens is None and chunk_indices is not None:
        raise ValueError("chunk_indices needs cu_seqlens")
    chunk_indices = chunk_table(cu_seqlens_cpu, x.shape[1], chunk_indices, None)
    if initial_state is not None:
        initial_state = F.pad(initial_state.to(x.dtype), (1, 0))
    # fla.modules re-exports shadow the submodule name for type checkers; it is the function.
    y, _ = causal_conv1d(  # pyrefly: ignore[not-callable]
        x,
        weight=weight,
        bias=bias,
        initial_state=initial_state,
        output_final_state=False,
        activation=activation,
        backend="triton",
        cu_seqlens=cu_seqlens,
        cu_seqlens_cpu=cu_seqlens_cpu,
        chunk_indices=chunk_indices,
    )
    return y
