"""Thin adapters from our local-kernel signatures to fla-core's Triton kernels (CUDA; CPU tensors
only under Triton's interpreter, in the fla_interpreter test tier).

fla is imported inside the functions, so importing this module (or ``ops.local``) on a CPU-only
machine never loads Triton kernels.

``chunk_indices`` / ``chunk_offsets`` are the kernels' chunk tables built on the host by the
routing plan (``routing.chunks`` with ``FLA_CHUNK_SIZE``). Given them, fla derives
no index from ``cu_seqlens`` that needs the host (docs/kernels.md, "Precomputed kernel
metadata"); without them fla builds its own (a blocking host-to-device copy per call).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "FLA_CHUNK_SIZE",
    "causal_conv1d_fla",
    "chunk_delta_rule_fla",
    "contiguous",
    "triton_interpreter_on",
]

# Tokens per chunk of fla-core 0.6.0's chunk_kda, chunk_gated_delta_rule and causal_conv1d
# (each one's default; the adapters never pass another). Routing tables must use it.
FLA_CHUNK_SIZE = 64


def contiguous(*xs: Tensor | None) -> list:
    """Each tensor made contiguous (None stays None), for every call below fla's public
    functions: its internal ones (``chunk_kda_bwd``, ``chunk_gated_delta_rule_bwd``, ...) index
    rows with fixed strides, and only the public ones make inputs contiguous. Our inputs can be
    views (v is a split of the conv output) and cotangents expanded (stride 0)."""
    return [x.contiguous() if x is not None else None for x in xs]


@torch.compiler.assume_constant_result  # read while dynamo traces: a constant, not a graph
def triton_interpreter_on() -> bool:
    """Whether Triton's interpreter is on (``TRITON_INTERPRET=1``): fla's kernels then run on CPU
    tensors, in numpy, far too slowly to train. Only the ``fla_interpreter`` test tier turns it
    on (tests/fla_interpreter.py); a normal CPU run refuses ``backend='fla'``."""
    if os.environ.get("TRITON_INTERPRET") is None:
        return False  # the common case, without importing triton
    try:
        from triton import knobs
    except Exception:  # no triton, or one that does not import: no interpreter either
        return False
    return bool(knobs.runtime.interpret)


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


def _chunk_table(
    cu_seqlens_cpu: Tensor | None,
    num_tokens: int,
    chunk_indices: Tensor | None,
    chunk_offsets: Tensor | None,
) -> Tensor | None:
    """The first NT rows of ``chunk_indices`` (NT from the host offsets: no device read).

    Accepts the exact table or one padded to ``chunk_bound`` rows (``DeviceRouting`` with caps);
    any other row count means tables built for another chunk size or other offsets.
    """
    from torchtitan_cp.routing import chunk_bound

    if chunk_indices is None and chunk_offsets is None:
        return None
    if cu_seqlens_cpu is None:
        raise ValueError("chunk_indices / chunk_offsets need cu_seqlens_cpu (host offsets)")
    lens = (cu_seqlens_cpu[1:] - cu_seqlens_cpu[:-1]).to(torch.int64)
    n = lens.numel()
    if chunk_offsets is not None and list(chunk_offsets.shape) != [n + 1]:
        raise ValueError(f"chunk_offsets must be [{n + 1}], got {list(chunk_offsets.shape)}")
    if chunk_indices is None:
        return None
    nt = int(torch.div(lens + FLA_CHUNK_SIZE - 1, FLA_CHUNK_SIZE, rounding_mode="floor").sum())
    rows = (nt, chunk_bound(num_tokens, n, FLA_CHUNK_SIZE))
    if (
        chunk_indices.dim() != 2
        or chunk_indices.shape[1] != 2
        or chunk_indices.shape[0] not in rows
    ):
        raise ValueError(
            f"chunk_indices must be [{nt}, 2] (or padded to [{rows[1]}, 2]) for these cu_seqlens "
            f"and fla's chunk size {FLA_CHUNK_SIZE}, got {list(chunk_indices.shape)}"
        )
    return chunk_indices[:nt]


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
    chunk_indices: Tensor | None = None,
    chunk_offsets: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """``fla.ops.kda.chunk_kda`` (kind="kda") or ``chunk_gated_delta_rule`` (kind="gdn").

    Same shapes as ``ops.local.chunk_delta_rule``; gates are already natural-log decays and q/k
    already normalised, so all of FLA's in-kernel gate / l2norm / sigmoid options stay off.
    States are float32 ``[N, HV, K, V]``. ``chunk_indices [NT, 2]`` int32 (or padded, see
    ``_chunk_table``) and ``chunk_offsets [N + 1]`` on q's device: the chunk tables of
    ``cu_seqlens`` (KDA goes through
    ``fla_compat.chunk_kda_indexed``, which accepts both; GDN's public function takes
    ``chunk_indices`` and derives its chunk offsets on the device, which needs no host read).
    """
    cu_seqlens, cu_seqlens_cpu = _device_cu_seqlens(cu_seqlens, cu_seqlens_cpu, q.device)
    if cu_seqlens is None and (chunk_indices is not None or chunk_offsets is not None):
        raise ValueError("chunk_indices / chunk_offsets need cu_seqlens")
    chunk_indices = _chunk_table(cu_seqlens_cpu, q.shape[1], chunk_indices, chunk_offsets)
    if initial_state is not None:
        initial_state = initial_state.float()
    if kind == "kda" and chunk_indices is not None:
        from .fla_compat import chunk_kda_indexed

        assert cu_seqlens is not None  # checked above
        return chunk_kda_indexed(
            q,
            k,
            v,
            g,
            beta,
            scale=scale,
            initial_state=initial_state,
            output_final_state=output_final_state,
            cu_seqlens=cu_seqlens,
            cu_seqlens_cpu=cu_seqlens_cpu,
            chunk_indices=chunk_indices,
            chunk_offsets=chunk_offsets,
        )
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

        return chunk_gated_delta_rule(q, k, v, g, beta, chunk_indices=chunk_indices, **kwargs)
    raise ValueError(f"kind must be 'kda' or 'gdn', got {kind!r}")


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

    cu_seqlens, cu_seqlens_cpu = _device_cu_seqlens(cu_seqlens, cu_seqlens_cpu, x.device)
    if cu_seqlens is None and chunk_indices is not None:
        raise ValueError("chunk_indices needs cu_seqlens")
    chunk_indices = _chunk_table(cu_seqlens_cpu, x.shape[1], chunk_indices, None)
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
