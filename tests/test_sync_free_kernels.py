"""The pure-PyTorch kernels wait for no device (issue 34): on the routing's device tensors, every
torch kernel and CP op of a training step, forward and backward, records nothing under
``HostSyncRecorder`` (the CPU dry run of ``torch.cuda.set_sync_debug_mode``; the device is the
CPU named ``cpu:0``). On a GPU image where fla refuses a kernel (GDN's backward on Hopper with
triton 3.6, fla #640) these kernels are the ``auto`` fallback, so they must be sync-free too: the
first GPU run found a blocking copy of a host-built gather index at
``ops/conv/torch_kernel.py:71`` in every G layer's conv.

Every registered recurrence (``tests/recurrences.py``'s cases) runs through the CP driver on
the world-1 path over a span whose fragments are out of token order, so the summaries, the
fold and the local kernel with entry states all run; the conv with its CP history; softmax
attention over the gathered ids; each on routing with and without caps (the compiled model's
fixed shapes). The routing itself is built inside the recorded region, as the trainer builds it
per microbatch.
"""

from __future__ import annotations

import pytest
import torch

from tests.recurrences import CASES, RecurrenceCase
from torchtitan_cp.ops import (
    causal_conv1d,
    context_parallel_attention,
    context_parallel_conv_history,
)
from torchtitan_cp.ops.cp.driver import context_parallel_recurrence
from torchtitan_cp.ops.cp.recurrence import recurrence
from torchtitan_cp.routing import RoutingCaps, RoutingPlan
from torchtitan_cp.trainer.host_sync import HostSyncRecorder

DEVICE = torch.device("cpu", 0)
# Documents of 1, 69, 80, 200, 1 and 69 tokens (chunks of 64: sequences of 1 to 4 chunks, and
# one that ends exactly on a chunk boundary); the span holds [0, 100), then [300, 420), then
# [100, 300): its last fragment continues documents of both earlier ones, and the first two
# publish summaries.
CU = [0, 1, 70, 150, 350, 351, 420]
TABLE = [[(0, 100), (300, 420), (100, 300)]]
CAPS = RoutingCaps(slots=4, subsequences=12, predecessors=3, terminal=8)


def _recorded(fn) -> list[str]:
    rec = HostSyncRecorder(DEVICE)
    with rec:
        fn(rec)
    return [str(e) for e in rec.events]


def _device_inputs(rec: HostSyncRecorder, xs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Leaves on the device: what the model's projections hand the kernels."""
    out = [x.detach().clone().requires_grad_(True) for x in xs]
    rec.mark_device(out)
    return out


@pytest.mark.parametrize("caps", [None, CAPS], ids=["exact", "caps"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_every_torch_recurrence_through_the_cp_driver_waits_for_nothing(case: RecurrenceCase, caps):
    plan = RoutingPlan.build(CU, TABLE, 0)
    xs = case.inputs(plan.num_tokens, 0, torch.float32)

    def step(rec: HostSyncRecorder) -> None:
        routing = plan.to_device(DEVICE, caps=caps)
        leaves = _device_inputs(rec, xs)
        rec_ = recurrence(case.name, backend="torch", **case.options)
        o, fin = context_parallel_recurrence(
            rec_, tuple(leaves), routing=routing, group=None, output_final_state=True
        )
        assert fin is not None
        (o.square().sum() + fin.sum()).backward()
        assert all(x.grad is not None for x in leaves)

    assert _recorded(step) == []


@pytest.mark.parametrize("caps", [None, CAPS], ids=["exact", "caps"])
def test_torch_conv_with_its_cp_history_waits_for_nothing(caps):
    plan = RoutingPlan.build(CU, TABLE, 0)
    gen = torch.Generator().manual_seed(0)
    x0 = torch.randn(1, plan.num_tokens, 6, generator=gen)
    w0 = torch.randn(6, 4, generator=gen)

    def step(rec: HostSyncRecorder) -> None:
        routing = plan.to_device(DEVICE, caps=caps)
        x, w = _device_inputs(rec, [x0, w0])
        hist = context_parallel_conv_history(x, routing=routing, group=None)
        y = causal_conv1d(
            x,
            w,
            None,
            cu_seqlens=routing.cu_seqlens,
            cu_seqlens_cpu=routing.cu_seqlens_cpu,
            initial_state=hist,
            backend="torch",
        )
        y0 = causal_conv1d(
            x,
            w,
            None,
            cu_seqlens=routing.cu_seqlens,
            cu_seqlens_cpu=routing.cu_seqlens_cpu,
            backend="torch",
        )
        (y.square().sum() + y0.sum()).backward()

    assert _recorded(step) == []


def test_attention_over_gathered_ids_waits_for_nothing():
    plan = RoutingPlan.build(CU, TABLE, 0)
    gen = torch.Generator().manual_seed(0)
    T = plan.num_tokens
    q0, k0, v0 = (torch.randn(1, T, 2, 8, generator=gen) for _ in range(3))
    ids = torch.stack(
        [torch.arange(T), torch.searchsorted(torch.tensor(CU), torch.arange(T), right=True) - 1]
    )

    def step(rec: HostSyncRecorder) -> None:
        q, k, v = _device_inputs(rec, [q0, k0, v0])
        token_ids, doc_ids = ids.to(DEVICE, non_blocking=True)
        o = context_parallel_attention(q, k, v, token_ids=token_ids, doc_ids=doc_ids, group=None)
        o.square().sum().backward()

    assert _recorded(step) == []
