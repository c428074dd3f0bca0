"""fla-core's Triton kernels on CPU, through Triton's interpreter: the ``fla_interpreter`` tier.

tests/conftest.py installs the interpreter (tests/fla_interpreter.py) before collection; where it
cannot (no triton, another triton, CUDA present) every test here skips with that one line.
The recurrence checks run every case of tests/recurrences.py (every registered recurrence and
its options) through the registry, so a new recurrence needs no edit here. Everything runs in
float32 (the interpreter computes in numpy; bf16 is not supported there) at small shapes: T = 64 (dense) or 128 (packed, with empty and one-token sequences), K = V = 32,
grouped value heads (HV = 2 H).

Tolerances, as ``rel_err`` (max |a - b| / max(1, max |b|)):

* fla vs fla's naive recurrences (and, in tests/test_gpu_parity.py, vs the PyTorch backend),
  values, final states and every gradient: ``TOL = 2e-5`` (float32 chunked vs float32 chunked or recurrent; measured <= 3e-6).
* The routing's host-built chunk tables vs fla building its own: bitwise (``torch.equal``).
* Compiled (aot_eager, inductor) vs eager through the custom ops: ``COMPILE_TOL = 1e-6``.

Each check prints its measured error (``pytest -s``). What the interpreter cannot check: TF32,
bf16, autotuned configs (one per kernel here), fast math, pinned memory, streams and syncs.
"""

from __future__ import annotations

import collections
import functools

import pytest
import torch
import torch.nn.functional as F

from tests import fla_interpreter
from tests.recurrences import CASES, RecurrenceCase
from tests.reference import rel_err
from torchtitan_cp.ops import causal_conv1d
from torchtitan_cp.ops.cp.recurrence import SequenceTables, run_local
from torchtitan_cp.ops.cp.recurrence import recurrence as registered
from torchtitan_cp.routing import chunk_indices, chunk_offsets

pytestmark = [
    pytest.mark.fla_interpreter,
    pytest.mark.slow,
    pytest.mark.skipif(fla_interpreter.reason() is not None, reason=str(fla_interpreter.reason())),
]

TOL = 2e-5
COMPILE_TOL = 1e-6
H, HV, K, V = 1, 2, 32, 32
T_DENSE = 64
# Packed: an empty first sequence, a one-token one, an empty one mid-stream, one over two chunks.
CU = [0, 0, 1, 38, 38, 120, 128]
LAYOUTS = {"dense": None, "varlen": CU}


def report(check: str, err: float, tol: float) -> None:
    print(f"[fla_interpreter] {check}: {err:.2e} (tol {tol:.0e})")
    assert err <= tol, f"{check}: {err:.3e} > {tol:.0e}"


CASE = {c.id: c for c in CASES}
ids = pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)


def _inputs(case: RecurrenceCase, layout: str) -> list[torch.Tensor]:
    """Leaves: the case's inputs (float32, K = V = 32) and an initial state ``h0``."""
    cu = LAYOUTS[layout]
    T = T_DENSE if cu is None else cu[-1]
    N = 1 if cu is None else len(cu) - 1
    seed = sum(map(ord, case.id + layout))  # stable across runs
    h0 = torch.randn(N, HV, K, V, generator=torch.Generator().manual_seed(seed)) * 0.1
    return [*case.inputs(T, seed, torch.float32, K=K, V=V), h0]


def _cotangents(o: torch.Tensor, final: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return torch.randn(o.shape, generator=gen), torch.randn(final.shape, generator=gen)


@functools.cache
def recurrence(case_id: str, layout: str, backend: str, tables: bool = False):
    """(o, final, grads of every leaf) of one local kernel call through the registry; cached:
    checks share the runs."""
    case = CASE[case_id]
    cu = LAYOUTS[layout]
    leaves = [x.clone().requires_grad_(True) for x in _inputs(case, layout)]
    seq = SequenceTables(None, None, None, None)  # type: ignore[arg-type]  # one dense sequence
    if cu is not None:
        cu_t = torch.tensor(cu, dtype=torch.int32)
        ci, co = (chunk_indices(cu_t, 64), chunk_offsets(cu_t, 64)) if tables else (None, None)
        seq = SequenceTables(cu_t, cu_t, ci, co)
    rec = registered(case.name, backend=backend, **case.options)
    o, final = run_local(rec, tuple(leaves[:-1]), seq, leaves[-1], True)
    do, dfinal = _cotangents(o, final)
    grads = torch.autograd.grad((o * do).sum() + (final * dfinal).sum(), leaves)
    return o.detach(), final.detach(), grads


# fla against the PyTorch backend (packed, the routing's chunk tables, every gradient) is
# tests/test_gpu_parity.py's test_fla_matches_torch: the same body the GPU check runs on CUDA.


@ids
def test_fla_matches_its_naive_recurrence(case):
    """Dense: fla's chunked kernels against fla's own token-by-token PyTorch references."""
    o, fin, grads = recurrence(case.id, "dense", "fla")
    leaves = [x.clone().requires_grad_(True) for x in _inputs(case, "dense")]
    o_ref, fin_ref = case.fla_naive(*leaves[:-1], initial_state=leaves[-1])
    do, dfinal = _cotangents(o_ref, fin_ref)
    grads_ref = torch.autograd.grad((o_ref * do).sum() + (fin_ref * dfinal).sum(), leaves)
    report(f"{case.id} dense o vs naive", rel_err(o, o_ref.detach()), TOL)
    report(f"{case.id} dense final vs naive", rel_err(fin, fin_ref.detach()), TOL)
    for name, a, b in zip([*case.names, "h0"], grads, grads_ref, strict=True):
        report(f"{case.id} dense d{name} vs naive", rel_err(a, b), TOL)


def test_retention_on_fla_matches_torch_and_fla_chunk_retention():
    """Retention (layer R: SSD with RetNet's fixed decay, ``SSD.fixed_decay``), varlen: fla's
    ``chunk_simple_gla`` with the decay as a per-token gate against the torch backend, and
    against fla-core's own ``chunk_retention`` (``chunk_simple_gla`` with a constant
    ``g_gamma``), outputs, final states and the gradients of q, k, v, h0."""
    from fla.ops.retention import chunk_retention

    from torchtitan_cp.models.mixers.retention import retention_decay

    cu_t = torch.tensor(CU, dtype=torch.int32)
    tables = SequenceTables(cu_t, cu_t, None, None)
    q, k, v, _, h0 = _inputs(CASE["ssd"], "varlen")

    def run(fn):
        leaves = [x.clone().requires_grad_(True) for x in (q, k, v, h0)]
        o, fin = fn(*leaves)
        do, dfinal = _cotangents(o, fin)
        grads = torch.autograd.grad((o * do).sum() + (fin * dfinal).sum(), leaves)
        return [o.detach(), fin.detach(), *grads]

    def ours(backend):
        rec = registered("ssd", backend=backend, fixed_decay=retention_decay)
        return lambda q, k, v, h0: run_local(rec, (q, k, v), tables, h0, True)

    def fla_own(q, k, v, h0):
        rep = HV // H
        q, k = q.repeat_interleave(rep, 2), k.repeat_interleave(rep, 2)
        return chunk_retention(
            q, k, v, initial_state=h0, output_final_state=True, cu_seqlens=cu_t.long()
        )

    got = run(ours("fla"))
    for ref_name, ref in (("torch", run(ours("torch"))), ("chunk_retention", run(fla_own))):
        for name, a, b in zip(["o", "final", "dq", "dk", "dv", "dh0"], got, ref, strict=True):
            report(f"retention varlen {name} vs {ref_name}", rel_err(a, b), TOL)


@ids
def test_routing_tables_give_fla_results_bitwise(case):
    """With the routing's host-built tables (KDA, SSD and GLA through ``fla_compat``'s
    chunk-table shim, GDN through fla's ``chunk_indices``) the results are fla's own, bit for
    bit."""
    o, fin, grads = recurrence(case.id, "varlen", "fla", tables=True)
    o_own, fin_own, grads_own = recurrence(case.id, "varlen", "fla", tables=False)
    assert torch.equal(o, o_own) and torch.equal(fin, fin_own)
    for name, a, b in zip([*case.names, "h0"], grads, grads_own, strict=True):
        assert torch.equal(a, b), f"d{name}"
    print(f"[fla_interpreter] {case.id} varlen routing tables vs fla's own: bitwise")


@pytest.mark.parametrize("case", [c for c in CASES if c.id in ("kda", "gdn")], ids=lambda c: c.id)
def test_eager_delta_rule_is_fla_public_function_bitwise(case):
    """The eager delta rule on fla is fla's pieces under our autograd nodes, the ones the CP layer
    shares (ops/delta_rule/fla_kernel.py). It equals fla's own ``chunk_kda`` /
    ``chunk_gated_delta_rule`` bit for bit: outputs, final states and every gradient (packed,
    grouped value heads, an entry state)."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    from fla.ops.kda import chunk_kda

    o, fin, grads = recurrence(case.id, "varlen", "fla", tables=True)
    leaves = [x.clone().requires_grad_(True) for x in _inputs(case, "varlen")]
    cu_t = torch.tensor(CU, dtype=torch.int32)
    public = chunk_kda if case.name == "kda" else chunk_gated_delta_rule
    o_own, fin_own = public(
        *leaves[:-1],
        initial_state=leaves[-1],
        output_final_state=True,
        cu_seqlens=cu_t,
        cu_seqlens_cpu=cu_t,
    )
    do, dfinal = _cotangents(o_own, fin_own)
    grads_own = torch.autograd.grad((o_own * do).sum() + (fin_own * dfinal).sum(), leaves)
    assert torch.equal(o, o_own.detach()) and torch.equal(fin, fin_own.detach())
    for name, a, b in zip([*case.names, "h0"], grads, grads_own, strict=True):
        assert torch.equal(a, b), f"d{name}"
    print(f"[fla_interpreter] {case.id} varlen eager kernel vs fla's {public.__name__}: bitwise")


@functools.cache
def conv(layout: str, backend: str, tables: bool = False):
    cu = LAYOUTS[layout]
    T = T_DENSE if cu is None else cu[-1]
    N, D, W = (1 if cu is None else len(cu) - 1), 64, 4
    gen = torch.Generator().manual_seed(3)
    leaves = [
        torch.randn(*shape, generator=gen).requires_grad_(True)
        for shape in ((1, T, D), (D, W), (D,), (N, D, W - 1))
    ]
    kw: dict = dict(initial_state=leaves[3], backend=backend)
    if cu is not None:
        cu_t = torch.tensor(cu, dtype=torch.int32)
        kw.update(cu_seqlens=cu_t, cu_seqlens_cpu=cu_t)
        if tables:
            kw["chunk_indices"] = chunk_indices(cu_t, 64)
    y = causal_conv1d(*leaves[:3], **kw)
    dy = torch.randn(y.shape, generator=gen)
    return y.detach(), torch.autograd.grad((y * dy).sum(), leaves)


@pytest.mark.parametrize("layout", ["dense", "varlen"])
def test_fla_conv_matches_torch_backend(layout):
    y, grads = conv(layout, "fla")
    y_ref, grads_ref = conv(layout, "torch")
    report(f"conv {layout} y vs torch", rel_err(y, y_ref), TOL)
    for name, a, b in zip(("x", "weight", "bias", "h0"), grads, grads_ref):
        report(f"conv {layout} d{name} vs torch", rel_err(a, b), TOL)
    if layout == "varlen":
        y_t, grads_t = conv(layout, "fla", tables=True)
        assert torch.equal(y_t, y) and all(torch.equal(a, b) for a, b in zip(grads_t, grads))
        print("[fla_interpreter] conv varlen routing tables vs fla's own: bitwise")


# ----------------------------------------------------------------------------- custom ops
# ops/delta_rule/, ops/conv/, ops/ssd/custom_ops.py: what torch.compile runs instead of
# fla's autograd functions.

CU_OP = [0, 0, 20, 20, 64]  # two empty sequences


def _fla_op(case: RecurrenceCase):
    """The case's fla custom op and its arguments (as its local kernel calls it under
    torch.compile: the routing's chunk tables), float32 leaves."""
    gen = torch.Generator().manual_seed(11)
    T, N = CU_OP[-1], len(CU_OP) - 1
    xs = [x.requires_grad_(True) for x in case.inputs(T, 11, torch.float32, K=K, V=V)]
    h0 = (torch.randn(N, HV, K, V, generator=gen) * 0.1).requires_grad_(True)
    cu = torch.tensor(CU_OP, dtype=torch.int32)
    return case.fla_op(xs, h0, cu, cu, chunk_indices(cu, 64), chunk_offsets(cu, 64), K**-0.5)


@ids
def test_fla_op_writes_every_output_element(case, monkeypatch):
    """Every allocation fla makes is NaN-filled: finite outputs mean each element the op returns
    was written (an op returning uninitialised memory differs from run to run). An op that
    takes another op's results (the delta rule's preparation, run by ``case.fla_op``) has
    those checked too."""
    for name in ("empty", "empty_like"):
        real = getattr(torch, name)

        def poisoned(*a, _real=real, **kw):
            t = _real(*a, **kw)
            return t.fill_(float("nan")) if t.is_floating_point() else t

        monkeypatch.setattr(torch, name, poisoned)
    op, args = _fla_op(case)
    args = tuple(x.detach() if isinstance(x, torch.Tensor) else x for x in args)
    prepared = [x for arg in args if isinstance(arg, list) for x in arg]
    outs = op(*args)
    for name, out in zip(("o", "final", "g_cumsum", "A1", "A2"), outs):
        assert torch.isfinite(out).all(), f"{case.id} {name}: {int(out.isnan().sum())} unwritten"
    for i, x in enumerate(prepared):
        assert torch.isfinite(x).all(), f"{case.id} prepared[{i}]: {int(x.isnan().sum())} unwritten"


@ids
def test_fla_op_opcheck(case):
    torch.library.opcheck(*_fla_op(case))


def _summaries_op_args(case: RecurrenceCase):
    """The compiled path's summaries on CU_OP's sequences (two empty), float32 leaves."""
    xs = [x.requires_grad_(True) for x in case.inputs(CU_OP[-1], 13, torch.float32, K=K, V=V)]
    kind = case.options.get("kind", case.name)
    return xs, torch.tensor(CU_OP, dtype=torch.int32), kind


@pytest.mark.parametrize("case", [c for c in CASES if c.name in ("kda", "gdn")], ids=lambda c: c.id)
def test_fla_summaries_op_matches_torch_and_opchecks(case):
    """The compiled path's states-only summaries on fla (no output kernel; backward at width
    V + K from [0 | I] for a full cotangent [dE | dM]) against the torch backend's op (float64),
    values and every gradient, and opcheck."""
    from torchtitan_cp.ops.delta_rule import custom_ops

    xs, cu, kind = _summaries_op_args(case)
    ci = chunk_indices(cu, 64)
    # The factors as the CP layer hands them over: the preparation op's, query scores left out.
    factors = custom_ops.delta_rule_fla_prepare_op(
        *(x.detach() for x in xs), cu, cu, ci, kind, K**-0.5
    )
    factors[2] = factors[2][:0]
    # The last row marked padding (the routing's capped stream): identity, zero gradients.
    rows = torch.tensor([0, 1, 2, -1], dtype=torch.int32)
    S = custom_ops.delta_rule_summaries_fla_op(*xs, factors, cu, cu, ci, rows, kind, K**-0.5)
    ref_xs = [x.detach().double().requires_grad_(True) for x in xs]
    S_ref = custom_ops.delta_rule_summaries_torch_op(*ref_xs, cu, rows, kind, K**-0.5)
    dS = torch.randn(S.shape, generator=torch.Generator().manual_seed(3))
    grads = torch.autograd.grad(S, xs, dS)
    ref = torch.autograd.grad(S_ref, ref_xs, dS.double())
    report(f"{case.id} summaries op vs torch", rel_err(S, S_ref), TOL)
    for name, a, b in zip(case.names, grads, ref, strict=True):
        report(f"{case.id} summaries op d{name} vs torch", rel_err(a, b), TOL)
    op = custom_ops.delta_rule_summaries_fla_op
    torch.library.opcheck(op, (*xs, factors, cu, cu, ci, rows, kind, K**-0.5))


@pytest.mark.parametrize("case", [c for c in CASES if c.id in ("kda", "gdn")], ids=lambda c: c.id)
def test_fla_op_pair_is_the_eager_kernel_bitwise(case):
    """The compiled local kernel on fla, the preparation op then the local op on its factors
    (the factors a CP layer's summaries op shares), gives the eager kernel's outputs and
    gradients bit for bit (the eager kernel is fla's own functions bitwise, above)."""
    from torchtitan_cp.ops.delta_rule.fla_kernel import chunk_delta_rule_fla

    op, args = _fla_op(case)
    xs, (_, h0, cu, cu_cpu, ci, kind, scale, _) = list(args[:5]), args[5:]
    o, fin = op(*args)
    do, dfinal = _cotangents(o, fin)
    leaves = [*xs, h0]
    got = torch.autograd.grad((o * do).sum() + (fin * dfinal).sum(), leaves)
    tables = SequenceTables(cu, cu_cpu, ci, None)
    o2, fin2 = chunk_delta_rule_fla(
        tuple(xs), tables, kind=kind, scale=scale, initial_state=h0, output_final_state=True
    )
    assert fin2 is not None
    want = torch.autograd.grad((o2 * do).sum() + (fin2 * dfinal).sum(), leaves)
    assert torch.equal(o, o2) and torch.equal(fin, fin2)
    for name, a, b in zip([*case.names, "h0"], got, want, strict=True):
        assert torch.equal(a, b), f"d{name}"


def test_fla_conv_op_opcheck():
    from torchtitan_cp.ops.conv import custom_ops

    gen = torch.Generator().manual_seed(12)
    T, N, D = CU_OP[-1], len(CU_OP) - 1, 16
    x = torch.randn(1, T, D, generator=gen, requires_grad=True)
    w = torch.randn(D, 4, generator=gen, requires_grad=True)
    b = torch.randn(D, generator=gen, requires_grad=True)
    h = torch.randn(N, D, 4, generator=gen, requires_grad=True)  # fla's [N, D, W] cache layout
    cu = torch.tensor(CU_OP, dtype=torch.int32)
    torch.library.opcheck(custom_ops.causal_conv1d_fla_op, (x, w, b, h, cu, cu, None, "silu"))


def _block(recs, x, w, h0, cu, ci, co, *gates):
    """Every case of tests/recurrences.py in one block as models/mixers/ feeds the kernels: the
    routing's chunk tables (eager fla through ``fla_compat``'s shims), conv over [q|k|v], q/k/v
    split views of its output (v non-contiguous), then each case's recurrence (``recs``, built
    from the registry, one per case) on those q, k, v, its own gates and a shared ``h0``, final
    states requested. ``gates``: every case's inputs after (q, k, v), in case order."""
    T = x.shape[1]
    y = causal_conv1d(
        x, w, cu_seqlens=cu, cu_seqlens_cpu=cu, chunk_indices=ci, backend=recs[0].backend
    )
    q, k, v = y.split([H * K, H * K, HV * V], dim=-1)
    q = F.normalize(q.view(1, T, H, K), dim=-1)
    k = F.normalize(k.view(1, T, H, K), dim=-1)
    v = v.unflatten(-1, (HV, V))  # a view with the row stride of y
    tables = SequenceTables(cu, cu, ci, co)
    outs, rest = [], list(gates)
    for case, rec in zip(CASES, recs, strict=True):
        own = [rest.pop(0) for _ in case.names[3:]]
        o, fin = run_local(rec, (*case.projected(q, k, v), *own), tables, h0, True)
        outs += [o, fin]
    return outs


def _block_leaves() -> list[torch.Tensor]:
    """x, the conv weight, h0, then every case's gates (its inputs after q, k, v)."""
    gen = torch.Generator().manual_seed(13)
    T, N = CU_OP[-1], len(CU_OP) - 1
    D = 2 * H * K + HV * V
    xs = [
        torch.randn(1, T, D, generator=gen),
        torch.randn(D, 4, generator=gen) * 0.5,
        torch.randn(N, HV, K, V, generator=gen) * 0.1,
    ]
    for case in CASES:
        xs += case.inputs(T, 13, torch.float32, K=K, V=V)[3:]
    return [x.requires_grad_(True) for x in xs]


def _block_grads(fn, backend="fla") -> list[torch.Tensor]:
    """Forward, then backward with a dense cotangent for the outputs and expanded ones (stride
    0 over sequences, K and V; one value per head) for the final states, as a reduction gives."""
    leaves = _block_leaves()
    cu = torch.tensor(CU_OP, dtype=torch.int32)
    recs = [registered(c.name, backend=backend, **c.options) for c in CASES]
    outs = fn(recs, *leaves[:3], cu, chunk_indices(cu, 64), chunk_offsets(cu, 64), *leaves[3:])
    gen = torch.Generator().manual_seed(14)
    do, c = torch.randn(outs[0].shape, generator=gen), torch.randn(HV, generator=gen)
    loss = sum((o * do).sum() + (f.sum((0, 2, 3)) * c).sum() for o, f in zip(outs[::2], outs[1::2]))
    assert isinstance(loss, torch.Tensor)
    return [*(x.detach() for x in outs), *torch.autograd.grad(loss, leaves)]


BLOCK_NAMES = [
    *(f"{out}_{c.id}" for c in CASES for out in ("o", "final")),
    "dx", "dw", "dh0",
    *(f"d{name}_{c.id}" for c in CASES for name in c.names[3:]),
]  # fmt: skip # a table, laid out by hand to read across


@functools.cache
def _eager_block() -> list[torch.Tensor]:
    return _block_grads(_block)


def test_eager_block_matches_torch_backend():
    """The eager fla path (adapters and the chunk-table shim) with a split view for v and
    expanded final-state cotangents against the PyTorch kernels, every registered recurrence."""
    got, ref = _eager_block(), _block_grads(_block, "torch")
    assert len(got) == len(ref) == len(BLOCK_NAMES)
    for name, a, b in zip(BLOCK_NAMES, got, ref, strict=True):
        report(f"eager block fla vs torch {name}", rel_err(a, b), TOL)


@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
def test_compiled_block_matches_eager(compiler):
    """fullgraph compile (the custom ops) gives eager's outputs and every gradient, with a split
    view for v and an expanded cotangent for the final states."""
    torch._dynamo.reset()
    compiled = torch.compile(_block, backend=compiler, fullgraph=True)
    got, ref = _block_grads(compiled), _eager_block()
    assert len(got) == len(ref) == len(BLOCK_NAMES)
    errs = {
        n: rel_err(a, b) if torch.isfinite(a).all() else float("inf")
        for n, a, b in zip(BLOCK_NAMES, got, ref, strict=True)
    }
    for name, err in errs.items():  # every error first, then the verdict
        print(f"[fla_interpreter] compiled ({compiler}) vs eager {name}: {err:.2e}")
    report(f"compiled ({compiler}) vs eager, worst", max(errs.values()), COMPILE_TOL)


# ----------------------------------------------------------------------------- summaries
# World 1 with fragments out of token order: the span publishes summaries and folds them. The
# fragment (20, 21) continues document [1, 40) and is continued, so its summary is applied to a
# nonzero entry state, the one its backward runs from on fla (fla_compat's states-only pass).
SPAN_CU = [0, 1, 40, 110, 150]
SPAN_TABLE = [[(90, 150), (0, 20), (20, 21), (21, 90)]]


def _out_of_order_span(case: RecurrenceCase, compiled: bool = False) -> None:
    from tests.dist_utils import device_routing, loose_caps, span_index
    from torchtitan_cp.ops.cp.driver import context_parallel_recurrence

    # Compiled: capped routing as compile uses it (the summary stream padded with rows that
    # publish nothing, which the summaries op skips).
    caps = loose_caps(SPAN_CU, SPAN_TABLE) if compiled else None
    routing = device_routing(SPAN_CU, SPAN_TABLE, 0, caps=caps)
    span = torch.tensor(span_index(SPAN_TABLE[0]), dtype=torch.int64)
    full = case.inputs(SPAN_CU[-1], 11, torch.float32, K=K, V=V)
    d_o = torch.randn(1, span.numel(), HV, V, generator=torch.Generator().manual_seed(5))
    runs = {}
    for backend, dtype in (("fla", torch.float32), ("torch", torch.float64)):
        loc = [x.to(dtype).index_select(1, span).requires_grad_(True) for x in full]
        rec = registered(case.name, backend=backend, **case.options)

        def run(*xs, rec=rec):
            return context_parallel_recurrence(
                rec, xs, routing=routing, group=None, output_final_state=True
            )

        if compiled and backend == "fla":
            torch._dynamo.reset()
            run = torch.compile(run, backend="aot_eager", fullgraph=True)
        o, fin = run(*loc)
        assert fin is not None
        grads = torch.autograd.grad((o * d_o.to(dtype)).sum() + fin.sum(), loc)
        runs[backend] = [o.detach(), fin.detach(), *grads]
    label = "compiled " if compiled else ""
    for name, a, b in zip(["o", "final", *("d" + n for n in case.names)], *runs.values()):
        report(f"{case.id} {label}out-of-order span {name} vs torch", rel_err(a, b), TOL)


@ids
def test_out_of_order_span_on_fla_matches_torch(case):
    _out_of_order_span(case)


@pytest.mark.parametrize("case", [c for c in CASES if c.name in ("kda", "gdn")], ids=lambda c: c.id)
def test_compiled_out_of_order_span_on_fla_matches_torch(case):
    """The same span compiled (aot_eager): fla's local kernel and the states-only summaries as
    custom ops (the summaries' backward from the full cotangent, at width V + K)."""
    _out_of_order_span(case, compiled=True)


# The recorder's aot_eager returns an unboxed function (a debugging backend's choice).
@pytest.mark.filterwarnings("ignore:Your compiler for AOTAutograd:UserWarning")
def test_compiled_cp_layer_on_fla_prepares_once_without_recompiles():
    """GDN (the ops and their wiring are the same for KDA, whose compiled CP layer the
    out-of-order span checks), compiled (aot_eager, capped routing): a CP layer on fla runs
    fla's preparation once: the
    traced graph calls ``delta_rule_fla_prepare`` once and the local op and the summaries op
    take its factors (no second preparation, forward or backward). A second layout under the
    same caps reuses the graph, and both match the eager layer."""
    from torch._dynamo.testing import AotEagerAndRecordGraphs

    from tests.dist_utils import device_routing, loose_caps, span_index
    from torchtitan_cp.ops.cp.driver import context_parallel_recurrence

    case = CASE["gdn"]
    caps = loose_caps(SPAN_CU, SPAN_TABLE)
    rec = registered(case.name, backend="fla", **case.options)

    def layer(*xs, routing):
        return context_parallel_recurrence(rec, xs, routing=routing, group=None)[0]

    torch._dynamo.reset()
    graphs = AotEagerAndRecordGraphs()
    compiled = torch.compile(layer, backend=graphs, fullgraph=True)
    for cu in (SPAN_CU, [0, 60, 150]):  # the second: other documents, the same fragments
        routing = device_routing(cu, SPAN_TABLE, 0, caps=caps)
        span = torch.tensor(span_index(SPAN_TABLE[0]), dtype=torch.int64)
        full = case.inputs(cu[-1], len(cu), torch.float32, K=K, V=V)
        outs = []
        for fn in (compiled, layer):
            xs = [x.index_select(1, span).requires_grad_(True) for x in full]
            o = fn(*xs, routing=routing)
            outs.append([o.detach(), *torch.autograd.grad(o.square().sum(), xs)])
        for name, a, b in zip(["o", *("d" + n for n in case.names)], *outs, strict=True):
            report(
                f"{case.id} compiled CP layer layout {len(cu) - 1} docs {name}",
                rel_err(a, b),
                COMPILE_TOL,
            )
    assert len(graphs.graphs) == 1, f"{len(graphs.graphs)} graphs: a layout recompiled"
    ops = collections.Counter(
        str(n.target) for n in graphs.graphs[0].graph.nodes if n.op == "call_function"
    )
    calls = {op: n for op, n in ops.items() if op.startswith("torchtitan_cp.")}
    assert calls == {
        "torchtitan_cp.delta_rule_fla_prepare.default": 1,
        "torchtitan_cp.delta_rule_fla_local.default": 1,
        "torchtitan_cp.delta_rule_summaries_fla.default": 1,
    }, calls


# ----------------------------------------------------------------------------- CP driver
# The recurrence driver with fla as its local kernel, 2 and 3 gloo ranks (one spawn of 3, a
# group of 2 inside), against the unsharded float64 PyTorch kernel on the same float32 inputs.

CP_ROWS, CP_ROW_LEN = 2, 48  # PTRR: 8-token blocks x 2 or 3 ranks divide 48


def _cp_layouts(world: int) -> list[tuple[str, str, list[int], list]]:
    """(case id, layout name, cu, table): the balancers' layouts (contiguous, head-tail, PTRR)
    and a random table, 4 per world; every case gets one at each world, rotating so that the
    cases of tests/recurrences.py share the layouts and the work stays 8 runs per spawn while
    there are at most 4 cases (KDA's kernels cost the most under the interpreter)."""
    from tests.dist_utils import random_cu_seqlens, random_layout
    from torchtitan_cp.routing import contiguous_fragments, headtail_fragments, host_layout

    gen = torch.Generator().manual_seed(100 + world)
    cus = [random_cu_seqlens(gen, CP_ROWS, CP_ROW_LEN, max_doc=40) for _ in range(4)]
    positions = torch.cat([torch.arange(b - a) for a, b in zip(cus[2][:-1], cus[2][1:])])
    ptrr = host_layout(
        positions.view(CP_ROWS, CP_ROW_LEN),
        load_balancer="ptrr",
        world_size=world,
        device="cpu",
        block_size=8,
    )
    layouts = [
        ("contiguous", cus[0], contiguous_fragments(CP_ROW_LEN, CP_ROWS, world)),
        ("head-tail", cus[1], headtail_fragments(CP_ROW_LEN, CP_ROWS, world)),
        ("ptrr", cus[2], ptrr.fragments),
        ("random", cus[3], random_layout(gen, CP_ROWS * CP_ROW_LEN, world)),
    ]
    shift = world - 2
    return [(c.id, *layouts[(i + shift) % len(layouts)]) for i, c in enumerate(CASES)]


def _cp_case(rank, group, case_id, cu, table) -> dict[str, float]:
    from tests.dist_utils import device_routing, local_subsequences, span_index
    from torchtitan_cp.ops.cp.driver import context_parallel_recurrence

    case = CASE[case_id]
    total, n_docs = cu[-1], len(cu) - 1
    gen = torch.Generator().manual_seed(total + n_docs)
    full = case.inputs(total, total + n_docs, torch.float32, K=K, V=V)
    d_o = torch.randn(1, total, HV, V, generator=gen)
    d_f = torch.randn(n_docs, HV, K, V, generator=gen)

    def run(inputs, backend, **kw):
        rec = registered(case.name, backend=backend, **case.options)
        return context_parallel_recurrence(rec, tuple(inputs), output_final_state=True, **kw)

    # Unsharded: world 1, one fragment, float64 PyTorch kernel.
    ref = [x.double().requires_grad_(True) for x in full]
    o_ref, f_ref = run(ref, "torch", routing=device_routing(cu, [[(0, total)]], 0), group=None)
    assert f_ref is not None
    ((o_ref * d_o).sum() + (f_ref * d_f).sum()).backward()
    # This rank's span on the fla backend.
    routing = device_routing(cu, table, rank)
    span = torch.tensor(span_index(table[rank]), dtype=torch.int64)
    loc = [x.index_select(1, span).requires_grad_(True) for x in full]
    o, fin = run(loc, "fla", routing=routing, group=group)
    assert fin is not None
    subs = local_subsequences(cu, table[rank])
    term = routing.terminal.tolist()
    docs = torch.tensor([subs[j][2] if j >= 0 else 0 for j in term], dtype=torch.int64)
    live = torch.tensor([j >= 0 for j in term]).view(-1, 1, 1, 1)
    ((o * d_o.index_select(1, span)).sum() + (fin * d_f[docs] * live).sum()).backward()

    def err(a, b):  # a rank may hold no terminal subsequence
        return rel_err(a, b) if a.numel() else 0.0

    errs = {
        "o": err(o, o_ref.detach().index_select(1, span)),
        "final": err(fin * live, f_ref.detach()[docs] * live),
    }
    for name, x, r in zip(case.names, loc, ref, strict=True):
        assert x.grad is not None and r.grad is not None
        errs["d" + name] = err(x.grad, r.grad.index_select(1, span))
    return errs


def _cp_worker(rank: int, world: int) -> dict[str, float]:
    why = fla_interpreter.install()  # a fresh (spawned) process: before fla is imported
    assert why is None, why
    from tests.dist_utils import prefix_groups

    groups = prefix_groups(world, sizes=(2,))
    worst: dict[str, float] = {}
    for w in (2, 3):
        if rank >= w:
            continue
        for case_id, name, cu, table in _cp_layouts(w):
            for key, err in _cp_case(rank, groups[w], case_id, cu, table).items():
                label = f"W{w} {case_id} {name} {key}"
                worst[label] = max(worst.get(label, 0.0), err)
    return worst


def test_cp_driver_on_fla_matches_unsharded():
    from tests.dist_utils import run_distributed

    per_rank = run_distributed(_cp_worker, 3, timeout=600)
    worst: dict[str, float] = {}
    for errs in per_rank:
        for label, err in errs.items():
            worst[label] = max(worst.get(label, 0.0), err)
    cases = sorted({label.rsplit(" ", 1)[0] for label in worst})
    for case in cases:
        report(
            f"CP {case} (worst of o, final, grads)",
            max(e for lab, e in worst.items() if lab.startswith(case + " ")),
            TOL,
        )


# ----------------------------------------------------------------------------- trainer

TRAIN_LOSS_TOL = 1e-5  # absolute, on a loss of ~8.8 (float32 model; measured below)
TRAIN_GRAD_NORM_TOL = 1e-5  # relative


def test_trainer_fla_matches_torch_at_cp2(tmp_path):
    """configs/debug_cpu.toml (KGKA) at CP=2 on 2 gloo ranks, one step of 128 tokens (64 per
    rank): ``linear_attention.backend = "fla"`` (each rank under the interpreter, through
    tests/fla_interpreter_train.py) gives the torch backend's loss and gradient norm."""
    from tests.launch import read_metrics, torchrun_train

    common = [
        "--config_file",
        "configs/debug_cpu.toml",
        "--parallelism.context_parallel_degree",
        "2",
        "--training.steps",
        "1",
        "--training.seq_len",
        "128",
        "--training.local_batch_size",
        "1",
        "--validator.no-enable",
        "--metrics.no-enable-wandb",
    ]
    torchrun_train(
        [*common, "--linear_attention.backend", "torch"], nproc=2, dump_folder=tmp_path / "torch"
    )
    torchrun_train(
        [*common, "--linear_attention.backend", "fla"],
        nproc=2,
        dump_folder=tmp_path / "fla",
        module="tests.fla_interpreter_train",
        timeout=600,
    )
    (ref,), (got,) = read_metrics(tmp_path / "torch"), read_metrics(tmp_path / "fla")
    report("trainer CP=2 fla vs torch |loss diff|", abs(got["loss"] - ref["loss"]), TRAIN_LOSS_TOL)
    report(
        "trainer CP=2 fla vs torch grad_norm rel diff",
        abs(got["grad_norm"] - ref["grad_norm"]) / ref["grad_norm"],
        TRAIN_GRAD_NORM_TOL,
    )


def test_fla_count_bench_splits_flops_by_kernel_and_eager_cp_adds_no_wy_backward():
    """``bench_cp_overhead.py --fla-count``'s rows by kernel (docs/PERFORMANCE.md): each split
    sums to its row's total, and the eager CP layer's excess over the local kernel is only the
    summaries' state kernel and one state backward: its WY preparation and WY backward are the
    local kernel's own, run once (issue 36, point 1)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "bench_cp_overhead.py"
    spec = importlib.util.spec_from_file_location("bench_cp_overhead_count", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    for row in bench.fla_count(["kda", "gdn"], [32], 128):
        for name in ("local", "cp_layer", "compiled"):
            assert sum(row[f"{name}_kernels"].values()) == row[name][0], name
        local, cp = row["local_kernels"], row["cp_layer_kernels"]
        grew = {k for k in cp if cp[k] != local.get(k, 0)}
        assert grew == {
            "chunk_gated_delta_rule_fwd_kernel_h_blockdim64",
            "chunk_gated_delta_rule_bwd_kernel_dhu_blockdim64",
        }, (row["kind"], grew)
