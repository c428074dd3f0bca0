"""Input checks and the backend choice every op family's local kernel shares.

``backend="auto"`` picks fla-core's Triton kernels for CUDA tensors and the pure-PyTorch ones
otherwise; ``backend="fla"`` takes CPU tensors only while Triton's interpreter is on (the
``fla_interpreter`` test tier). The checks read offsets only from a host copy, so they never
synchronise.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from .fla import triton_interpreter_on

Backend = Literal["auto", "torch", "fla"]
BACKENDS = ("auto", "torch", "fla")

__all__ = ["BACKENDS", "Backend", "check_cu_seqlens", "host_offsets", "resolve_backend", "shape"]


def shape(t: Tensor) -> str:
    """``t``'s shape as a list, for error messages."""
    return str(list(t.shape))


def resolve_backend(backend: str, x: Tensor) -> str:
    """``"torch"`` or ``"fla"`` for ``backend`` on ``x``'s device (``auto``: fla on CUDA)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "fla" if x.is_cuda else "torch"
    if (
        backend == "fla"
        and not x.is_cuda
        and not (x.device.type == "cpu" and triton_interpreter_on())
    ):
        # CPU tensors only under Triton's interpreter: the test tier, never a normal CPU run.
        raise ValueError(f"backend='fla' needs CUDA tensors (fla-core is Triton), got {x.device}")
    return backend


def check_cu_seqlens(
    total: int, cu_seqlens: Tensor | None, cu_seqlens_cpu: Tensor | None
) -> int | None:
    """Validate sequence offsets; returns N (number of sequences), or None if unknown on host.

    Values are only checked from a host copy, so a CUDA ``cu_seqlens`` alone costs no sync.
    """
    for name, cu in (("cu_seqlens", cu_seqlens), ("cu_seqlens_cpu", cu_seqlens_cpu)):
        if cu is not None and (cu.dim() != 1 or cu.numel() < 2):
            raise ValueError(f"{name} must be 1-D with N+1 >= 2 entries, got shape {shape(cu)}")
        if cu is not None and cu.is_floating_point():
            raise ValueError(f"{name} must be an integer tensor, got {cu.dtype}")
    if cu_seqlens is None and cu_seqlens_cpu is None:
        return 1
    host = cu_seqlens_cpu
    if host is None and cu_seqlens is not None and cu_seqlens.device.type == "cpu":
        host = cu_seqlens
    if cu_seqlens is not None and cu_seqlens_cpu is not None:
        if cu_seqlens.numel() != cu_seqlens_cpu.numel():
            raise ValueError(
                f"cu_seqlens {shape(cu_seqlens)} and cu_seqlens_cpu {shape(cu_seqlens_cpu)} differ"
            )
    if host is None or torch.compiler.is_compiling():
        # Under torch.compile the values are data, not constants: reading them would guard on
        # every microbatch's layout. The shapes above are all a compiled graph can check.
        return None
    cu = host.tolist()
    if cu[0] != 0 or cu[-1] != total or any(b < a for a, b in zip(cu[:-1], cu[1:])):
        raise ValueError(
            f"cu_seqlens must start at 0, end at T={total} and be non-decreasing, got {cu}"
        )
    return len(cu) - 1


def host_offsets(cu_seqlens: Tensor | None, cu_seqlens_cpu: Tensor | None) -> Tensor | None:
    """The host copy of the offsets a compiled kernel needs (a CPU ``cu_seqlens`` serves)."""
    if cu_seqlens_cpu is not None or cu_seqlens is None:
        return cu_seqlens_cpu
    if cu_seqlens.device.type != "cpu":
        raise ValueError(
            "under torch.compile the local kernels need cu_seqlens_cpu (the host copy of "
            "cu_seqlens): reading device offsets back would break the graph"
        )
    return cu_seqlens
