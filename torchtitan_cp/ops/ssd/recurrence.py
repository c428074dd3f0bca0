"""SSD, the recurrence of Mamba2 layers: local kernel, ``Recurrence`` and CP entry point.

Per sequence and value head: ``S_t = exp(g_t) S_{t-1} + k_t v_tᵀ``, ``o_t = S_tᵀ (scale q_t)``,
with ``g_t = dt_t A`` (one natural-log decay per head and token), ``k = B``, ``q = C`` and
``v = dt x`` as the Mamba2 layer feeds it (``models/mamba2.py``). Backends: pure PyTorch
(``torch_backend.ssd``), and on CUDA fla-core 0.6.0's ``chunk_simple_gla``, which is exactly
this recurrence (head-wise data-dependent gate, no delta correction). fla-core ships no separate
Mamba2/SSD kernel (its ``fla.layers.mamba2`` calls the external mamba_ssm kernels).

Summary algebra: the transition is diagonal, ``S_out = exp(a) S_in + E`` with one log decay
``a`` per head, stored as ``[HV, K*V + 1] = [E | a]``; all-gathered per slot that is
``HV (K V + 1)`` numbers against the delta rule's ``HV K (V + K)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor

from ..cp.driver import context_parallel_recurrence
from ..cp.recurrence import SequenceTables, fold_dtype
from ..delta_rule.local import Backend, _check_cu_seqlens, _resolve_backend, _shape
from .torch_kernel import chunk_ssd_torch

if TYPE_CHECKING:
    from torchtitan_cp.routing import DeviceRouting

__all__ = ["SSD", "chunk_ssd", "context_parallel_ssd"]


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
    if list(g.shape) != [1, T, HV]:
        raise ValueError(f"g must be {[1, T, HV]}, got shape {_shape(g)}")
    N = _check_cu_seqlens(T, cu_seqlens, cu_seqlens_cpu)
    if initial_state is not None and (
        list(initial_state.shape[1:]) != [HV, K, V]
        or (N is not None and initial_state.shape[0] != N)
    ):
        want = [N if N is not None else "N", HV, K, V]
        raise ValueError(f"initial_state must be {want}, got shape {_shape(initial_state)}")
    if _resolve_backend(backend, q) == "fla":
        return _chunk_ssd_fla(q, k, v, g, scale, initial_state, output_final_state, cu_seqlens,
                              cu_seqlens_cpu)  # fmt: skip
    o, fin = chunk_ssd_torch(
        q, k, v, g, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, cu_seqlens=cu_seqlens,
        cu_seqlens_cpu=cu_seqlens_cpu,
    )  # fmt: skip
    assert o is not None
    return o, fin


def _chunk_ssd_fla(q, k, v, g, scale, initial_state, output_final_state, cu_seqlens, cu_cpu):
    from fla.ops.simple_gla import chunk_simple_gla

    from ..delta_rule.fla_kernel import _device_cu_seqlens

    cu_dev, cu_cpu = _device_cu_seqlens(cu_seqlens, cu_cpu, q.device)
    rep = v.shape[2] // q.shape[2]  # simple GLA has one q/k head per value head
    q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
    h0 = initial_state.float() if initial_state is not None else None
    return chunk_simple_gla(
        q, k, v, g=g.float(), scale=scale, initial_state=h0,
        output_final_state=output_final_state, cu_seqlens=cu_dev, cu_seqlens_cpu=cu_cpu,
    )  # fmt: skip


@dataclass(frozen=True)
class SSD:
    """Mamba2's SSD as a ``Recurrence``; inputs ``(q, k, v, g)`` as for ``chunk_ssd``."""

    scale: float | None = None
    backend: Backend = "auto"

    def state_shape(self, inputs: tuple[Tensor, ...]) -> tuple[int, int, int]:
        q, _, v = inputs[:3]
        return v.shape[2], q.shape[3], v.shape[3]

    def local(
        self,
        inputs: tuple[Tensor, ...],
        tables: SequenceTables,
        initial_state: Tensor | None,
        output_final_state: bool,
    ) -> tuple[Tensor, Tensor | None]:
        return chunk_ssd(
            *inputs, scale=self.scale, initial_state=initial_state,
            output_final_state=output_final_state, cu_seqlens=tables.cu_seqlens,
            cu_seqlens_cpu=tables.cu_seqlens_cpu, backend=self.backend,
        )  # fmt: skip

    def identity(self, state_shape: tuple[int, int, int], dtype, device) -> Tensor:
        HV, K, V = state_shape
        return torch.zeros(1, HV, K * V + 1, dtype=dtype, device=device)  # E = 0, a = 0

    def summarize(self, inputs: tuple[Tensor, ...], tables: SequenceTables) -> Tensor:
        q, k, v, g = inputs
        dt = fold_dtype(v.dtype)
        if _resolve_backend(self.backend, q) == "torch":
            _, E = chunk_ssd_torch(
                q, k, v, g, cu_seqlens=tables.cu_seqlens,
                cu_seqlens_cpu=tables.cu_seqlens_cpu, states_only=True,
            )  # fmt: skip
        else:  # fla: no state-only autograd entry point; the [.., V] output is discarded
            _, E = _chunk_ssd_fla(q, k, v, g, None, None, True, tables.cu_seqlens,
                                  tables.cu_seqlens_cpu)  # fmt: skip
        assert E is not None
        # Log decay of every sequence: differences of a float64 prefix sum at the offsets
        # (a device gather, no host read; float64 so long ranges lose no precision).
        cs = torch.cat([g.new_zeros(1, 1, g.shape[2], dtype=torch.float64),
                        g.double().cumsum(1)], 1)[0]  # fmt: skip
        cu = tables.cu_seqlens.to(device=g.device, dtype=torch.int64)
        a = (cs.index_select(0, cu[1:]) - cs.index_select(0, cu[:-1])).to(dt)  # [N, HV]
        return torch.cat([E.to(dt).flatten(-2), a.unsqueeze(-1)], -1)

    def apply(self, summary: Tensor, state: Tensor) -> Tensor:
        E = summary[..., :-1].unflatten(-1, state.shape[-2:])
        return torch.exp(summary[..., -1])[..., None, None] * state + E

    def compose(self, first: Tensor, then: Tensor, state_shape: tuple[int, int, int]) -> Tensor:
        E1 = first[..., :-1].unflatten(-1, state_shape[1:])
        E = self.apply(then, E1).flatten(-2)
        return torch.cat([E, (first[..., -1:] + then[..., -1:])], -1)


def context_parallel_ssd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    *,
    routing: DeviceRouting,
    group: dist.ProcessGroup | None,
    scale: float | None = None,
    output_final_state: bool = False,
    backend: Backend = "auto",
) -> tuple[Tensor, Tensor | None]:
    """SSD on this rank's span (shapes as ``chunk_ssd``), continuing documents across fragments
    and ranks; returns as ``context_parallel_recurrence``."""
    return context_parallel_recurrence(
        SSD(scale=scale, backend=backend),
        (q, k, v, g),
        routing=routing,
        group=group,
        output_final_state=output_final_state,
    )
