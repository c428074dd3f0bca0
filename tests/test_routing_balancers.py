"""Load balancers behind one interface (``routing.balancers``).

* the registry holds contiguous, head-tail and PTRR; a config name resolves to one balancer,
  an unknown one is an error naming the key and the choices;
* each balancer's order equals torch's own balancer's, and ``depends_on_documents`` says the
  truth (a balancer that claims independence gives one order for any two document layouts);
* ``check`` is the one divisibility rule, in config keys, with the nearest valid lengths;
* ``runs_per_row`` bounds the fragments a rank owns per row (what the compile caps rely on);
* a new balancer is one registered class: the sources, the preprocessor and the compile caps
  take it by name without another edit;
* no module outside the balancers, and no script, compares the balancer's name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from torch.distributed.tensor.experimental._context_parallel._load_balancer import (
    _HeadTailLoadBalancer,
    _PTRRLoadBalancer,
)

from tests.helpers import dense_document_block_mask, positions_from_lengths
from torchtitan_cp.routing import (
    LoadBalancer,
    balancer_names,
    check_divisible,
    get_balancer,
    host_layout,
    readback_layout,
    register,
)
from torchtitan_cp.routing import balancers as balancers_mod
from torchtitan_cp.routing.balancers import PTRR, Contiguous, HeadTail

ROOT = Path(__file__).resolve().parents[1]


def test_registry_resolves_config_names():
    assert balancer_names()[:3] == ("contiguous", "headtail", "ptrr")
    assert get_balancer(None) == Contiguous()  # torchtitan's None means contiguous
    assert get_balancer("headtail") == HeadTail()
    assert get_balancer("ptrr", ptrr_block_size=32) == PTRR(block_size=32)
    assert get_balancer("contiguous", ptrr_block_size=32) == Contiguous()  # ignores others' keys
    ptrr = PTRR(block_size=16)
    assert get_balancer(ptrr) is ptrr
    with pytest.raises(
        ValueError,
        match=r"context_parallel_load_balancer must be one of "
        r"contiguous, headtail, ptrr.*'zigzag'",
    ):
        get_balancer("zigzag")
    with pytest.raises(ValueError, match=r"linear_attention.ptrr_block_size must be >= 1"):
        get_balancer("ptrr", ptrr_block_size=0)
    with pytest.raises(ValueError, match=r"'ptrr' is already registered"):
        register(PTRR)


def test_balancers_are_frozen_and_hashable():
    ptrr = PTRR(block_size=8)
    with pytest.raises(AttributeError):
        ptrr.block_size = 4  # type: ignore[misc]
    assert len({PTRR(8), PTRR(8), PTRR(16), HeadTail()}) == 3


@pytest.mark.parametrize("world", [2, 3, 4])
def test_orders_equal_torchs_own_balancers(world):
    bsz, seqlen, block = 2, 8 * world * 6, 8
    positions = positions_from_lengths(bsz, seqlen, [7, 30, 2, 55, 11])
    assert get_balancer("contiguous").indices(positions, world, "cpu") is None
    ht = get_balancer("headtail").indices(positions, world, "cpu")
    assert torch.equal(ht, _HeadTailLoadBalancer(seqlen, world, "cpu")._generate_indices())
    mask = dense_document_block_mask(positions, block)
    ptrr = get_balancer("ptrr", ptrr_block_size=block).indices(positions, world, "cpu")
    assert torch.equal(ptrr, _PTRRLoadBalancer(mask, world)._generate_indices())
    for name in balancer_names()[:3]:  # one rank: nobody reorders
        assert get_balancer(name, ptrr_block_size=block).indices(positions, 1, "cpu") is None


def test_depends_on_documents_is_the_truth():
    world, bsz, seqlen = 2, 2, 128
    a = positions_from_lengths(bsz, seqlen, [seqlen])  # one document per row
    b = positions_from_lengths(bsz, seqlen, [3, 97, 5, 40, 1])
    for name in balancer_names()[:3]:
        lb = get_balancer(name, ptrr_block_size=16)
        ia, ib = lb.indices(a, world, "cpu"), lb.indices(b, world, "cpu")
        same = (ia is None and ib is None) or (
            ia is not None and ib is not None and torch.equal(ia, ib)
        )
        # A balancer that claims independence must be; PTRR does follow these documents.
        assert same != lb.depends_on_documents, name
    assert [get_balancer(n).depends_on_documents for n in ("contiguous", "headtail", "ptrr")] == [
        False,
        False,
        True,
    ]


def test_check_names_the_keys_and_the_nearest_lengths():
    with pytest.raises(ValueError) as e:
        get_balancer("headtail").check(100, 4)
    assert str(e.value) == (
        "training.seq_len (100) must be divisible by 2 x context_parallel_degree (4) for "
        "context_parallel_load_balancer = headtail: use 96 or 104"
    )
    with pytest.raises(
        ValueError,
        match=r"ptrr_block_size x context_parallel_degree \(48 x 2\)"
        r" and by 2 x context_parallel_degree \(2\).*use 96 or 192",
    ):
        PTRR(block_size=48).check(100, 2, also=[(4, "2 x context_parallel_degree (2)")])
    with pytest.raises(ValueError, match=r"context_parallel_degree \(3\).*: use 3$"):
        get_balancer("contiguous").check(2, 3)  # no valid length below: one hint
    for name in balancer_names()[:3]:
        get_balancer(name, ptrr_block_size=8).check(7, 1)  # one rank: any length
        get_balancer(name, ptrr_block_size=8).check(96, 4)
    with pytest.raises(ValueError, match=r">= 1"):
        HeadTail().check(0, 2)
    check_divisible(12, [(4, "a"), (6, "b"), (1, "ignored")], "here")
    with pytest.raises(ValueError, match=r"by a and by b here: use 12 or 24"):
        check_divisible(13, [(4, "a"), (6, "b")], "here")


@pytest.mark.parametrize("name", ["contiguous", "headtail", "ptrr"])
@pytest.mark.parametrize("world", [2, 3, 4])
def test_runs_per_row_bounds_every_layout(name, world):
    block, bsz = 8, 3
    seqlen = block * world * 4
    lb = get_balancer(name, ptrr_block_size=block)
    runs = lb.runs_per_row(seqlen, world)
    for lengths in ([1], [3, 29, 2, 70], [seqlen], [5, 5, 200, 9]):
        positions = positions_from_lengths(bsz, seqlen, lengths)
        layout = host_layout(positions, load_balancer=lb, world_size=world, device="cpu")
        for frags in layout.fragments:
            per_row = [0] * bsz
            for a, b in frags:  # maximal runs may merge across a row end: count each row's part
                for row in range(a // seqlen, (b - 1) // seqlen + 1):
                    per_row[row] += 1
            assert max(per_row) <= runs, (name, lengths, frags)


@dataclass(frozen=True)
class _Reversed(LoadBalancer):
    """A test balancer: rank r owns chunk W - 1 - r of every row."""

    name: ClassVar[str] = "reversed"
    depends_on_documents: ClassVar[bool] = False

    def _indices(self, positions, world, device, *, cu_seqlens=None):
        seqlen = positions.shape[1]
        return torch.arange(seqlen, device=device).view(world, -1).flip(0).reshape(1, seqlen)

    def runs_per_row(self, seq_len, world):
        return 1


def test_a_new_balancer_is_one_registered_class(monkeypatch):
    from torchtitan_cp.models.sequence import SequencePreprocessor
    from torchtitan_cp.routing.host_metadata import HostMetadata
    from torchtitan_cp.trainer.compile import routing_caps

    monkeypatch.setattr(balancers_mod, "_REGISTRY", dict(balancers_mod._REGISTRY))
    monkeypatch.setattr(balancers_mod, "_RESOLVED", {})
    register(_Reversed)
    assert "reversed" in balancer_names() and get_balancer("reversed") == _Reversed()
    world, bsz, seqlen = 3, 2, 24
    positions = positions_from_lengths(bsz, seqlen, [5, 11, 2, 30])
    host = host_layout(positions, load_balancer="reversed", world_size=world, device="cpu")
    back = readback_layout(positions, (bsz, seqlen), load_balancer="reversed", world_size=world)
    assert host.fragments == back.fragments
    assert host.fragments[0] == [(16, 24), (40, 48)]  # rank 0 holds the last chunk of each row
    caps = routing_caps(
        load_balancer="reversed",
        batch_size=bsz,
        seq_len=seqlen,
        cp_degree=world,
        ptrr_block_size=8,
        max_subsequences=64,
    )
    assert caps.slots == bsz and caps.predecessors == world - 1
    tokens = torch.arange(bsz * seqlen).reshape(bsz, seqlen)
    for rank in range(world):
        pre = SequencePreprocessor(
            device="cpu",
            cp_group=None,
            load_balancer="reversed",
            cp_rank=rank,
            cp_world_size=world,
            caps=caps,
        )
        t, _, _, ctx = pre(tokens, tokens, positions, HostMetadata(positions.clone()))
        chunk = seqlen // world
        lo = (world - 1 - rank) * chunk
        assert torch.equal(t, tokens[:, lo : lo + chunk])
        assert torch.equal(ctx.token_ids, t.reshape(-1))


# A comparison of the balancer's name against a literal, e.g. `lb == "ptrr"` or
# `name in ("headtail", ...)`: the knowledge the balancer classes alone should hold.
_NAME_SWITCH = re.compile(r"""(==|!=|\bin\b)\s*[\(\[{]?\s*["'](contiguous|headtail|ptrr)["']""")


def test_no_module_outside_the_balancers_switches_on_the_name():
    offenders = []
    for path in sorted((ROOT / "torchtitan_cp").rglob("*.py")):
        if path.name == "balancers.py":
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if _NAME_SWITCH.search(line):
                offenders.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not offenders, "\n".join(offenders)
    assert _NAME_SWITCH.search('if load_balancer == "ptrr":')  # the pattern does find one


def test_no_script_switches_on_the_name():
    """Benchmarks and checks lay documents out by a balancer's name through the registry
    (``routing.documents_layout``), not by a table of their own."""
    offenders = [
        f"{path.relative_to(ROOT)}:{i}: {line.strip()}"
        for path in sorted((ROOT / "scripts").glob("*.py"))
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if _NAME_SWITCH.search(line)
    ]
    assert not offenders, "\n".join(offenders)
