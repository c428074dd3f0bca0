"""What every registered recurrence (``ops.cp.recurrence.RECURRENCES``) supplies to the shared
recurrence tests: an input maker, a float64 token-by-token oracle, fla's own naive recurrence
and the arguments of its custom ops.

The shared harnesses read ``CASES`` and nothing else: the oracle and summary-algebra tests
(``tests/test_recurrence_kernels.py``), CP against unsharded (``tests/test_cp_recurrences.py``),
the custom ops' opcheck and compile-vs-eager (``tests/test_compile.py``) and the fla
interpreter tier (``tests/test_fla_interpreter.py``). ``test_every_recurrence_has_cases``
fails for a registered recurrence without a case here, so a new recurrence is one registry line
plus its cases (and its oracle, a ``step`` for ``tests.reference.token_scan``); a new option of
an existing recurrence is one more case.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from tests.reference import delta_product_reference, delta_rule_reference, ssd_reference

__all__ = ["CASES", "H", "HV", "K", "V", "OpCall", "RecurrenceCase", "head_decay", "ssd_inputs"]

H, HV, K, V = 1, 2, 8, 6  # HV = 2 H: grouped value heads (Mamba2's B/C groups, GVA)

OpCall = tuple[Any, tuple[Any, ...]]
"""A ``torch.library`` custom op and the arguments to call (or ``opcheck``) it with."""


@dataclass(frozen=True)
class RecurrenceCase:
    """One registered recurrence under test, with options.

    ``inputs(T, seed, dtype, K=, V=)``: its token-major inputs ``[1, T, ...]`` (random, float64
    values cast to ``dtype``; H, HV as above, key and value widths K, V); ``names``: what to
    call them in messages. ``oracle(*inputs, initial_state=, cu_seqlens=)``: ``(o, final)`` in
    float64, token by token. ``fla_naive(*inputs, initial_state=)``: fla-core's own token loop
    for one dense sequence (``(o, final)``). ``torch_op(inputs, h0, cu_cpu, scale)`` and
    ``fla_op(inputs, h0, cu, cu_cpu, chunk_indices, chunk_offsets, scale)``: the custom op the local
    kernel runs under torch.compile on that backend, with its arguments (``OpCall``).
    ``steps``: the kernel steps per token of the stream that op runs on (the op's outputs at
    each token's last step are the recurrence's; ``token_outputs``).
    """

    id: str
    name: str
    inputs: Callable[..., list[Tensor]]
    names: tuple[str, ...]
    oracle: Callable[..., tuple[Tensor, Tensor]]
    fla_naive: Callable[..., tuple[Tensor, Tensor]]
    torch_op: Callable[..., OpCall]
    fla_op: Callable[..., OpCall]
    options: dict[str, Any] = field(default_factory=dict)
    steps: int = 1

    def projected(self, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, ...]:
        """``(q, k, v)`` as this case takes them from one token's projections ``[1, T, heads,
        width]``: with several steps per token, k and v repeated over the steps (stride-0
        views, so their gradients sum over the steps)."""
        if self.steps == 1:
            return q, k, v
        return q, *(x.unsqueeze(2).expand(-1, -1, self.steps, -1, -1) for x in (k, v))

    def token_outputs(self, o: Tensor) -> Tensor:
        """The recurrence's outputs ``[1, T, ...]`` of its op's outputs ``[1, steps T, ...]``."""
        return o if self.steps == 1 else o.unflatten(1, (-1, self.steps))[:, :, -1]


def _rnd(gen: torch.Generator) -> Callable[..., Tensor]:
    return lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)


def _rep(*xs: Tensor) -> list[Tensor]:
    """q/k heads repeated to the value heads (fla's kernels without grouped heads)."""
    return [x.repeat_interleave(HV // H, 2) for x in xs]


# ----------------------------------------------------------------------------- delta rule


def _delta_rule_fla_op(xs, h0, offsets, kind: str, scale: float) -> OpCall:
    """The delta rule's local op on fla as torch.compile calls it: on the factors of its
    preparation op (run here, on the detached inputs), ``offsets`` = (cu, cu_cpu, table)."""
    from torchtitan_cp.ops.delta_rule import custom_ops

    prep = custom_ops.delta_rule_fla_prepare_op(*(x.detach() for x in xs), *offsets, kind, scale)
    return custom_ops.delta_rule_fla_local_op, (*xs, prep, h0, *offsets, kind, scale, True)


def _delta_rule(kind: str) -> RecurrenceCase:
    def inputs(
        T: int, seed: int, dtype: torch.dtype = torch.float64, *, K: int = K, V: int = V
    ) -> list[Tensor]:
        rnd = _rnd(torch.Generator().manual_seed(seed))
        q, k = F.normalize(rnd(1, T, H, K), dim=-1), F.normalize(rnd(1, T, H, K), dim=-1)
        v = rnd(1, T, HV, V)
        g = -F.softplus(rnd(1, T, HV, K) if kind == "kda" else rnd(1, T, HV)) * 0.3
        beta = torch.sigmoid(rnd(1, T, HV))
        return [x.to(dtype) for x in (q, k, v, g, beta)]

    def oracle(*xs: Tensor, **kw: Any) -> tuple[Tensor, Tensor]:
        return delta_rule_reference(*xs, kind=kind, **kw)

    def fla_naive(q, k, v, g, beta, *, initial_state):
        from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule
        from fla.ops.kda.naive import naive_recurrent_kda

        if kind == "kda":
            return naive_recurrent_kda(
                q, k, v, g, beta, initial_state=initial_state, output_final_state=True
            )
        # The naive GDN has no grouped heads.
        return naive_recurrent_gated_delta_rule(
            *_rep(q, k), v, beta, g, initial_state=initial_state, output_final_state=True
        )

    def torch_op(xs, h0, cu_cpu, scale) -> OpCall:
        from torchtitan_cp.ops.delta_rule.custom_ops import delta_rule_torch_op

        return delta_rule_torch_op, (*xs, h0, cu_cpu, kind, scale)

    def fla_op(xs, h0, cu, cu_cpu, chunk_indices, chunk_offsets, scale) -> OpCall:
        return _delta_rule_fla_op(xs, h0, (cu, cu_cpu, chunk_indices), kind, scale)

    return RecurrenceCase(
        kind, kind, inputs, ("q", "k", "v", "g", "beta"), oracle, fla_naive, torch_op, fla_op
    )


def _delta_product(n: int) -> RecurrenceCase:
    """GDN with ``n`` steps per token; its ops are the delta rule's on the stream of steps."""

    def inputs(
        T: int, seed: int, dtype: torch.dtype = torch.float64, *, K: int = K, V: int = V
    ) -> list[Tensor]:
        rnd = _rnd(torch.Generator().manual_seed(seed))
        q, k = F.normalize(rnd(1, T, H, K), dim=-1), F.normalize(rnd(1, T, n, H, K), dim=-1)
        v, g = rnd(1, T, n, HV, V), -F.softplus(rnd(1, T, HV)) * 0.3
        beta = torch.sigmoid(rnd(1, T, n, HV))
        return [x.to(dtype) for x in (q, k, v, g, beta)]

    def fla_naive(q, k, v, g, beta, *, initial_state):
        from fla.ops.gated_delta_product.naive import naive_recurrent_gated_delta_product

        q, k = _rep(q, k.flatten(1, 2))  # no grouped heads either
        return naive_recurrent_gated_delta_product(
            *(q, k, v.flatten(1, 2), g, beta.flatten(1, 2)),
            scale=q.shape[-1] ** -0.5,
            initial_state=initial_state,
            output_final_state=True,
            num_householder=n,
        )

    def torch_op(xs, h0, cu_cpu, scale) -> OpCall:
        from torchtitan_cp.ops.delta_rule.custom_ops import delta_rule_torch_op
        from torchtitan_cp.ops.delta_rule.product import step_stream

        cu_cpu = None if cu_cpu is None else cu_cpu * n
        return delta_rule_torch_op, (*step_stream(xs), h0, cu_cpu, "gdn", scale)

    def fla_op(xs, h0, cu, cu_cpu, chunk_indices, chunk_offsets, scale) -> OpCall:
        from torchtitan_cp.ops.cp.recurrence import SequenceTables
        from torchtitan_cp.ops.delta_rule.product import step_stream

        t = SequenceTables(cu, cu_cpu, chunk_indices, chunk_offsets).expanded(n, xs[0].shape[1])
        stream = (t.cu_seqlens, t.cu_seqlens_cpu, t.chunk_indices)
        return _delta_rule_fla_op(step_stream(xs), h0, stream, "gdn", scale)

    return RecurrenceCase(
        f"gdp{n}",
        "gdp",
        inputs,
        ("q", "k", "v", "g", "beta"),
        delta_product_reference,
        fla_naive,
        torch_op,
        fla_op,
        {"householder": n},
        steps=n,
    )


# ----------------------------------------------------------------------------- SSD


def ssd_inputs(
    T: int,
    seed: int,
    dtype: torch.dtype = torch.float64,
    *,
    K: int = K,
    V: int = V,
    per_key: bool = False,
) -> list[Tensor]:
    """``(q, k, v, g)`` for SSD: q, k ``[1, T, H, K]``, v ``[1, T, HV, V]``, g ``[1, T, HV]``
    (``[1, T, HV, K]`` with ``per_key``: GLA)."""
    rnd = _rnd(torch.Generator().manual_seed(seed))
    q, k, v = rnd(1, T, H, K), rnd(1, T, H, K), rnd(1, T, HV, V)
    g = -F.softplus(rnd(1, T, HV, K) if per_key else rnd(1, T, HV)) * 0.3
    return [x.to(dtype) for x in (q, k, v, g)]


def head_decay(heads: int, like: Tensor) -> Tensor:
    """A fixed natural-log decay per head, ``-0.1 (h + 1)``: ``[heads]`` like ``like``."""
    return -0.1 * torch.arange(1, heads + 1, device=like.device, dtype=like.dtype)


def _gated(xs: list[Tensor] | tuple[Tensor, ...]) -> list[Tensor]:
    """SSD's ``(q, k, v, g)``: a fixed-decay case's ``(q, k, v)`` with its decay per token."""
    if len(xs) == 4:
        return list(xs)
    q, k, v = xs
    return [q, k, v, head_decay(v.shape[2], v).expand(1, v.shape[1], -1).contiguous()]


def _ssd_fla_naive(*xs: Tensor, initial_state: Tensor) -> tuple[Tensor, Tensor]:
    from fla.ops.gla.naive import naive_recurrent_gla
    from fla.ops.simple_gla.naive import naive_recurrent_simple_gla

    q, k, v, g = _gated(xs)
    if g.dim() == 4:  # a gate per key: fla's GLA
        return naive_recurrent_gla(*_rep(q, k), v, g, initial_state, output_final_state=True)
    return naive_recurrent_simple_gla(
        *_rep(q, k), v, g, initial_state=initial_state, output_final_state=True
    )


def _ssd_torch_op(xs, h0, cu_cpu, scale) -> OpCall:
    from torchtitan_cp.ops.ssd.custom_ops import ssd_torch_op

    return ssd_torch_op, (*_gated(xs), h0, cu_cpu, scale)


def _ssd_fla_op(xs, h0, cu, cu_cpu, chunk_indices, chunk_offsets, scale) -> OpCall:
    from torchtitan_cp.ops.ssd.custom_ops import ssd_fla_op

    q, k, v, g = _gated(xs)
    # As chunk_ssd calls it: q/k repeated to the value heads, both chunk tables.
    return ssd_fla_op, (
        *_rep(q, k),
        v,
        g,
        h0,
        cu,
        cu_cpu,
        chunk_indices,
        chunk_offsets,
        scale,
        True,
    )


def _fixed_decay_inputs(T: int, seed: int, dtype: torch.dtype = torch.float64, **kw: int):
    return ssd_inputs(T, seed, dtype, **kw)[:3]  # (q, k, v): the gate is the fixed decay


def _fixed_decay_oracle(q: Tensor, k: Tensor, v: Tensor, **kw: Any) -> tuple[Tensor, Tensor]:
    g = head_decay(v.shape[2], v.double()).expand(1, v.shape[1], -1)
    return ssd_reference(q, k, v, g, **kw)


def _gla_inputs(T: int, seed: int, dtype: torch.dtype = torch.float64, **kw: Any):
    return ssd_inputs(T, seed, dtype, per_key=True, **kw)


def _diagonal(
    id: str, name: str, inputs: Callable[..., list[Tensor]], oracle=ssd_reference, **options: Any
) -> RecurrenceCase:
    """A case of the diagonal family (``ops/ssd``): its fla naive recurrence and custom ops."""
    names = ("q", "k", "v", "g") if oracle is ssd_reference else ("q", "k", "v")
    return RecurrenceCase(
        id, name, inputs, names, oracle, _ssd_fla_naive, _ssd_torch_op, _ssd_fla_op, options
    )


CASES: list[RecurrenceCase] = [
    _delta_rule("kda"),
    _delta_rule("gdn"),
    # Two delta-rule steps per token (DeltaProduct): the delta rule on a stream twice as long.
    _delta_product(2),
    _diagonal("ssd", "ssd", ssd_inputs),
    # SSD with a fixed decay per head instead of the gate input (what retention runs).
    _diagonal(
        "ssd-fixed-decay", "ssd", _fixed_decay_inputs, _fixed_decay_oracle, fixed_decay=head_decay
    ),
    # SSD with a gate per head and key (FLA's GLA): the registered "gla".
    _diagonal("gla", "gla", _gla_inputs),
]
