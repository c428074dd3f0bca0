"""fla-core's chunk tables and offsets, as every fla kernel adapter and custom op hands them over.

``chunk_indices`` / ``chunk_offsets`` are the kernels' chunk tables built on the host by the
routing plan (``routing.chunks`` with ``FLA_CHUNK_SIZE``). Given them, fla derives no index from
``cu_seqlens`` that needs the host (docs/kernels.md, "Precomputed kernel metadata"); without
them fla builds its own (a blocking host-to-device copy per call). fla is imported inside the
functions, so this module loads no Triton kernel.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
from torch import Tensor

from torchtitan_cp.routing import chunk_bound

__all__ = [
    "FLA_CHUNK_SIZE",
    "FlaOffsets",
    "chunk_table",
    "contiguous",
    "device_cu_seqlens",
    "fla_chunk_indices",
    "fla_offsets",
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


def device_cu_seqlens(
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


def chunk_table(
    cu_seqlens_cpu: Tensor | None,
    num_tokens: int,
    chunk_indices: Tensor | None,
    chunk_offsets: Tensor | None,
) -> Tensor | None:
    """The first NT rows of ``chunk_indices`` (NT from the host offsets: no device read).

    Accepts the exact table or one padded to ``chunk_bound`` rows (``DeviceRouting`` with caps);
    any other row count means tables built for another chunk size or other offsets.
    """
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


def fla_chunk_indices(
    cu_seqlens: Tensor | None,
    cu_seqlens_cpu: Tensor | None,
    chunk_indices: Tensor | None,
    num_tokens: int,
) -> Tensor | None:
    """The chunk table fla's kernels get: the routing's (``DeviceRouting.chunk_indices``, padded
    to a fixed row count with caps) cut to its first NT rows, NT from the host offsets (a view:
    no copy, no device read); without one, fla's own helper (a host sync per call)."""
    if cu_seqlens is None:
        return None
    if chunk_indices is not None:
        return chunk_table(cu_seqlens_cpu, num_tokens, chunk_indices, None)
    from fla.ops.utils.index import prepare_chunk_indices

    return prepare_chunk_indices(cu_seqlens, FLA_CHUNK_SIZE, cu_seqlens_cpu=cu_seqlens_cpu)


class FlaOffsets(NamedTuple):
    """What an eager fla adapter passes fla (``fla_offsets``)."""

    cu_seqlens: Tensor | None
    cu_seqlens_cpu: Tensor | None
    chunk_indices: Tensor | None
    initial_state: Tensor | None


def fla_offsets(
    x: Tensor,
    cu_seqlens: Tensor | None,
    cu_seqlens_cpu: Tensor | None,
    chunk_indices: Tensor | None,
    chunk_offsets: Tensor | None,
    initial_state: Tensor | None,
) -> FlaOffsets:
    """The offset handling every eager fla adapter shares: the offsets on ``x``'s device and
    the host (``device_cu_seqlens``), the routing's chunk table cut to its real rows
    (``chunk_table``; tables without offsets are an error) and the initial state in float32
    (fla keeps states in float32). ``x [1, T, ...]`` is a token-major input."""
    cu_dev, cu_cpu = device_cu_seqlens(cu_seqlens, cu_seqlens_cpu, x.device)
    if cu_dev is None and (chunk_indices is not None or chunk_offsets is not None):
        raise ValueError("chunk_indices / chunk_offsets need cu_seqlens")
    table = chunk_table(cu_cpu, x.shape[1], chunk_indices, chunk_offsets)
    h0 = initial_state.float() if initial_state is not None else None
    return FlaOffsets(cu_dev, cu_cpu, table, h0)
