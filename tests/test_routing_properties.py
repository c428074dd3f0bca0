"""Property tests: random documents and random explicit fragment tables against a token-level
pure-Python oracle, including a simulated all-gather of the conv tails."""

import bisect

from hypothesis import given, settings
from hypothesis import strategies as st

from torchtitan_cp.routing import RoutingCaps, RoutingPlan

SETTINGS = settings(max_examples=60, deadline=None)


@st.composite
def layouts(draw):
    """(cu_seqlens, table, conv_history): B rows of L tokens, random extra document starts,
    fragments of 1-3 tokens dealt to W ranks in a random span order (some ranks may own none)."""
    world = draw(st.integers(1, 8))
    batch = draw(st.integers(1, 3))
    length = draw(st.integers(1, 12))
    total = batch * length
    extra = draw(st.sets(st.integers(0, total - 1), max_size=total))
    cu = sorted(set(range(0, total, length)) | extra) + [total]
    cuts = [0]
    while cuts[-1] < total:
        cuts.append(min(total, cuts[-1] + draw(st.integers(1, 3))))
    pieces = list(zip(cuts[:-1], cuts[1:]))
    owners = draw(st.lists(st.integers(0, world - 1), min_size=len(pieces), max_size=len(pieces)))
    table = [[p for p, o in zip(pieces, owners) if o == r] for r in range(world)]
    table = [list(draw(st.permutations(frags))) for frags in table]
    return cu, table, draw(st.integers(0, 4))


def _doc(cu, t):
    return bisect.bisect_right(cu, t) - 1


def _oracle(cu, table, rank, conv):
    """Expected plan fields by walking tokens."""
    everyone = sorted((a, b, r, j) for r, fr in enumerate(table) for j, (a, b) in enumerate(fr))
    subs, preds, succs, sources = [], [], [], []
    for a, b in table[rank]:
        t = a
        while t < b:
            d = _doc(cu, t)
            stop = min(b, cu[d + 1])
            subs.append((d, t, stop))
            t = stop
        first, last = _doc(cu, a), _doc(cu, b - 1)
        preds.append([(r, j) for s, e, r, j in everyone if s < a and e > cu[first]])
        succs.append([(r, j) for s, e, r, j in everyone if s >= b and s < cu[last + 1]])
        src = []
        for t in range(max(cu[first], a - conv), a):
            s, _, r, j = next(f for f in everyone if f[0] <= t < f[1])
            src.append((r, j, t - s))
        sources.append(src)
    terminal = [i for i, (d, _, stop) in enumerate(subs) if stop == cu[d + 1]]
    return subs, preds, succs, terminal, sources


@SETTINGS
@given(layouts())
def test_plan_matches_token_oracle(layout):
    cu, table, conv = layout
    seen = []
    plans = [RoutingPlan.build(cu, table, r) for r in range(len(table))]
    for rank, plan in enumerate(plans):
        subs, preds, succs, terminal, sources = _oracle(cu, table, rank, conv)
        assert [tuple(s) for s in plan.subsequences.tolist()] == subs
        assert plan.predecessors == preds
        assert plan.successors == succs
        assert plan.terminal.tolist() == terminal
        assert plan.conv_sources(conv) == sources
        lengths = [stop - start for _, start, stop in subs]
        assert plan.cu_seqlens.tolist() == [sum(lengths[:i]) for i in range(len(lengths) + 1)]
        # each subsequence lies inside one fragment and one document; first/last per fragment
        for j, (a, b) in enumerate(table[rank]):
            inside = subs[plan.frag_first[j] : plan.frag_last[j] + 1]
            assert inside[0][1] == a and inside[-1][2] == b
            assert all(cu[d] <= s < e <= cu[d + 1] and a <= s and e <= b for d, s, e in inside)
        seen += [t for _, s, e in subs for t in range(s, e)]
    assert sorted(seen) == list(range(cu[-1]))  # every token in exactly one subsequence
    # successors and predecessors are mirror images
    succ_pairs = {
        ((r, j), s) for r, p in enumerate(plans) for j, ss in enumerate(p.successors) for s in ss
    }
    pred_pairs = {
        (s, (r, j)) for r, p in enumerate(plans) for j, ps in enumerate(p.predecessors) for s in ps
    }
    assert succ_pairs == pred_pairs


@SETTINGS
@given(layouts(), st.integers(0, 2), st.integers(0, 2), st.integers(0, 2), st.integers(0, 2))
def test_device_routing_simulated_gather(layout, pad_s, pad_n, pad_p, pad_t):
    cu, table, conv = layout
    world = len(table)
    plans = [RoutingPlan.build(cu, table, r) for r in range(world)]
    max_pred = max((len(p) for plan in plans for p in plan.predecessors), default=0)
    max_sub = max(plan.num_subsequences for plan in plans)
    max_term = max(plan.terminal.numel() for plan in plans)
    slots = plans[0].num_slots + pad_s
    caps = RoutingCaps(slots, max_sub + pad_n, max_pred + pad_p, max_term + pad_t)
    routes = [plan.to_device("cpu", caps=caps, conv_history=conv) for plan in plans]

    # Simulate the tail all-gather: flat [W * S * C] buffer of global token ids (None = none).
    buffer = []
    for rank, route in enumerate(routes):
        span = [t for a, b in table[rank] for t in range(a, b)]
        assert route.num_tokens == len(span)
        assert route.tail_index.shape == (slots, conv)
        buffer += [span[i] if i >= 0 else None for i in route.tail_index.reshape(-1).tolist()]
        for j, (a, b) in enumerate(table[rank]):  # right-aligned last C tokens
            expect = [b - conv + c if b - conv + c >= a else None for c in range(conv)]
            assert [span[i] if i >= 0 else None for i in route.tail_index[j].tolist()] == expect

    for rank, (plan, route) in enumerate(zip(plans, routes)):
        n_local, n_sub = len(table[rank]), plan.num_subsequences
        assert route.num_slots == slots and route.conv_history == conv
        assert route.cu_seqlens.tolist() == route.cu_seqlens_cpu.tolist()
        assert route.cu_seqlens.tolist() == (
            plan.cu_seqlens.tolist() + [plan.num_tokens] * (caps.subsequences - n_sub)
        )
        pad = [-1] * (slots - n_local)
        assert route.frag_first.tolist() == plan.frag_first.tolist() + pad
        assert route.frag_last.tolist() == plan.frag_last.tolist() + pad
        assert route.publish.tolist() == [bool(s) for s in plan.successors] + [False] * len(pad)
        assert route.terminal.tolist() == plan.terminal.tolist() + [-1] * (
            caps.terminal - plan.terminal.numel()
        )
        # Summary pass: published fragments' last subsequences, back to back, host == device.
        published = [j for j in range(n_local) if plan.successors[j]]
        want_row = [-1] * slots
        for i, j in enumerate(published):
            want_row[j] = i
        assert route.summary_row.tolist() == want_row
        want_sub = [int(plan.frag_last[j]) for j in published]
        want_sub += [-1] * (slots + 1 - len(published))
        assert route.summary_subsequence.tolist() == want_sub
        assert route.summary_subsequence_cpu.tolist() == want_sub
        pieces = [
            list(range(*plan.cu_seqlens[plan.frag_last[j] : plan.frag_last[j] + 2].tolist()))
            for j in published
        ]
        tokens = [t for p in pieces for t in p]
        lengths = [0] + [len(p) for p in pieces]
        cum = [sum(lengths[: i + 1]) for i in range(len(lengths))]
        # Capped: S + 1 sequences over all tokens, the padding after the real pieces.
        cum += [plan.num_tokens] * (slots + 1 - len(published))
        assert route.summary_token_index.tolist()[: len(tokens)] == tokens
        assert route.summary_token_index.numel() == plan.num_tokens
        assert route.summary_cu_seqlens.tolist() == route.summary_cu_seqlens_cpu.tolist() == cum
        assert route.pred_slots.shape == (slots, caps.predecessors)
        # The fold's schedule: slots by predecessor count, the folding ones a prefix per column.
        counts = (route.pred_slots >= 0).sum(1)
        assert counts[route.fold_order].tolist() == sorted(counts.tolist(), reverse=True)
        want_steps = tuple(int((counts > p).sum()) for p in range(caps.predecessors))
        assert route.fold_steps == want_steps
        for j in range(slots):
            preds = plan.predecessors[j] if j < n_local else []
            want = [r * slots + f for r, f in preds]
            assert route.pred_slots[j].tolist() == want + [-1] * (caps.predecessors - len(want))
        for j in range(slots):
            got = [buffer[i] if i >= 0 else None for i in route.halo_index[j].tolist()]
            if j >= n_local:
                assert got == [None] * conv
                continue
            a = table[rank][j][0]
            start = cu[_doc(cu, a)]  # history stays inside the document
            assert got == [a - conv + c if a - conv + c >= start else None for c in range(conv)]
