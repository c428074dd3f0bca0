"""The GPU check's pruned fla-core autotune (scripts/gpu_autotune.py), on CPU under Triton's
interpreter (the ``fla_interpreter`` tier): with either rule (``smallest``, the correctness
parts'; ``first``, the timing parts') every autotuner that KDA, GDN and the causal conv use,
forward and backward, local and through the CP op's summaries, runs with exactly one config, the
rule's (fla lists many for them), and the results still match the torch kernels; ``restore()``
brings the full lists back. The CP gradient check itself is tests/test_gpu_parity.py's.
"""

from __future__ import annotations

import sys

import pytest
import torch

from tests import cp_gradients, fla_interpreter
from tests.launch import REPO
from tests.recurrences import CASES
from tests.reference import rel_err

sys.path.insert(0, str(REPO / "scripts"))
import gpu_autotune  # noqa: E402


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
            y, _ = chunk_delta_rule(
                *xs, kind=kind, cu_seqlens=cu, cu_seqlens_cpu=cu, backend=backend
            )
        out[backend] = [y, *torch.autograd.grad(y.square().sum(), xs)]
    return max(rel_err(a, b) for a, b in zip(out["fla"], out["torch"]))


@pytest.mark.fla_interpreter
@pytest.mark.slow
@pytest.mark.skipif(fla_interpreter.reason() is not None, reason=str(fla_interpreter.reason()))
@pytest.mark.parametrize("rule", sorted(gpu_autotune.RULES))
def test_pruned_autotune_runs_one_config_per_kernel_and_stays_correct(monkeypatch, rule) -> None:
    # fla-core reuses kernel names across modules: this one defines a second
    # ``chunk_fwd_kernel_o`` (common.chunk_o's is the one GDN runs), so the record must key
    # kernels by module too. CI failed here when another test file had imported it first.
    import fla.ops.gated_delta_product  # noqa: F401
    from triton.runtime.autotuner import Autotuner

    seen: dict[str, list[int]] = {}  # kernel -> config counts each run saw
    run = Autotuner.run

    def spy(self, *args, **kwargs):
        seen.setdefault(gpu_autotune.kernel_id(self), []).append(len(self.configs))
        return run(self, *args, **kwargs)

    monkeypatch.setattr(Autotuner, "run", spy)
    gen = torch.Generator().manual_seed(0)
    gpu_autotune.prune(rule)
    try:
        errs = {kind: _stage_case(kind, gen) for kind in ("kda", "gdn", "conv")}
        # The CP gradient check on fla: the summary pass (value width V + K) and the fold.
        cp = {
            c.id: cp_gradients.compare(
                cp_gradients.cp_gradients(c, "fla", torch.device("cpu"), tokens_per_rank=32,
                                          K=16, V=16), 2e-5)
            for c in CASES if c.name in ("kda", "gdn")
        }  # fmt: skip # a table, laid out by hand to read across
        record = gpu_autotune.applied()
        pruned = {gpu_autotune.kernel_id(t): t for t in gpu_autotune._state["pruned"]}
        assert len(pruned) == len(gpu_autotune._state["pruned"]), "two kernels share an id"
    finally:
        gpu_autotune.restore()
    print(f"fla vs torch: {errs}; CP: {cp}; record: {record}")
    assert all(e <= 2e-5 for e in errs.values()), errs
    assert all(c["within_tol"] for c in cp.values()), cp
    # Every fla autotuner the kernels ran saw exactly one config...
    assert seen and all(set(n) == {1} for n in seen.values()), seen
    assert set(seen) <= set(pruned) and set(seen) <= set(record["kernels_run"])
    assert record["rule"] == gpu_autotune.RULES[rule][1]
    # ...the rule's, where fla lists many (the cold autotune the pruning avoids); none of them
    # has a pruning function that a one-config autotuner would skip.
    full = {name: len(pruned[name].configs) for name in seen}  # restored
    pick = gpu_autotune.RULES[rule][0]
    chosen = {n: str(pick(pruned[n].configs)) for n in seen}
    assert all(chosen[n] == record["kernels_run"][n] for n in seen), record
    assert sum(full.values()) > 3 * len(full) and max(full.values()) > 1, full
    assert all(pruned[n].early_config_prune is None and pruned[n].perf_model is None for n in seen)
    if rule == "first":  # fla's first is not its smallest somewhere: the rules differ
        assert any(str(gpu_autotune.smallest(pruned[n].configs)) != chosen[n] for n in seen)
    print(f"{len(full)} kernels, {sum(full.values())} candidate configs unpruned: {full}")
