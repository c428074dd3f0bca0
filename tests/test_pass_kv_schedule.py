"""The pass-KV schedule (routing/pass_kv.py), in process: pair tables against a token-by-token
oracle on every load balancer and on random tables, host routing against readback bitwise, the
rounds a known layout skips, the traffic formulas, the flex pair kernel against the math one,
and the config checks of ``model.attention_cp``."""

from __future__ import annotations

import bisect
import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.dist_utils import (
    empty_rank_layout,
    explicit_layout_4,
    ptrr_layout,
    random_cu_seqlens,
    random_layout,
    span_index,
)
from tests.helpers import positions_from_lengths
from tests.test_routing_sources import preprocessors
from torchtitan_cp.models.sequence import SequencePreprocessor
from torchtitan_cp.ops.attention.pass_kv import (
    PairMask,
    flex_pair_attention,
    math_pair_attention,
)
from torchtitan_cp.routing import (
    PassKVRound,
    RoutingPlan,
    contiguous_fragments,
    headtail_fragments,
)
from torchtitan_cp.routing.host_metadata import HostMetadata
from torchtitan_cp.trainer.config import ConfigError


def oracle(cu: list[int], table: list[list[tuple[int, int]]]):
    """Token by token: for every (query rank, key rank != query rank) the hull of the key rows
    some query sees, the hull of those queries' rows, and the number of visible key rows."""
    world = len(table)
    spans = [span_index(f) for f in table]
    doc = [bisect.bisect_right(cu, t) - 1 for t in range(cu[-1])]
    out = {}
    for q in range(world):
        for k in range(world):
            if q == k:
                continue
            keys, queries = set(), set()
            for i, tq in enumerate(spans[q]):
                for j, tk in enumerate(spans[k]):
                    if doc[tq] == doc[tk] and tk <= tq:
                        keys.add(j)
                        queries.add(i)
            if keys:
                out[q, k] = (
                    (min(keys), max(keys) + 1),
                    (min(queries), max(queries) + 1),
                    len(keys),
                )
    return out


def _cases():
    gen = torch.Generator().manual_seed(5)
    cases = []
    for world in (2, 3, 4):
        for _ in range(2):
            cu = random_cu_seqlens(gen, 2, 24, 30)
            cases += [
                (f"W{world} contiguous", cu, contiguous_fragments(24, 2, world)),
                (f"W{world} head-tail", cu, headtail_fragments(24, 2, world)),
                (f"W{world} random", cu, random_layout(gen, 48, world)),
                (f"W{world} ptrr", *ptrr_layout(gen, 2, 8 * world, world)),
            ]
        cases.append((f"W{world} one document", [0, 48], headtail_fragments(48, 1, world)))
        cases.append(
            (f"W{world} one-token documents", list(range(49)), random_layout(gen, 48, world))
        )
    cases.append(("W8 head-tail", random_cu_seqlens(gen, 1, 64, 20), headtail_fragments(64, 1, 8)))
    cases.append(("W4 explicit", *explicit_layout_4()))
    cases.append(("W3 empty rank", [0, 10, 30, 48], empty_rank_layout(48)))
    return cases


@pytest.mark.parametrize("name, cu, table", _cases(), ids=lambda x: x if isinstance(x, str) else "")
def test_pairs_and_visiting_ids_match_the_token_oracle(name, cu, table):
    world = len(table)
    want = oracle(cu, table)
    spans = [span_index(f) for f in table]
    for rank in range(world):
        sched = RoutingPlan.build(cu, table, rank).pass_kv
        pairs = sched.pairs
        assert pairs.span_tokens.tolist() == [len(s) for s in spans]
        for q in range(world):
            for k in range(world):
                if q == k:
                    assert bool(pairs.visible[q, k]) == (len(spans[q]) > 0)
                    continue
                got = (
                    tuple(pairs.key_rows[q, k].tolist()),
                    tuple(pairs.query_rows[q, k].tolist()),
                    int(pairs.exact_keys[q, k]),
                )
                assert bool(pairs.visible[q, k]) == ((q, k) in want), (name, q, k)
                assert got == want.get((q, k), ((0, 0), (0, 0), 0)), (name, q, k)
        # A round exists iff some rank hears from r - s; this rank's rounds follow the pairs.
        for s in range(1, world):
            heard = any((r, (r - s) % world) in want for r in range(world))
            assert (s in pairs.shifts) == heard, (name, s)
        assert [rd.shift for rd in sched.rounds] == list(pairs.shifts)
        visit_tok, visit_doc = sched.visit_ids()
        assert visit_tok.numel() == sched.num_visiting == sum(rd.num_recv for rd in sched.rounds)
        for rd in sched.rounds:
            src, dst = (rank - rd.shift) % world, (rank + rd.shift) % world
            assert rd.recv_from == (src if (rank, src) in want else -1)
            assert rd.send_to == (dst if (dst, rank) in want else -1)
            if rd.recv_from >= 0:  # the ids of the rows that arrive, from the sender's span
                a, b = rd.recv_rows
                sl = slice(rd.visit_offset, rd.visit_offset + b - a)
                assert visit_tok[sl].tolist() == spans[src][a:b]
                assert visit_doc[sl].tolist() == [
                    bisect.bisect_right(cu, t) - 1 for t in spans[src][a:b]
                ]


# The worked example of docs/cp.md: W = 4 head-tail over one row of 32 tokens (chunks of 4;
# rank r holds chunks r and 7 - r), six documents each across one chunk boundary.
EXAMPLE_CU = [0, 6, 10, 16, 22, 26, 32]


def test_worked_example_skips_round_two():
    table = headtail_fragments(32, 1, 4)
    assert table == [[(0, 4), (28, 32)], [(4, 8), (24, 28)], [(8, 12), (20, 24)], [(12, 20)]]
    plans = [RoutingPlan.build(EXAMPLE_CU, table, r).pass_kv for r in range(4)]
    assert plans[0].pairs.shifts == (1, 3)  # nobody hears from r - 2
    assert plans[0].rounds == (
        PassKVRound(shift=1, send_to=1, send_rows=(0, 4)),
        PassKVRound(shift=3, recv_from=1, recv_rows=(6, 8), query_rows=(4, 8)),
    )
    assert plans[1].rounds == (
        PassKVRound(
            shift=1, recv_from=0, recv_rows=(0, 4), query_rows=(0, 2), send_to=2, send_rows=(2, 4)
        ),
        PassKVRound(
            shift=3,
            recv_from=2,
            recv_rows=(6, 8),
            query_rows=(4, 6),
            visit_offset=4,
            send_to=0,
            send_rows=(6, 8),
        ),
    )
    assert [p.pairs.traffic(r)["messages"] for r, p in enumerate(plans)] == [2, 4, 4, 2]
    # One document over the whole row: every rank hears from every other one, a full ring.
    full = RoutingPlan.build([0, 32], table, 0).pass_kv
    assert full.pairs.shifts == (1, 2, 3)
    assert all(rd.recv_from >= 0 and rd.send_to >= 0 for rd in full.rounds)
    # Rank 0's tail chunk (28..31) ends the row: it sees all 8 rows of every other rank, and
    # nobody sees its tail, so it sends its head (4 rows) only.
    assert [rd.num_recv for rd in full.rounds] == [8, 8, 8]
    assert [rd.num_send for rd in full.rounds] == [4, 4, 4]


def test_traffic_counts_rows_in_the_op_order():
    table = headtail_fragments(32, 1, 4)
    pairs = RoutingPlan.build([0, 32], table, 0).pass_kv.pairs
    # Rank 1 (tokens 4..7 and 24..27) of one document: it receives rank 0's head (4 rows, its
    # tail 28..31 comes later), rank 3's and rank 2's 8 rows; it sends its head to ranks 2
    # and 3 and all 8 rows to rank 0.
    rounds = pairs.rounds(1)
    assert [rd.num_recv for rd in rounds] == [4, 8, 8]
    assert [rd.num_send for rd in rounds] == [4, 4, 8]
    n = [rd.num_recv for rd in rounds]
    m = [rd.num_send for rd in rounds]
    t = pairs.traffic(1)
    assert t["own"] == 8 and t["received"] == sum(n) and t["sent"] == sum(m)
    assert t["visiting_peak"] == max(n[0], n[0] + n[1], n[1] + n[2], n[2])
    grad = max(n[0] + m[0], n[0] + m[0] + n[1], n[1] + m[1], n[1] + m[1] + n[2], n[2] + m[2])
    assert t["grad_peak"] == grad and t["rounds"] == 3 and t["messages"] == 6


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    world=st.sampled_from([2, 3, 4, 8]),
    balancer=st.sampled_from(["contiguous", "headtail", "ptrr"]),
    bsz=st.integers(1, 2),
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=10),
    data=st.data(),
)
def test_host_and_readback_give_the_same_schedule_bitwise(world, balancer, bsz, lengths, data):
    unit = {"contiguous": world, "headtail": 2 * world, "ptrr": 4 * world}[balancer]
    seqlen = unit * (2 if world < 4 else 1)
    rank = data.draw(st.integers(0, world - 1))
    positions = positions_from_lengths(bsz, seqlen, lengths)
    tokens = torch.arange(bsz * seqlen).reshape(bsz, seqlen)
    host, readback = preprocessors(rank, world, balancer, attention_cp="pass_kv")
    a = host(tokens, tokens, positions, HostMetadata(positions.clone()))[3].pass_kv
    b = readback(tokens, tokens, positions, None)[3].pass_kv
    assert a is not None and b is not None and a.schedule is not b.schedule
    assert a.schedule.rounds == b.schedule.rounds
    for f in dataclasses.fields(a.schedule.pairs):
        x, y = getattr(a.schedule.pairs, f.name), getattr(b.schedule.pairs, f.name)
        assert (torch.equal(x, y) and x.dtype == y.dtype) if isinstance(x, torch.Tensor) else x == y
    for name in ("token_ids", "doc_ids", "visit_token_ids", "visit_doc_ids"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert host.stats.readbacks == 0


def test_plan_cache_hits_reuse_the_schedule():
    pre, _ = preprocessors(1, 2, "headtail", attention_cp="pass_kv")
    positions = positions_from_lengths(1, 32, [5, 20, 7])
    tokens = torch.zeros(1, 32, dtype=torch.int64)
    first = pre(tokens, tokens, positions, HostMetadata(positions.clone()))[3].pass_kv
    again = pre(tokens, tokens, positions, HostMetadata(positions.clone()))[3].pass_kv
    assert first is not None and again is not None
    assert again.schedule is first.schedule and again is not first  # fresh device ids per batch
    # Flex layers under pass-KV build per-pair masks: no CP-sharded BlockMask (and no mesh).
    flex, _ = preprocessors(0, 2, "headtail", attention_cp="pass_kv", flex_attention=True)
    ctx = flex(tokens, tokens, positions, HostMetadata(positions.clone()))[3]
    assert ctx.block_mask is None and ctx.pass_kv is not None
    # Without CP no schedule travels with the context.
    solo = SequencePreprocessor(
        device="cpu", cp_group=None, load_balancer="headtail", attention_cp="pass_kv"
    )
    assert solo(tokens, tokens, positions, HostMetadata(positions.clone()))[3].pass_kv is None


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_flex_pair_kernel_matches_the_math_kernel(dtype):
    """CPU flex is forward-only: the flex kernel's (o, lse) against the math kernel's on one
    pair with GQA and queries that see no key of the block (lse -inf, o zero)."""
    gen = torch.Generator().manual_seed(2)
    tq, tk = 37, 50
    q_tok = torch.arange(tq) + 20
    k_tok = torch.arange(tk)
    q_doc = torch.where(q_tok < 30, 0, torch.where(q_tok < 52, 1, 2))  # doc 2: no keys here
    k_doc = torch.where(k_tok < 30, 0, 1)
    q = torch.randn(2, 4, tq, 16, generator=gen, dtype=torch.float64).to(dtype)
    k = torch.randn(2, 2, tk, 16, generator=gen, dtype=torch.float64).to(dtype)
    v = torch.randn(2, 2, tk, 8, generator=gen, dtype=torch.float64).to(dtype)
    o_m, lse_m = math_pair_attention(q, k, v, PairMask(q_tok, q_doc, k_tok, k_doc), 0.25)
    o_f, lse_f = flex_pair_attention(q, k, v, PairMask(q_tok, q_doc, k_tok, k_doc), 0.25)
    none = q_doc == 2
    assert bool(torch.isneginf(lse_m[..., none]).all()) and bool((o_m[..., none, :] == 0).all())
    assert bool(torch.isneginf(lse_f[..., none]).all())
    tol = 1e-12 if dtype == torch.float64 else 2e-5
    assert (o_m - o_f).abs().max().item() <= tol
    assert (lse_m[..., ~none] - lse_f[..., ~none]).abs().max().item() <= tol


# (query rows, key rows) of pairs: one-row hulls and blocks, equal and unequal lengths, both
# sides of a 128-row boundary.
FLEX_LAYOUTS = [
    (1, 5),
    (3, 7),
    (1, 1),
    (5, 1),
    (64, 64),
    (130, 200),
    (200, 300),
    (1, 129),
    (256, 17),
    (300, 300),
]
FLEX_FRAME_BOUND = 8  # dynamo frames for all of them (flex and its block mask together)


@pytest.mark.slow
def test_flex_pair_kernel_compiles_a_bounded_number_of_frames(monkeypatch):
    """The compiled flex pair kernel over pairs of every size (one-row hulls included) stays
    within ``FLEX_FRAME_BOUND`` dynamo frames: lengths are padded to multiples of 128 (before,
    each new length recompiled, past dynamo's limit of 8 per function, after which flex runs
    its unfused path). On CPU with aot_eager (CUDA compiles the same frames with inductor);
    outputs equal the math kernel's."""
    from torch._dynamo.utils import counters
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from torchtitan_cp.ops.attention import pass_kv

    torch._dynamo.reset()
    fns = (
        torch.compile(flex_attention, dynamic=True, backend="aot_eager"),
        torch.compile(create_block_mask, dynamic=True, backend="aot_eager"),
    )
    monkeypatch.setattr(pass_kv, "_flex_fns", lambda device: fns)
    gen = torch.Generator().manual_seed(4)
    start = counters["frames"]["total"]
    for tq, tk in FLEX_LAYOUTS:
        q_tok, k_tok = torch.arange(tq) + tk // 2, torch.arange(tk)
        q_doc, k_doc = (q_tok >= tk // 3).long(), (k_tok >= tk // 3).long()
        q = torch.randn(1, 2, tq, 8, generator=gen)
        k, v = torch.randn(1, 2, tk, 8, generator=gen), torch.randn(1, 2, tk, 8, generator=gen)
        o_f, lse_f = flex_pair_attention(q, k, v, PairMask(q_tok, q_doc, k_tok, k_doc), 0.3)
        o_m, lse_m = math_pair_attention(q, k, v, PairMask(q_tok, q_doc, k_tok, k_doc), 0.3)
        seen = torch.isfinite(lse_m)
        assert bool((torch.isfinite(lse_f) == seen).all()), (tq, tk)
        assert (o_f - o_m).abs().max().item() <= 2e-5, (tq, tk)
        assert (lse_f[seen] - lse_m[seen]).abs().max().item() <= 2e-5, (tq, tk)
    frames = counters["frames"]["total"] - start
    assert frames <= FLEX_FRAME_BOUND, frames


def _saved_peak(fn):
    """Run ``fn`` and return (its result, the most bytes autograd held saved at once)."""
    live, peak = [0], [0]

    class _Saved:
        def __init__(self, t):
            self.t, self.n = t.detach(), t.numel() * t.element_size()  # no cycle via grad_fn
            live[0] += self.n
            peak[0] = max(peak[0], live[0])

        def __del__(self):
            live[0] -= self.n

    with torch.autograd.graph.saved_tensors_hooks(_Saved, lambda s: s.t):
        out = fn()
    return out, peak[0]


def test_math_block_backward_saves_one_query_block_of_scores(monkeypatch):
    """The math kernel's backward recomputes a block in query-row blocks of at most
    ``_MASK_ELEMENTS`` scores: what autograd keeps saved at once does not grow with the block's
    queries (before: the whole [Hq, Tq, Tk] fp32 score matrix, about 17 GB per pair at 16k
    tokens per rank and 16 heads). Gradients are the same as one unblocked recompute."""
    from torchtitan_cp.ops.attention import pass_kv
    from torchtitan_cp.ops.attention.pass_kv import PairKernelCall, _block_grads

    tk, dk, dv = 128, 8, 8

    def grads(tq: int):
        gen = torch.Generator().manual_seed(tq)
        q_tok, k_tok = torch.arange(tq) + tk, torch.arange(tk)
        mask = PairMask(
            q_tok, torch.zeros(tq, dtype=torch.long), k_tok, torch.zeros(tk, dtype=torch.long)
        )
        q = torch.randn(1, 4, tq, dk, generator=gen, dtype=torch.float64)
        rows = torch.randn(tk, 1, 2, dk + dv, generator=gen, dtype=torch.float64)
        do = torch.randn(1, 4, tq, dv, generator=gen, dtype=torch.float64)
        k, v = rows[..., :dk].permute(1, 2, 0, 3), rows[..., dk:].permute(1, 2, 0, 3)
        o, lse = math_pair_attention(q, k, v, mask, 0.25)
        delta = (do * o).sum(-1)
        call = PairKernelCall(math_pair_attention, 0.25, dk)
        return _saved_peak(lambda: _block_grads(call, q, rows, mask, do, lse, delta))

    monkeypatch.setattr(pass_kv, "_MASK_ELEMENTS", 32 * tk)  # 32 query rows per recompute
    (dq, dkv), peak_256 = grads(256)
    _, peak_1024 = grads(1024)
    scores = 4 * 32 * tk * 8  # one block's [Hq, 32, Tk] float64 scores
    assert peak_1024 <= 1.1 * peak_256, (peak_256, peak_1024)
    assert peak_256 <= 8 * scores, (peak_256, scores)
    monkeypatch.setattr(pass_kv, "_MASK_ELEMENTS", 1 << 30)  # one recompute of all 256 rows
    (dq1, dkv1), peak_one = grads(256)
    assert peak_one > 4 * peak_256
    assert (dq - dq1).abs().max().item() <= 1e-12 and (dkv - dkv1).abs().max().item() <= 1e-12


# Max error relative to the largest |gradient|: float32 as before; bfloat16 inputs (flex
# computes in bf16 with fp32 softmax statistics, the math kernel in fp32 from the same bf16
# values) within 2e-2 (a few bf16 ulps; not yet run on a GPU).
FLEX_GRAD_TOL = {torch.float32: 2e-4, torch.bfloat16: 2e-2}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flex attention has no CPU backward")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flex_pair_kernel_block_gradients_match_the_math_kernel_on_cuda(dtype):
    """The backward's per-block step (cotangents of the merged output through the kernel's
    (o, lse)) with flex on CUDA, against the math kernel: dq and the packed dk|dv."""
    from torchtitan_cp.ops.attention.pass_kv import PairKernelCall, _block_grads

    gen = torch.Generator(device="cuda").manual_seed(3)
    tq, tk, dk, dv = 200, 300, 16, 8
    q_tok = torch.arange(tq, device="cuda") + 150
    k_tok = torch.arange(tk, device="cuda")
    q_doc, k_doc = (q_tok >= 220).long(), (k_tok >= 220).long()
    mask = PairMask(q_tok, q_doc, k_tok, k_doc)
    q = torch.randn(1, 4, tq, dk, device="cuda", generator=gen).to(dtype)
    rows = torch.randn(tk, 1, 2, dk + dv, device="cuda", generator=gen).to(dtype)
    do = torch.randn(1, 4, tq, dv, device="cuda", generator=gen)
    k, v = rows[..., :dk].permute(1, 2, 0, 3), rows[..., dk:].permute(1, 2, 0, 3)
    o_b, lse_b = math_pair_attention(q, k, v, mask, 0.25)
    lse = torch.logaddexp(lse_b, torch.randn(lse_b.shape, device="cuda", generator=gen))
    out = torch.exp(lse_b - lse).unsqueeze(-1) * o_b  # the merged output, other block's o = 0
    delta = (do * out).sum(-1)
    grads = {
        name: _block_grads(PairKernelCall(kernel, 0.25, dk), q, rows, mask, do, lse, delta)
        for name, kernel in (("math", math_pair_attention), ("flex", flex_pair_attention))
    }
    for a, b in zip(grads["math"], grads["flex"], strict=True):
        err = (a.float() - b.float()).abs().max() / a.float().abs().max().clamp(min=1e-30)
        assert err.item() <= FLEX_GRAD_TOL[dtype], (dtype, err.item())


def test_attention_cp_config_errors_name_the_key(tmp_path):
    from torchtitan_cp.train import load_config

    path = tmp_path / "c.toml"
    path.write_text('[model]\nattention_cp = "ring"\n')
    with pytest.raises(ConfigError, match="model.attention_cp"):
        load_config(["--config_file", str(path)])
    # pass-KV compiles as a custom op, with CP and without (where it changes nothing).
    load_config(
        [
            "--config_file",
            "configs/debug_cpu.toml",
            "--compile.enable",
            "--parallelism.context_parallel_degree",
            "2",
            "--model.attention_cp",
            "pass_kv",
        ]
    )
    load_config(
        [
            "--config_file",
            "configs/debug_cpu.toml",
            "--compile.enable",
            "--model.attention_cp",
            "pass_kv",
        ]
    )
    cfg = load_config(
        ["--config_file", "configs/qwen35_debug_cpu.toml", "--model.attention_cp", "pass_kv"]
    )
    assert cfg.model.attention_cp == "pass_kv"
