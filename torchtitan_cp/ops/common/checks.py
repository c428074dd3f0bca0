"""Input checks and the backend choice every op family's local kernel shares.

``backend="auto"`` picks fla-core's Triton kernels for CUDA tensors and the pure-PyTorch ones
otherwise; ``backend="fla"`` takes CPU tensors only while Triton's interpreter is on (the
``fla_interpreter`` test tier). The checks read offsets only from a host copy, so they never
synchronise.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch
from torch import Tensor

from .fla import triton_interpreter_on

Backend = Literal["auto", "torch", "fla"]
BACKENDS = ("auto", "torch", "fla")

__all__ = [
    "BACKENDS",
    "Backend",
    "LocalCall",
    "TokenInput",
    "check_cu_seqlens",
    "check_heads",
    "check_initial_state",
    "check_local",
    "host_offsets",
    "resolve_backend",
    "shape",
]


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


def check_heads(q: Tensor, k: Tensor, v: Tensor) -> tuple[int, int, int, int, int]:
    """``(T, H, K, HV, V)`` of a recurrence's q, k ``[1, T, H, K]`` and v ``[1, T, HV, V]``
    (HV a multiple of H); a ValueError naming the argument and its shape otherwise."""
    if q.dim() != 4 or q.shape[0] != 1:
        raise ValueError(f"q must be [1, T, H, K], got shape {shape(q)}")
    _, T, H, K = q.shape
    if k.shape != q.shape:
        raise ValueError(f"k must match q {shape(q)}, got shape {shape(k)}")
    if v.dim() != 4 or v.shape[:2] != q.shape[:2]:
        raise ValueError(f"v must be [1, T={T}, HV, V], got shape {shape(v)}")
    HV, V = v.shape[2:]
    if HV % H != 0:
        raise ValueError(f"v heads HV={HV} must be a multiple of q/k heads H={H} (v {shape(v)})")
    return T, H, K, HV, V


def check_initial_state(initial_state: Tensor | None, n: int | None, *state: int) -> None:
    """``initial_state`` is None or ``[n, *state]`` (any n when None: offsets not on the host)."""
    if initial_state is None:
        return
    if (
        initial_state.dim() != 1 + len(state)
        or list(initial_state.shape[1:]) != list(state)
        or (n is not None and initial_state.shape[0] != n)
    ):
        want = [n if n is not None else "N", *state]
        raise ValueError(f"initial_state must be {want}, got shape {shape(initial_state)}")


class TokenInput(NamedTuple):
    """A per-token input of a recurrence besides q, k, v: the tensor, its trailing dims by name
    (``"H"``, ``"K"``, ``"HV"``, ``"V"``; it must be ``[1, T, *dims]``) and what its error
    message adds after the expected shape."""

    tensor: Tensor
    dims: tuple[str, ...]
    note: str = ""


class LocalCall(NamedTuple):
    """What ``check_local`` found: the sizes, the number of sequences N and the backend."""

    T: int
    H: int
    K: int
    HV: int
    V: int
    N: int | None
    backend: str


def check_local(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    inputs: dict[str, TokenInput],
    initial_state: Tensor | None,
    cu_seqlens: Tensor | None,
    cu_seqlens_cpu: Tensor | None,
    backend: str,
) -> LocalCall:
    """The checks every local recurrence kernel makes (``check_heads``, each of ``inputs``
    against its shape, ``check_cu_seqlens``, ``check_initial_state``) and its backend
    (``resolve_backend``); a ValueError names the first bad argument."""
    T, H, K, HV, V = check_heads(q, k, v)
    sizes = {"H": H, "K": K, "HV": HV, "V": V}
    for name, (x, dims, note) in inputs.items():
        want = [1, T, *(sizes[d] for d in dims)]
        if list(x.shape) != want:
            raise ValueError(f"{name} must be {want}{note}, got shape {shape(x)}")
    N = check_cu_seqlens(T, cu_seqlens, cu_seqlens_cpu)
    check_initial_state(initial_state, N, HV, K, V)
    return LocalCall(T, H, K, HV, V, N, resolve_backend(backend, q))
