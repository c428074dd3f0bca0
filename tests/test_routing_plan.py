"""RoutingPlan / DeviceRouting on the hand-checked example and on invalid input."""

import pytest
import torch

from torchtitan_cp.routing import RoutingCaps, RoutingPlan, parse_fragments

CU = [0, 40, 232, 384]
TABLE = parse_fragments("0:96,288:384;96:192,192:288")


def test_worked_example_rank1():
    # d0 [0,40) d1 [40,232) d2 [232,384); rank 1 owns [96,192) then [192,288).
    plan = RoutingPlan.build(CU, TABLE, 1)
    assert plan.num_slots == 2 and plan.world_size == 2 and plan.num_tokens == 192
    assert plan.subsequences.tolist() == [[1, 96, 192], [1, 192, 232], [2, 232, 288]]
    assert plan.cu_seqlens.tolist() == [0, 96, 136, 192]
    assert plan.predecessors == [[(0, 0)], [(0, 0), (1, 0)]]
    assert plan.successors == [[(1, 1)], [(0, 1)]]
    assert plan.terminal.tolist() == [1]
    assert plan.conv_sources(3) == [
        [(0, 0, 93), (0, 0, 94), (0, 0, 95)],
        [(1, 0, 93), (1, 0, 94), (1, 0, 95)],
    ]


def test_worked_example_rank0():
    plan = RoutingPlan.build(torch.tensor(CU), TABLE, 0)
    assert plan.subsequences.tolist() == [[0, 0, 40], [1, 40, 96], [2, 288, 384]]
    assert plan.cu_seqlens.tolist() == [0, 40, 96, 192]
    assert plan.predecessors == [[], [(1, 1)]]
    assert plan.successors == [[(1, 0), (1, 1)], []]
    assert plan.terminal.tolist() == [0, 2]
    assert plan.conv_sources(2) == [[], [(1, 1, 94), (1, 1, 95)]]


def test_worked_example_device():
    r = RoutingPlan.build(CU, TABLE, 1).to_device("cpu", conv_history=3)
    assert (r.rank, r.world_size, r.num_slots, r.conv_history, r.num_tokens) == (1, 2, 2, 3, 192)
    assert r.cu_seqlens.dtype == torch.int32 and r.cu_seqlens.tolist() == [0, 96, 136, 192]
    assert r.cu_seqlens_cpu.device.type == "cpu" and r.cu_seqlens_cpu.tolist() == [0, 96, 136, 192]
    assert r.frag_first.tolist() == [0, 1] and r.frag_last.tolist() == [0, 2]
    assert r.publish.dtype == torch.bool and r.publish.tolist() == [True, True]
    # slots: rank 0 fragments are 0, 1; rank 1 fragments are 2, 3
    assert r.pred_slots.tolist() == [[0, -1], [0, 2]]
    assert r.terminal.tolist() == [1]
    assert r.tail_index.tolist() == [[93, 94, 95], [189, 190, 191]]
    # rank 0 slot 0 tail entries are 0..2 of the flat buffer, rank 1 slot 0 (slot 2) are 6..8
    assert r.halo_index.tolist() == [[0, 1, 2], [6, 7, 8]]
    for name in ("frag_first", "pred_slots", "halo_index", "tail_index", "terminal"):
        assert getattr(r, name).dtype == torch.int64


def test_caps_pad_to_fixed_shapes():
    plan = RoutingPlan.build(CU, TABLE, 1)
    caps = RoutingCaps(slots=4, subsequences=6, predecessors=3, terminal=2)
    r = plan.to_device("cpu", caps=caps, conv_history=2)
    assert r.num_slots == 4
    assert r.cu_seqlens.tolist() == [0, 96, 136, 192, 192, 192, 192]
    assert r.frag_first.tolist() == [0, 1, -1, -1] and r.frag_last.tolist() == [0, 2, -1, -1]
    assert r.publish.tolist() == [True, True, False, False]
    # global slot ids use the capped slot count: rank 1 fragment 0 is slot 4
    assert r.pred_slots.tolist() == [[0, -1, -1], [0, 4, -1], [-1] * 3, [-1] * 3]
    assert r.terminal.tolist() == [1, -1]
    assert r.tail_index.tolist() == [[94, 95], [190, 191], [-1, -1], [-1, -1]]
    assert r.halo_index.tolist() == [[0, 1], [8, 9], [-1, -1], [-1, -1]]


@pytest.mark.parametrize(
    "caps,name",
    [
        (RoutingCaps(slots=1), "slots"),
        (RoutingCaps(subsequences=2), "subsequences"),
        (RoutingCaps(predecessors=1), "predecessors"),
        (RoutingCaps(terminal=0), "terminal"),
    ],
)
def test_caps_exceeded(caps, name):
    with pytest.raises(ValueError, match=rf"RoutingCaps\.{name}"):
        RoutingPlan.build(CU, TABLE, 1).to_device("cpu", caps=caps)


def test_negative_cap_rejected():
    with pytest.raises(ValueError, match="RoutingCaps.slots"):
        RoutingCaps(slots=-1)


def test_every_call_returns_fresh_tensors():
    plan = RoutingPlan.build(CU, TABLE, 1)
    a, b = plan.to_device("cpu"), plan.to_device("cpu")
    for name in ("cu_seqlens", "cu_seqlens_cpu", "frag_first", "pred_slots", "halo_index"):
        ta, tb = getattr(a, name), getattr(b, name)
        assert ta.untyped_storage().data_ptr() != tb.untyped_storage().data_ptr(), name
    assert (
        a.cu_seqlens.untyped_storage().data_ptr() != a.cu_seqlens_cpu.untyped_storage().data_ptr()
    )
    a.halo_index.fill_(7)
    a.cu_seqlens.zero_()
    c = plan.to_device("cpu")
    assert c.halo_index.tolist() == b.halo_index.tolist() == [[0, 1, 2], [6, 7, 8]]
    assert plan.cu_seqlens.tolist() == [0, 96, 136, 192]


def test_zero_conv_history_and_fragmentless_rank():
    table = [[(0, 4)], [], [(4, 6)]]
    r = RoutingPlan.build([0, 5, 6], table, 1).to_device("cpu", conv_history=0)
    assert r.num_tokens == 0 and r.cu_seqlens.tolist() == [0]
    assert r.frag_first.tolist() == [-1] and r.tail_index.shape == (1, 0)
    assert r.halo_index.shape == (1, 0) and r.pred_slots.shape == (1, 0)


# Tables as parse_fragments text ("rank 0 fragments;rank 1 fragments", each "start:stop"),
# except where the table is not even a list of pairs.
@pytest.mark.parametrize(
    "cu,table,rank,message",
    [
        (
            [0, 40, 384],
            "0:96,288:384;96:192,192:290",
            1,
            r"overlap: rank 0 fragment 1 \[288, 384\) overlaps rank 1 fragment 1 \[192, 290\)",
        ),
        ([0, 40, 384], "0:96,288:384;96:192,192:280", 0, r"gap: tokens \[280, 288\)"),
        ([0, 40, 384], "0:96,290:384;96:192,192:288", 0, r"gap: tokens \[288, 290\)"),
        ([0, 40, 384], "4:96,288:384;96:192,192:288", 0, r"gap: tokens \[0, 4\)"),
        (
            [0, 40, 400],
            "0:96,288:384;96:192,192:288",
            0,
            r"end at 384, short of cu_seqlens\[-1\] = T = 400",
        ),
        (
            [0, 40, 300],
            "0:96,288:384;96:192,192:288",
            0,
            r"end at 384, past cu_seqlens\[-1\] = T = 300",
        ),
        ([0, 40, 384], "0:96,288:384;96:96,96:288", 0, r"rank 1 fragment 0 \(96, 96\) is empty"),
        ([0, 40, 384], "0:96,384:288;96:288", 0, r"rank 0 fragment 1 \(384, 288\) is start > stop"),
        ([0, 40, 384], TABLE, 2, r"rank 2 is out of range for 2 ranks"),
        ([0, 40, 384], TABLE, -1, r"rank -1 is out of range"),
        ([1, 40, 384], TABLE, 0, r"must start at 0, starts at 1"),
        (
            [0, 40, 40, 384],
            TABLE,
            0,
            r"strictly increasing: cu_seqlens\[1\] = 40, cu_seqlens\[2\] = 40",
        ),
        ([0, 50, 40, 384], TABLE, 0, r"strictly increasing"),
        ([0], TABLE, 0, r"at least 2 entries"),
        ([0, 40, 384], [[(0, 96, 1)], [(96, 384)]], 0, r"\(start, stop\) pair"),
    ],
)
def test_validation_errors(cu, table, rank, message):
    if isinstance(table, str):
        table = parse_fragments(table)
    with pytest.raises(ValueError, match=message):
        RoutingPlan.build(cu, table, rank)


def test_conv_history_must_be_non_negative():
    plan = RoutingPlan.build(CU, TABLE, 1)
    with pytest.raises(ValueError, match="conv_history"):
        plan.to_device("cpu", conv_history=-1)


def test_host_buffers_pinned_when_cuda_available(monkeypatch):
    """No GPU here: fake CUDA availability and record what gets pinned and how it is copied."""
    pinned, copies = [], []
    real_to = torch.Tensor.to

    def fake_pin(self):
        out = self.clone()
        pinned.append(out)
        return out

    def recording_to(self, *args, **kwargs):
        if args and isinstance(args[0], torch.device):
            copies.append((any(self is p for p in pinned), kwargs.get("non_blocking")))
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.Tensor, "pin_memory", fake_pin)
    monkeypatch.setattr(torch.Tensor, "to", recording_to)
    r = RoutingPlan.build(CU, TABLE, 1).to_device(torch.device("cpu"))
    storage = r.cu_seqlens_cpu.untyped_storage().data_ptr()
    assert len(pinned) == 2 and any(p.untyped_storage().data_ptr() == storage for p in pinned)
    summary = r.summary_cu_seqlens_cpu.untyped_storage().data_ptr()
    assert summary == storage  # host offsets of the summary pass live in the same pinned buffer
    assert copies == [(True, True), (True, True)]  # both device copies read pinned memory
    assert r.halo_index.tolist() == [[0, 1, 2], [6, 7, 8]]
    assert r.cu_seqlens.tolist() == [0, 96, 136, 192]


def test_plan_is_frozen():
    """The plan cache hands one plan to every microbatch of a layout: nothing can rebind it."""
    import dataclasses

    from torchtitan_cp.routing import PlanCache

    cache = PlanCache(4)
    plan = cache.get(CU, TABLE, 1)
    assert cache.get(CU, TABLE, 1) is plan  # shared between microbatches
    for name, value in (("rank", 0), ("cu_seqlens", torch.zeros(4)), ("_pos", None)):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(plan, name, value)
    assert plan.fragments == ((96, 192), (192, 288))
    with pytest.raises(TypeError):
        plan.fragments[0] = (0, 1)  # type: ignore[index]
    assert plan.predecessors == [[(0, 0)], [(0, 0), (1, 0)]]  # lazy host lists still build


# The dtype docs/CONTRACTS.md gives every DeviceRouting tensor (int64 unless listed).
_INT32 = {
    "cu_seqlens",
    "cu_seqlens_cpu",
    "summary_cu_seqlens",
    "summary_cu_seqlens_cpu",
    "summary_subsequence",
    "summary_subsequence_cpu",
    "chunk_indices",
    "summary_chunk_indices",
}


@pytest.mark.parametrize(
    "caps", [None, RoutingCaps(slots=4, subsequences=6, predecessors=3, terminal=2)]
)
def test_device_routing_fields_by_name(caps):
    """Each field is unpacked by name into its own shape and dtype, and has its contract."""
    import dataclasses
    from pathlib import Path

    from torchtitan_cp.routing import DeviceRouting

    contracts = (Path(__file__).resolve().parents[1] / "docs" / "CONTRACTS.md").read_text()
    table = contracts[contracts.index("`DeviceRouting` (frozen") :]
    r = RoutingPlan.build(CU, TABLE, 1).to_device("cpu", caps=caps, conv_history=3)
    tensors = [f.name for f in dataclasses.fields(DeviceRouting) if f.type == "Tensor"]
    assert len(tensors) == 20  # the string annotations matched
    for f in dataclasses.fields(DeviceRouting):
        assert f"`{f.name}`" in table, f"DeviceRouting.{f.name} has no row in docs/CONTRACTS.md"
    for name in tensors:
        t = getattr(r, name)
        want = torch.bool if name == "publish" else torch.int32 if name in _INT32 else torch.int64
        assert t.dtype == want, name
    # The kernels' host metadata equals the device copy, field by field.
    assert torch.equal(r.cu_seqlens_cpu, r.cu_seqlens)
    assert torch.equal(r.summary_cu_seqlens_cpu, r.summary_cu_seqlens)
    s = r.num_slots
    assert r.tail_index.shape == r.halo_index.shape == (s, 3)
    assert r.summary_row.shape == r.frag_first.shape == r.publish.shape == (s,)
    assert r.chunk_offsets[-1] <= r.chunk_indices.shape[0]
    assert r.chunk_indices.shape[1] == r.summary_chunk_indices.shape[1] == 2
