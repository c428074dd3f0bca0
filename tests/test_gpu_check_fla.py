"""Two parts of the GPU check's path stage (scripts/gpu_check.py), on CPU: the CP gradient check
on every simulated rank, and the pruned fla-core autotune (scripts/gpu_autotune.py).

* ``cp_gradient_check`` simulates 4 ranks' contiguous spans in one process (the CP op's world-1
  path, spans in reverse rank order) and compares every rank's outputs and input gradients with
  the unsharded float64 computation. FLA #1115 was a KDA CP bug with exact forwards and wrong
  gradients on every non-last rank: a test double of the fold whose backward is 10 % off (its
  forward exact) must fail the check on ranks 0-2, the ranks that publish summaries, and
  leave the last rank and every forward within tolerance.
* ``gpu_autotune.prune()`` leaves one config per fla-core autotuner (its smallest): under Triton's interpreter
  (the ``fla_interpreter`` tier) every autotuner that KDA, GDN and the causal conv use, forward
  and backward, local and through the CP op's summaries, runs with exactly one config (fla
  lists many for them) and the results still match the torch kernels; ``restore()`` brings the
  full lists back.
"""

from __future__ import annotations

import importlib.util
import sys
from typing import Any

import pytest
import torch

from tests import fla_interpreter
from tests.launch import REPO
from tests.reference import rel_err


def _gpu_check() -> Any:
    if "gpu_check" in sys.modules:
        return sys.modules["gpu_check"]
    spec = importlib.util.spec_from_file_location("gpu_check", f"{REPO}/scripts/gpu_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # puts scripts/ on sys.path (gpu_autotune)
    sys.modules["gpu_check"] = module
    return module


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the backward scales the cotangent (a wrong-gradient kernel)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return grad * 1.1


def _perturbed_fold_op(*inputs, kind, routing, group, backend, **kw):
    """The CP op with a fold whose gradient into the summaries is 10 % too large."""
    from dataclasses import dataclass

    from torchtitan_cp.ops.cp.driver import context_parallel_recurrence
    from torchtitan_cp.ops.delta_rule.recurrence import DeltaRule

    @dataclass(frozen=True)
    class PerturbedFold(DeltaRule):
        def apply(self, summary: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
            return super().apply(_ScaleGrad.apply(summary), state)

    rec = PerturbedFold(kind=kind, backend=backend)
    return context_parallel_recurrence(rec, inputs, routing=routing, group=group, **kw)


@pytest.mark.parametrize("kind", ["kda", "gdn"])
def test_cp_gradient_check_compares_every_rank(kind: str) -> None:
    gc = _gpu_check()
    gen = torch.Generator().manual_seed(0)
    out = gc.cp_gradient_check(kind, torch.device("cpu"), ["torch"], gen, tokens_per_rank=32,
                               heads=2, head_dim=16)  # fmt: skip
    res = out["torch"]
    assert out["within_tol"] and res["within_tol"], out
    assert out["published_summaries"] == gc.CP_GRAD_WORLD - 1  # every rank but the last
    assert len(res["max_rel_grad_err_per_rank"]) == gc.CP_GRAD_WORLD
    print(f"{kind}: grad {res['max_rel_grad_err_per_rank']} (tol {res['tol']:.0e})")


@pytest.mark.parametrize("kind", ["kda", "gdn"])
def test_cp_gradient_check_fails_on_wrong_non_last_rank_gradients(kind: str) -> None:
    gc = _gpu_check()
    gen = torch.Generator().manual_seed(0)
    cmp = gc.cp_gradients(kind, "torch", torch.device("cpu"), world=gc.CP_GRAD_WORLD,
                          tokens_per_rank=32, heads=2, head_dim=16, gen=gen,
                          cp_op=_perturbed_fold_op)  # fmt: skip
    res = gc.compare_cp_gradients(cmp, gc.CP_GRAD_TOL["torch"])
    assert not res["within_tol"]
    grad, fwd = res["max_rel_grad_err_per_rank"], res["max_rel_out_err_per_rank"]
    assert max(fwd) <= res["tol"], fwd  # the forward is exact: only gradients tell
    assert all(e > 100 * res["tol"] for e in grad[:-1]), grad  # every non-last rank
    assert grad[-1] <= res["tol"], grad  # the last rank publishes nothing


def _stage_case(kind: str, gen: torch.Generator) -> float:
    """fla vs torch on one small packed case (forward and backward); worst rel_err."""
    import torch.nn.functional as F

    from torchtitan_cp.ops import causal_conv1d, chunk_delta_rule

    cu = torch.tensor([0, 1, 40, 64], dtype=torch.int32)
    T, H, K = 64, 2, 16
    if kind == "conv":
        inputs = [torch.randn(1, T, 32, generator=gen), torch.randn(32, 4, generator=gen)]
    else:
        q, k = (F.normalize(torch.randn(1, T, H, K, generator=gen), dim=-1) for _ in range(2))
        v = torch.randn(1, T, H, K, generator=gen)
        g = -0.1 * torch.rand(*((1, T, H, K) if kind == "kda" else (1, T, H)), generator=gen)
        inputs = [q, k, v, g, torch.rand(1, T, H, generator=gen)]
    out = {}
    for backend in ("fla", "torch"):
        xs = [x.clone().requires_grad_(True) for x in inputs]
        if kind == "conv":
            y = causal_conv1d(*xs, None, cu_seqlens=cu, cu_seqlens_cpu=cu, backend=backend)
        else:
            y, _ = chunk_delta_rule(*xs, kind=kind, cu_seqlens=cu, cu_seqlens_cpu=cu,
                                    backend=backend)  # fmt: skip
        out[backend] = [y, *torch.autograd.grad(y.square().sum(), xs)]
    return max(rel_err(a, b) for a, b in zip(out["fla"], out["torch"]))


@pytest.mark.fla_interpreter
@pytest.mark.slow
@pytest.mark.skipif(fla_interpreter.reason() is not None, reason=str(fla_interpreter.reason()))
def test_pruned_autotune_runs_one_config_per_kernel_and_stays_correct(monkeypatch) -> None:
    from triton.runtime.autotuner import Autotuner

    gc = _gpu_check()
    import gpu_autotune

    seen: dict[str, list[int]] = {}  # kernel -> config counts each run saw
    run = Autotuner.run

    def spy(self, *args, **kwargs):
        seen.setdefault(self.base_fn.__name__, []).append(len(self.configs))
        return run(self, *args, **kwargs)

    monkeypatch.setattr(Autotuner, "run", spy)
    gen = torch.Generator().manual_seed(0)
    gpu_autotune.prune()
    try:
        errs = {kind: _stage_case(kind, gen) for kind in ("kda", "gdn", "conv")}
        # The CP gradient check on fla: the summary pass (value width V + K) and the fold.
        cp = {
            kind: gc.cp_gradient_check(kind, torch.device("cpu"), ["fla"], gen,
                                       tokens_per_rank=32, heads=1, head_dim=16)["fla"]
            for kind in ("kda", "gdn")
        }  # fmt: skip
        record = gpu_autotune.applied()
        pruned = {t.base_fn.__name__: t for t in gpu_autotune._state["pruned"]}
    finally:
        gpu_autotune.restore()
    print(f"fla vs torch: {errs}; CP: {cp}; record: {record}")
    assert all(e <= 2e-5 for e in errs.values()), errs
    assert all(c["within_tol"] for c in cp.values()), cp
    # Every fla autotuner the stage's kernels ran saw exactly one config...
    assert seen and all(set(n) == {1} for n in seen.values()), seen
    assert set(seen) <= set(pruned) and set(seen) <= set(record["kernels_run"])
    assert record["rule"] == gpu_autotune.RULE
    # ...the rule's, where fla lists many (the cold autotune the pruning avoids); none of them
    # has a pruning function that a one-config autotuner would skip.
    full = {name: len(pruned[name].configs) for name in seen}  # restored
    chosen = {n: str(gpu_autotune.choose(pruned[n].configs)) for n in seen}
    assert all(chosen[n] == record["kernels_run"][n] for n in seen), record
    assert sum(full.values()) > 3 * len(full) and max(full.values()) > 1, full
    assert all(pruned[n].early_config_prune is None and pruned[n].perf_model is None for n in seen)
    print(f"{len(full)} kernels, {sum(full.values())} candidate configs unpruned: {full}")
