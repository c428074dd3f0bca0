"""What the GPU check's one call checks on CUDA, by the suite's own definitions (issue 34): fla
against the PyTorch kernels, and the CP gradients of every simulated rank against the unsharded
computation, for **every registered recurrence** (``tests/recurrences.py``'s cases: KDA, GDN,
SSD, retention's fixed decay, GLA) and the causal conv.

Every test here carries the ``gpu_check`` mark: ``scripts/gpu_check.py``'s ``correctness`` part
runs ``pytest -m gpu_check`` on the GPU (fla's compiled kernels, autotune pruned to each
kernel's smallest config, each test's measured errors appended to ``gpu_check.jsonl``). On a CPU
machine the same bodies run: the torch backend's CP gradients in the fast loop, fla's kernels
under Triton's interpreter (the ``fla_interpreter`` tier, marked slow), bfloat16 only on CUDA
(the interpreter computes in numpy).

Tolerances (``max |a - b| / max |b|`` per tensor): fla vs torch on CUDA 5e-3 in float32 (fla's
matmuls run in TF32; measured on the H200 2026-12-04: 1.2e-3 to 2.0e-3 for KDA) and 5e-2 in
bfloat16; under the interpreter 2e-5 (float32 throughout). CP vs unsharded: the torch kernels
1e-4 (float32 against float64; measured <= 6.3e-7), fla 5e-3 on CUDA (TF32), 2e-5 interpreted.
"""

from __future__ import annotations

import pytest
import torch

from tests import cp_gradients, fla_interpreter
from tests.recurrences import CASES, RecurrenceCase
from tests.reference import rel_err
from torchtitan_cp.ops import causal_conv1d
from torchtitan_cp.ops.cp.recurrence import SequenceTables, recurrence, run_local
from torchtitan_cp.routing import chunk_indices, chunk_offsets

pytestmark = pytest.mark.gpu_check

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
# On CUDA the trainer's model shapes (head_dim 64; fla's own tiles); interpreted, small ones.
K = V = 64 if CUDA else 32
PER_RANK = 128 if CUDA else 32
CU = [0, 1, 70, 70, 200, 333, 512] if CUDA else [0, 0, 1, 38, 38, 120, 128]
FLA_TOL = {torch.float32: 5e-3 if CUDA else 2e-5, torch.bfloat16: 5e-2}
CP_TOL = {"torch": 1e-4, "fla": 5e-3 if CUDA else 2e-5}


def _fla_here() -> str | None:
    """Why fla's kernels cannot run in this process, or None."""
    if CUDA:
        return None
    return fla_interpreter.reason()


# fla's kernels: compiled on CUDA, interpreted (slow) on CPU.
FLA = [pytest.mark.slow, pytest.mark.fla_interpreter]


def _needs_fla() -> None:
    why = _fla_here()
    if why is not None:
        pytest.skip(why)


def _fla_refused(case: RecurrenceCase) -> str | None:
    """Why fla refuses this case's recurrence here (its kernels' own answer), or None."""
    return recurrence(case.name, **case.options).fla_refusal()


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_cp_gradients_on_every_rank_torch(case, record_property):
    cmp = cp_gradients.cp_gradients(case, "torch", DEVICE, tokens_per_rank=PER_RANK, K=K, V=V)
    res = cp_gradients.compare(cmp, CP_TOL["torch"])
    record_property("cp_gradients", res)
    assert cmp["published_summaries"] == cp_gradients.WORLD - 1  # every rank but the last
    assert len(res["max_rel_grad_err_per_rank"]) == cp_gradients.WORLD
    assert res["within_tol"], res


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id, marks=FLA) for c in CASES])
def test_cp_gradients_on_every_rank_fla(case, record_property):
    _needs_fla()
    refused = _fla_refused(case)
    if refused is not None:
        pytest.skip(f"fla refuses this backward here: {refused}")
    cmp = cp_gradients.cp_gradients(case, "fla", DEVICE, tokens_per_rank=PER_RANK, K=K, V=V)
    res = cp_gradients.compare(cmp, CP_TOL["fla"])
    record_property("cp_gradients", res)
    assert res["within_tol"], res


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_cp_gradient_check_fails_on_wrong_non_last_rank_gradients(case):
    # The check of the check: a fold whose backward is 10 % off (forward exact) fails every rank
    # that publishes a summary and passes the last one (measured 2-6e-2 against 2e-7 on KDA).
    inner = recurrence(case.name, backend="torch", **case.options)
    cmp = cp_gradients.cp_gradients(
        case, "torch", DEVICE, tokens_per_rank=32, K=16, V=16, rec=cp_gradients.PerturbedFold(inner)
    )
    res = cp_gradients.compare(cmp, CP_TOL["torch"])
    grad, fwd = res["max_rel_grad_err_per_rank"], res["max_rel_out_err_per_rank"]
    assert not res["within_tol"]
    assert max(fwd) <= res["tol"], fwd  # the forward is exact: only gradients tell
    assert all(e > 100 * res["tol"] for e in grad[:-1]), grad  # every non-last rank
    assert grad[-1] <= res["tol"], grad  # the last rank publishes nothing


def _local(case, inputs, backend, cu, backward: bool = True):
    """(o, final, every input's gradient) of the local kernel through the registry, on the
    routing's chunk tables (``routing.chunks``), forward and (``backward``) backward."""
    cu_cpu = torch.tensor(cu, dtype=torch.int32)
    tables = SequenceTables(
        cu_cpu.to(DEVICE),
        cu_cpu,
        chunk_indices(cu_cpu, 64).to(DEVICE),
        chunk_offsets(cu_cpu, 64).to(DEVICE),
    )
    leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
    rec = recurrence(case.name, backend=backend, **case.options)
    o, final = run_local(rec, tuple(leaves[:-1]), tables, leaves[-1], output_final_state=True)
    assert final is not None
    if not backward:
        return [o, final]
    gen = torch.Generator().manual_seed(7)
    do = torch.randn(o.shape, generator=gen).to(DEVICE, o.dtype)
    dfinal = torch.randn(final.shape, generator=gen).to(DEVICE, final.dtype)
    grads = torch.autograd.grad((o * do).sum() + (final * dfinal).sum(), leaves)
    return [o, final, *grads]


DTYPES = [pytest.param(torch.float32, id="float32"), pytest.param(torch.bfloat16, id="bfloat16")]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", [pytest.param(c, id=c.id, marks=FLA) for c in CASES])
def test_fla_matches_torch(case, dtype, record_property):
    _needs_fla()
    if dtype is torch.bfloat16 and not CUDA:
        pytest.skip("bfloat16: CUDA only (the interpreter computes in numpy)")
    seed = sum(map(ord, case.id))
    N, T = len(CU) - 1, CU[-1]
    HV = case.inputs(1, 0, torch.float32, K=K, V=V)[2].shape[2]
    h0 = torch.randn(N, HV, K, V, generator=torch.Generator().manual_seed(seed)) * 0.1
    inputs = [x.to(DEVICE) for x in case.inputs(T, seed, torch.float32, K=K, V=V)]
    # Token inputs in dtype, except the gates (fla keeps log gates in float32), h0 float32.
    inputs = [x if n == "g" else x.to(dtype) for x, n in zip(inputs, case.names)]
    inputs.append(h0.to(DEVICE))
    # Where fla refuses the case's backward (fla #640) its forward is still checked, and says so.
    refused = _fla_refused(case)
    if refused is not None:
        record_property("note", f"forward only: {refused}")
    fla = _local(case, inputs, "fla", CU, backward=refused is None)
    ref = _local(case, inputs, "torch", CU, backward=refused is None)
    names = ("o", "final", *(f"d{n}" for n in (*case.names, "h0")))
    errs = {n: rel_err(a.float(), b.float()) for n, a, b in zip(names, fla, ref)}
    record_property("max_rel_err", errs)
    bad = {n: e for n, e in errs.items() if e > FLA_TOL[dtype]}
    assert not bad, (bad, FLA_TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("_", [pytest.param(0, id="conv", marks=FLA)])
def test_fla_conv_matches_torch(_, dtype, record_property):
    # With the CP history (initial_state) as the model passes it; without is
    # tests/test_fla_interpreter.py's conv check (dense and packed, with bias).
    _needs_fla()
    if dtype is torch.bfloat16 and not CUDA:
        pytest.skip("bfloat16: CUDA only (the interpreter computes in numpy)")
    gen = torch.Generator().manual_seed(3)
    T, D, N = CU[-1], 2 * K, len(CU) - 1
    x = torch.randn(1, T, D, generator=gen).to(DEVICE, dtype)
    w = torch.randn(D, 4, generator=gen).to(DEVICE, dtype)
    h0 = torch.randn(N, D, 3, generator=gen).to(DEVICE, dtype)
    cu_cpu = torch.tensor(CU, dtype=torch.int32)
    out = {}
    for backend in ("fla", "torch"):
        leaves = [t.clone().requires_grad_() for t in (x, w, h0)]
        y = causal_conv1d(
            leaves[0],
            leaves[1],
            None,
            cu_seqlens=cu_cpu.to(DEVICE),
            cu_seqlens_cpu=cu_cpu,
            chunk_indices=chunk_indices(cu_cpu, 64).to(DEVICE),
            initial_state=leaves[2],
            backend=backend,
        )
        out[backend] = [y, *torch.autograd.grad(y.float().square().mean(), leaves)]
    names = ("o", "dx", "dweight", "dh0")
    errs = {n: rel_err(a.float(), b.float()) for n, a, b in zip(names, out["fla"], out["torch"])}
    record_property("max_rel_err", errs)
    bad = {n: e for n, e in errs.items() if e > FLA_TOL[dtype]}
    assert not bad, (bad, FLA_TOL[dtype])
