"""SSD on fla-core 0.6.0's ``chunk_simple_gla`` (CUDA; CPU tensors only under Triton's
interpreter, in the fla_interpreter test tier): exactly this recurrence (head-wise
data-dependent gate, no delta correction). fla is imported inside the function.

The chunk tables come from the routing (``ops/common/fla.py``): given them, the call goes
through ``fla_compat.chunk_simple_gla_indexed``, which builds no index on the host and reads no
chunk count back from the device; without them, fla's public ``chunk_simple_gla`` (a host copy
and a device read per call over packed sequences).
"""

from __future__ import annotations

from torch import Tensor

from ..common.fla import fla_offsets

__all__ = ["chunk_ssd_fla"]


def chunk_ssd_fla(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    scale: float | None,
    initial_state: Tensor | None,
    output_final_state: bool,
    cu_seqlens: Tensor | None,
    cu_cpu: Tensor | None,
    *,
    chunk_indices: Tensor | None = None,
    chunk_offsets: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Shapes as ``ops.ssd.local.chunk_ssd``; q/k heads are repeated to the value heads here
    (simple GLA has one q/k head per value head). ``chunk_indices [NT, 2]`` int32 (or padded,
    see ``common.fla.chunk_table``) and ``chunk_offsets [N + 1]`` int64 on q's device: the chunk
    tables of ``cu_seqlens`` with ``FLA_CHUNK_SIZE``. States are float32 ``[N, HV, K, V]``."""
    cu_dev, cu_cpu, chunk_indices, h0 = fla_offsets(
        q, cu_seqlens, cu_cpu, chunk_indices, chunk_offsets, initial_state
    )
    rep = v.shape[2] // q.shape[2]
    q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
    if chunk_indices is not None:
        from ..fla_compat import chunk_simple_gla_indexed

        assert cu_dev is not None  # checked above
        return chunk_simple_gla_indexed(
            q, k, v, g.float(), scale=scale, initial_state=h0,
            output_final_state=output_final_state, cu_seqlens=cu_dev,
            chunk_indices=chunk_indices, chunk_offsets=chunk_offsets,
        )  # fmt: skip
    from fla.ops.simple_gla import chunk_simple_gla

    return chunk_simple_gla(
        q, k, v, g=g.float(), scale=scale, initial_state=h0,
        output_final_state=output_final_state, cu_seqlens=cu_dev, cu_seqlens_cpu=cu_cpu,
    )  # fmt: skip
