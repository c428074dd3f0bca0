"""Thin adapters from our local-kernel signatures to fla-core's Triton kernels (CUDA only).

fla is imported inside the functions, so importing this module (or ``ops.local``) on a CPU-only
machine never loads Triton kernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["causal_conv1d_fla", "chunk_delta_rule_fla"]


def _device_cu_seqlens(
    cu_seqlens: Tensor | None, cu_seqlens_cpu: Tensor | None, device: torch.device
) -> tuple[Tensor | None, Tensor | None]:
    """(device offsets, host offsets) as FLA wants them; None, None for a single sequence."""
    if cu_seqlens is None and cu_seqlens_cpu is None:
        return None, None
    if cu_seqlens is None:
        cu_seqlens = cu_seqlens_cpu.to(device, non_blocking=True)
    elif cu_seqlens.device != device:
        if cu_seqlens_cpu is None and cu_seqlens.device.type == "cpu":
            cu_seqlens_cpu = cu_seqlens
        cu_seqlens = cu_seqlens.to(device, non_blocking=True)
    return cu_seqlens, cu_seqlens_cpu


def chunk_delta_rule_fla(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    kind: str,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Tensor | None = None,
    cu_seqlens_cpu: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """``fla.ops.kda.chunk_kda`` (kind="kda") or ``chunk_gated_delta_rule`` (kind="gdn").

    Same shapes as ``ops.local.chunk_delta_rule``; gates are already natural-log decays and q/k
    already normalised, so all of FLA's in-kernel gate / l2norm / sigmoid options stay off.
    States are float32 ``[N, HV, K, V]``.
    """
    cu_seqlens, cu_seqlens_cpu = _device_cu_seqlens(cu_seqlens, cu_seqlens_cpu, q.device)
    if initial_state is not None:
        initial_state = initial_state.float()
    kwargs = dict(
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        cu_seqlens=cu_seqlens,
        cu_seqlens_cpu=cu_seqlens_cpu,
    )
    if kind == "kda":
        from fla.ops.kda import chunk_kda

        return chunk_kda(q, k, v, g, beta, **kwargs)
    if kind == "gdn":
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        return chunk_gated_delta_rule(q, k, v, g, beta, **kwargs)
    raise ValueError(f"kind must be 'kda' or 'gdn', got {kind!r}")


def causal_conv1d_fla(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    *,
    cu_seqlens: Tensor | None = None,
    cu_seqlens_cpu: Tensor | None = None,
    initial_state: Tensor | None = None,
    activation: str | None = "silu",
) -> Tensor:
    """``fla.modules.causal_conv1d.causal_conv1d`` (Triton backend) with our state layout.

    Our ``initial_state`` is ``[N, D, W-1]`` (the W-1 tokens before each sequence, oldest first);
    FLA's cache is ``[N, D, W]`` whose last W-1 columns are those same tokens (column 0 is never
    read by the forward), so we left-pad by one zero column. Autograd slices the gradient back.
    """
    from fla.modules.causal_conv1d import causal_conv1d

    cu_seqlens, cu_seqlens_cpu = _device_cu_seqlens(cu_seqlens, cu_seqlens_cpu, x.device)
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
    )
    return y
