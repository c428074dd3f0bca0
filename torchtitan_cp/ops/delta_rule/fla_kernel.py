"""Thin adapter from our delta-rule signature to fla-core's Triton kernels (CUDA; CPU tensors
only under Triton's interpreter, in the fla_interpreter test tier).

fla is imported inside the function, so importing this module on a CPU-only machine never loads
Triton kernels. The chunk tables come from the routing (``ops/common/fla.py``).
"""

from __future__ import annotations

from torch import Tensor

from ..common.fla import fla_offsets

__all__ = ["chunk_delta_rule_fla"]


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

    Same shapes as ``ops.delta_rule.local.chunk_delta_rule``; gates are already natural-log decays and q/k
    already normalised, so all of FLA's in-kernel gate / l2norm / sigmoid options stay off.
    States are float32 ``[N, HV, K, V]``. ``chunk_indices [NT, 2]`` int32 (or padded, see
    ``common.fla.chunk_table``) and ``chunk_offsets [N + 1]`` on q's device: the chunk tables of
    ``cu_seqlens`` (KDA goes through
    ``fla_compat.chunk_kda_indexed``, which accepts both; GDN's public function takes
    ``chunk_indices`` and derives its chunk offsets on the device, which needs no host read).
    """
    cu_seqlens, cu_seqlens_cpu, chunk_indices, initial_state = fla_offsets(
        q, cu_seqlens, cu_seqlens_cpu, chunk_indices, chunk_offsets, initial_state
    )
    if kind == "kda" and chunk_indices is not None:
        from ..fla_compat import chunk_kda_indexed

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
