"""SSD's local (single-rank) kernel: checks and the backend choice (torch or fla).

Shapes and the recurrence: ``ops/ssd/recurrence.py``.
"""

from __future__ import annotations

from torch import Tensor

from ..common import checks
from ..common.checks import Backend
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
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Tensor | None = None,
    cu_seqlens_cpu: Tensor | None = None,
    backend: Backend = "auto",
) -> tuple[Tensor, Tensor | None]:
    """SSD over packed sequences.

    Args:
        q, k: ``[1, T, H, K]`` (Mamba2's C and B, H groups); v: ``[1, T, HV, V]``, HV a
            multiple of H; g: natural-log decay ≤ 0, ``[1, T, HV]``.
        scale: query scale, default ``K ** -0.5`` (Mamba2 uses 1.0).
        initial_state: ``[N, HV, K, V]``, one per sequence (zeros when None).
        cu_seqlens / cu_seqlens_cpu: ``[N+1]`` offsets on the device / host.
        backend: "auto" (fla on CUDA, torch otherwise), "torch" or "fla".

    Returns:
        ``(o [1, T, HV, V], final_state [N, HV, K, V] float32/float64 or None)``.
    """
    T, H, K, HV, V = checks.check_heads(q, k, v)
    if list(g.shape) != [1, T, HV]:
        raise ValueError(f"g must be {[1, T, HV]}, got shape {checks.shape(g)}")
    N = checks.check_cu_seqlens(T, cu_seqlens, cu_seqlens_cpu)
    checks.check_initial_state(initial_state, N, HV, K, V)
    if checks.resolve_backend(backend, q) == "fla":
        return chunk_ssd_fla(q, k, v, g, scale, initial_state, output_final_state, cu_seqlens,
                              cu_seqlens_cpu)  # fmt: skip
    o, fin = chunk_ssd_torch(
        q, k, v, g, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, cu_seqlens=cu_seqlens,
        cu_seqlens_cpu=cu_seqlens_cpu,
    )  # fmt: skip
    assert o is not None
    return o, fin
