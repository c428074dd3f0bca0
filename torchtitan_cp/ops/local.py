"""Local (single-rank) delta-rule and short-convolution kernels with FLA conventions.

``backend="auto"`` picks fla-core's Triton kernels for CUDA tensors and the pure-PyTorch
implementation (``ops.torch_backend``) otherwise. ``backend="fla"`` takes CPU tensors only while
Triton's interpreter is on (``TRITON_INTERPRET=1``: the ``fla_interpreter`` test tier). See docs/CONTRACTS.md ("ops/ local kernels")
for the exact contract and docs/kernels.md for the algorithm.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from . import opaque
from .fla_backend import triton_interpreter_on
from .torch_backend import causal_conv1d_torch, chunk_delta_rule_torch

Kind = Literal["kda", "gdn"]
Backend = Literal["auto", "torch", "fla"]

__all__ = ["causal_conv1d", "chunk_delta_rule"]

_BACKENDS = ("auto", "torch", "fla")


def _shape(t: Tensor) -> str:
    return str(list(t.shape))


def _resolve_backend(backend: str, x: Tensor) -> str:
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
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


def _check_cu_seqlens(
    total: int, cu_seqlens: Tensor | None, cu_seqlens_cpu: Tensor | None
) -> int | None:
    """Validate sequence offsets; returns N (number of sequences), or None if unknown on host.

    Values are only checked from a host copy, so a CUDA ``cu_seqlens`` alone costs no sync.
    """
    for name, cu in (("cu_seqlens", cu_seqlens), ("cu_seqlens_cpu", cu_seqlens_cpu)):
        if cu is not None and (cu.dim() != 1 or cu.numel() < 2):
            raise ValueError(f"{name} must be 1-D with N+1 >= 2 entries, got shape {_shape(cu)}")
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
                f"cu_seqlens {_shape(cu_seqlens)} and cu_seqlens_cpu {_shape(cu_seqlens_cpu)} differ"
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


def chunk_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    kind: Kind,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Tensor | None = None,
    cu_seqlens_cpu: Tensor | None = None,
    chunk_indices: Tensor | None = None,
    chunk_offsets: Tensor | None = None,
    backend: Backend = "auto",
) -> tuple[Tensor, Tensor | None]:
    """Gated delta rule over packed sequences (KDA per-channel gate or GDN scalar gate).

    Per sequence and value head: ``S_t = (I - beta_t k_t k_tᵀ) Diag(exp g_t) S_{t-1}
    + beta_t k_t v_tᵀ``, ``o_t = S_tᵀ (scale q_t)``.

    Args:
        q, k: ``[1, T, H, K]`` (already l2-normalised by the caller).
        v: ``[1, T, HV, V]``, HV a multiple of H.
        g: natural-log decay ≤ 0: ``[1, T, HV, K]`` (kda) or ``[1, T, HV]`` (gdn).
        beta: ``[1, T, HV]``.
        scale: query scale, default ``K ** -0.5``.
        initial_state: ``[N, HV, K, V]``, one per sequence (zeros when None).
        output_final_state: also return the state after every sequence.
        cu_seqlens: ``[N+1]`` int offsets on the tensors' device; cu_seqlens_cpu: the same on
            the host (avoids a device→host copy). Zero-length sequences are allowed.
        chunk_indices, chunk_offsets: ``[NT, 2]`` int32 / ``[N+1]`` int64 chunk tables of
            cu_seqlens on its device (``DeviceRouting.chunk_indices`` ...), so the fla kernels
            derive nothing from cu_seqlens on the host; the torch backend does not need them.
        backend: "auto" (fla on CUDA, torch otherwise), "torch" or "fla".

    Returns:
        ``(o [1, T, HV, V], final_state [N, HV, K, V] float32/float64 or None)``.
    """
    if kind not in ("kda", "gdn"):
        raise ValueError(f"kind must be 'kda' or 'gdn', got {kind!r}")
    if q.dim() != 4 or q.shape[0] != 1:
        raise ValueError(f"q must be [1, T, H, K], got shape {_shape(q)}")
    _, T, H, K = q.shape
    if k.shape != q.shape:
        raise ValueError(f"k must match q {_shape(q)}, got shape {_shape(k)}")
    if v.dim() != 4 or v.shape[:2] != q.shape[:2]:
        raise ValueError(f"v must be [1, T={T}, HV, V], got shape {_shape(v)}")
    HV, V = v.shape[2:]
    if HV % H != 0:
        raise ValueError(f"v heads HV={HV} must be a multiple of q/k heads H={H} (v {_shape(v)})")
    g_shape = [1, T, HV, K] if kind == "kda" else [1, T, HV]
    if list(g.shape) != g_shape:
        raise ValueError(f"g must be {g_shape} for kind={kind!r}, got shape {_shape(g)}")
    if list(beta.shape) != [1, T, HV]:
        raise ValueError(f"beta must be {[1, T, HV]}, got shape {_shape(beta)}")
    N = _check_cu_seqlens(T, cu_seqlens, cu_seqlens_cpu)
    if initial_state is not None:
        n0 = initial_state.shape[0] if initial_state.dim() == 4 else -1
        if (
            initial_state.dim() != 4
            or list(initial_state.shape[1:]) != [HV, K, V]
            or (N is not None and n0 != N)
        ):
            want = [N if N is not None else "N", HV, K, V]
            raise ValueError(f"initial_state must be {want}, got shape {_shape(initial_state)}")
    resolved = _resolve_backend(backend, q)
    if torch.compiler.is_compiling():
        return _compiled_delta_rule(
            resolved, q, k, v, g, beta, kind=kind, scale=scale, initial_state=initial_state,
            output_final_state=output_final_state, cu_seqlens=cu_seqlens,
            cu_seqlens_cpu=cu_seqlens_cpu, chunk_indices=chunk_indices,
        )  # fmt: skip
    if resolved == "fla":
        from .fla_backend import chunk_delta_rule_fla

        return chunk_delta_rule_fla(
            q,
            k,
            v,
            g,
            beta,
            kind=kind,
            scale=scale,
            initial_state=initial_state,
            output_final_state=output_final_state,
            cu_seqlens=cu_seqlens,
            cu_seqlens_cpu=cu_seqlens_cpu,
            chunk_indices=chunk_indices,
            chunk_offsets=chunk_offsets,
        )
    return chunk_delta_rule_torch(
        q,
        k,
        v,
        g,
        beta,
        kind=kind,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        cu_seqlens=cu_seqlens,
        cu_seqlens_cpu=cu_seqlens_cpu,
    )


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
        raise ValueError(f"x must be [1, T, D], got shape {_shape(x)}")
    _, T, D = x.shape
    if weight.dim() != 2 or weight.shape[0] != D or weight.shape[1] < 1:
        raise ValueError(f"weight must be [D={D}, W], got shape {_shape(weight)}")
    W = weight.shape[1]
    if bias is not None and list(bias.shape) != [D]:
        raise ValueError(f"bias must be [{D}], got shape {_shape(bias)}")
    if activation not in ("silu", "swish", None):
        raise ValueError(f"activation must be 'silu' or None, got {activation!r}")
    N = _check_cu_seqlens(T, cu_seqlens, cu_seqlens_cpu)
    if initial_state is not None:
        ok = initial_state.dim() == 3 and list(initial_state.shape[1:]) == [D, W - 1]
        if not ok or (N is not None and initial_state.shape[0] != N):
            want = [N if N is not None else "N", D, W - 1]
            raise ValueError(f"initial_state must be {want}, got shape {_shape(initial_state)}")
    kwargs = dict(
        cu_seqlens=cu_seqlens,
        cu_seqlens_cpu=cu_seqlens_cpu,
        initial_state=initial_state,
        activation=activation,
    )
    resolved = _resolve_backend(backend, x)
    if torch.compiler.is_compiling():
        return _compiled_conv(resolved, x, weight, bias, chunk_indices=chunk_indices, **kwargs)
    if resolved == "fla":
        from .fla_backend import causal_conv1d_fla

        return causal_conv1d_fla(x, weight, bias, chunk_indices=chunk_indices, **kwargs)
    return causal_conv1d_torch(x, weight, bias, **kwargs)


# ----------------------------------------------------------------------------- torch.compile
# While dynamo traces, the kernels run as the custom ops of ``ops.opaque`` (opaque to the
# compiler, no graph break); eager calls above keep their plain autograd.


def _host_offsets(cu_seqlens: Tensor | None, cu_seqlens_cpu: Tensor | None) -> Tensor | None:
    if cu_seqlens_cpu is not None or cu_seqlens is None:
        return cu_seqlens_cpu
    if cu_seqlens.device.type != "cpu":
        raise ValueError(
            "under torch.compile the local kernels need cu_seqlens_cpu (the host copy of "
            "cu_seqlens): reading device offsets back would break the graph"
        )
    return cu_seqlens


def _compiled_delta_rule(
    backend: str,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    kind: str,
    scale: float | None,
    initial_state: Tensor | None,
    output_final_state: bool,
    cu_seqlens: Tensor | None,
    cu_seqlens_cpu: Tensor | None,
    chunk_indices: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    cu_cpu = _host_offsets(cu_seqlens, cu_seqlens_cpu)
    if backend == "fla":
        from .fla_backend import _device_cu_seqlens

        cu_dev, cu_cpu = _device_cu_seqlens(cu_seqlens, cu_cpu, q.device)
        h0 = initial_state.float() if initial_state is not None else None
        o, final, *_ = opaque.delta_rule_fla_op(
            q, k, v, g, beta, h0, cu_dev, cu_cpu, chunk_indices, kind, scale, output_final_state
        )
        return o, (final if output_final_state else None)
    o, final = opaque.delta_rule_torch_op(q, k, v, g, beta, initial_state, cu_cpu, kind, scale)
    return o, (final if output_final_state else None)


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
    cu_cpu = _host_offsets(cu_seqlens, cu_seqlens_cpu)
    if backend == "fla":
        from .fla_backend import _device_cu_seqlens

        cu_dev, cu_cpu = _device_cu_seqlens(cu_seqlens, cu_cpu, x.device)
        # fla's cache layout [N, D, W]: one leading zero column (see fla_backend).
        h0 = F.pad(initial_state.to(x.dtype), (1, 0)) if initial_state is not None else None
        return opaque.causal_conv1d_fla_op(x, weight, bias, h0, cu_dev, cu_cpu, chunk_indices, act)
    return opaque.causal_conv1d_torch_op(x, weight, bias, initial_state, cu_cpu, act)
