"""One fixed Triton autotune config per fla-core kernel, for the GPU check (scripts/gpu_check.py).

A cold fla-core autotune compiles and times every candidate config of a kernel one after
another: KDA's float32 forward and backward alone list 136 over 10 kernels, and on the H200
(2026-12-04) KDA's bfloat16 set at the 150M model's shapes had not finished after 235 s. So
fla's autotune must not decide whether the check finishes: ``prune(rule)`` makes every fla-core
autotuner keep one config, chosen by ``rule`` (``RULES``):

* ``smallest`` (the correctness parts): the fewest tile elements (the product of the config's
  integer block sizes, e.g. ``BK * BV``), then the fewest pipeline stages, the first in fla's
  order among equals: the config least likely to exceed a GPU's shared memory.
* ``first`` (the timing parts): fla's first listed config, its preferred one where it has one
  (fla 0.6.0 lists its largest first, e.g. ``chunk_fwd_kernel_o``: ``BK = BV = 128``, 8 warps,
  3 stages): the closest to what a tuned run would pick without timing anything.

Triton then compiles one binary per kernel and benchmarks nothing (a one-config autotuner
launches it directly). The hook is the package's one hook into Triton's autotuners
(``torchtitan_cp.ops.common.fla_autotune.on_fla_autotuners``: ``Autotuner.__init__`` wrapped for
kernels defined in ``fla.`` modules, those already built pruned in place); ``restore()`` undoes it.
A one-config autotuner skips ``early_config_prune`` and ``perf_model``: none of the kernels the
check runs has one (``tests/test_gpu_check_fla.py`` checks it). ``applied()`` is what every line
of ``gpu_check.jsonl`` records (``fla_autotune``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torchtitan_cp.ops.common import fla_autotune


def _tile_elements(config: Any) -> int:
    size = 1
    for value in config.kwargs.values():
        if isinstance(value, int) and not isinstance(value, bool):
            size *= value
    return size


def smallest(configs: list[Any]) -> Any:
    """The fewest tile elements, then the fewest stages; ``min`` keeps the first of equals."""
    return min(configs, key=lambda c: (_tile_elements(c), c.num_stages))


def first(configs: list[Any]) -> Any:
    """fla's first listed config (its preferred one)."""
    return configs[0]


RULES: dict[str, tuple[Callable[[list[Any]], Any], str]] = {
    "smallest": (smallest, "one config per fla-core autotuner, its smallest: the fewest tile "
                 "elements, then the fewest stages, first in fla's order among equals"),
    "first": (first, "one config per fla-core autotuner, fla's first (its preferred)"),
}  # fmt: skip # a table, laid out by hand to read across
choose = smallest  # the correctness parts' rule (tests/test_gpu_check_fla.py)
RULE = RULES["smallest"][1]

_state: dict[str, Any] = {"rule": None, "pruned": [], "missing": None, "hook": None}


def kernel_id(tuner: Any) -> str:
    """A tuned kernel's name in the record: its module below ``fla.ops.`` and its function name.
    fla-core reuses function names across modules (``chunk_fwd_kernel_o`` is both
    ``common.chunk_o``'s and ``gated_delta_product.chunk_deltaproduct_o``'s), so the bare name
    would let one kernel's entry stand for another's."""
    fn = tuner.base_fn
    return f"{fn.__module__.removeprefix('fla.ops.').removeprefix('fla.')}.{fn.__name__}"


def prune(rule: str = "smallest") -> None:
    """Keep one config per fla-core autotuner in this process (``RULES[rule]``), built now or
    later; one rule per process. Without triton (a CPU-only torch) it only records that."""
    pick = RULES[rule][0]
    if _state["rule"] not in (None, rule):
        raise RuntimeError(f"gpu_autotune: rule {_state['rule']!r} is already in effect")

    def hook(tuner: Any) -> None:
        if hasattr(tuner, "fla_all_configs"):
            return
        tuner.fla_all_configs = list(tuner.configs)
        tuner.configs = [pick(tuner.configs)]
        _state["pruned"].append(tuner)

    if _state["hook"] is None:
        if not fla_autotune.on_fla_autotuners(hook):
            _state["missing"] = "triton does not import"
            return
        _state["hook"] = hook
    _state["rule"] = rule


def restore() -> None:
    """Undo ``prune()``: later autotuners keep fla's lists, and every pruned one gets its back."""
    if _state["hook"] is not None:
        fla_autotune.remove_hook(_state["hook"])
    for tuner in _state["pruned"]:
        tuner.configs = tuner.__dict__.pop("fla_all_configs")
        tuner.cache.clear()
    _state.update(rule=None, pruned=[], missing=None, hook=None)


def applied() -> dict[str, Any]:
    """What ``gpu_check.jsonl`` records: the rule, how many autotuners and candidate configs it
    pruned in this process, and the config each kernel that ran here used."""
    if _state["missing"] is not None:
        return {"rule": f"none ({_state['missing']})"}
    if _state["rule"] is None:
        return {"rule": "none (fla-core autotunes every candidate config)"}
    pruned = _state["pruned"]
    used = {
        kernel_id(t): str(t.configs[0])
        for t in pruned
        if getattr(t, "best_config", None) is not None
    }
    return {
        "rule": RULES[_state["rule"]][1],
        "autotuners": len(pruned),
        "candidates_before": sum(len(t.fla_all_configs) for t in pruned),
        "kernels_run": used,
    }
