"""One fixed Triton autotune config per fla-core kernel, for the GPU check's path stage only.

A cold fla-core autotune compiles every candidate config of a kernel one after another: KDA's
float32 forward and backward alone list 136 over 10 kernels, which can pass the path stage's
230 s worker timeout on a fresh machine. ``prune()`` makes every fla-core autotuner keep one
config, its **smallest**: the fewest tile elements (the product of the config's integer block
sizes, e.g. ``BK * BV``), then the fewest pipeline stages, the first in fla's order among equals
(``choose``). Not simply fla's first: fla 0.6.0 lists its preferred, largest config first where
it has one (``chunk_fwd_kernel_o``: ``BK = BV = 128``, 8 warps, 3 stages), and the check wants
the config least likely to exceed a GPU's shared memory, not the fastest. Triton then compiles
one binary per kernel and benchmarks nothing (a one-config autotuner launches it directly).

The hook is narrow: Triton's ``Autotuner.__init__`` is wrapped so that an autotuner whose kernel
is defined in an ``fla.`` module keeps only that config (it remembers the full list as
``fla_all_configs``), and autotuners built before ``prune()`` (fla imported already) are pruned
in place; ``restore()`` undoes both. A one-config autotuner skips ``early_config_prune`` and
``perf_model``: none of the kernels the stage runs (KDA, GDN, causal conv, forward and backward)
has one (``tests/test_gpu_check_fla.py`` checks it). Only ``scripts/gpu_check.py``'s path stage
calls ``prune()``, in its own process (the trainer it runs in-process included) and its
workers; training, the other stages and the tests autotune as fla does. ``applied()`` is what
the stage records in ``gpu_check.jsonl``.
"""

from __future__ import annotations

import sys
from typing import Any

RULE = (
    "one config per fla-core autotuner: the fewest tile elements, then the fewest stages, "
    "first in fla's order among equals"
)

_state: dict[str, Any] = {"init": None, "pruned": [], "missing": None}


def _is_fla(tuner: Any) -> bool:
    return getattr(getattr(tuner, "base_fn", None), "__module__", "").startswith("fla.")


def _tile_elements(config: Any) -> int:
    size = 1
    for value in config.kwargs.values():
        if isinstance(value, int) and not isinstance(value, bool):
            size *= value
    return size


def choose(configs: list[Any]) -> Any:
    """The config ``prune()`` keeps (``RULE``); ``min`` keeps the first of equals."""
    return min(configs, key=lambda c: (_tile_elements(c), c.num_stages))


def _prune_one(tuner: Any) -> None:
    if hasattr(tuner, "fla_all_configs") or not _is_fla(tuner):
        return
    tuner.fla_all_configs = list(tuner.configs)
    tuner.configs = [choose(tuner.configs)]
    _state["pruned"].append(tuner)


def _built_autotuners(autotuner_cls: type) -> list[Any]:
    """fla autotuners already built: module attributes of imported ``fla.`` modules, through
    decorators that wrap them (``triton.heuristics`` keeps the autotuner as ``.fn``)."""
    found = []
    for name, module in list(sys.modules.items()):
        if not name.startswith("fla.") or module is None:
            continue
        for value in list(vars(module).values()):
            for _ in range(4):  # decorator depth
                if isinstance(value, autotuner_cls):
                    found.append(value)
                    break
                value = getattr(value, "fn", None)
                if value is None:
                    break
    return found


def prune() -> None:
    """Keep one config per fla-core autotuner in this process, built now or later; idempotent.
    Without triton (a CPU-only torch: nothing to prune) it only records that."""
    try:
        from triton.runtime.autotuner import Autotuner
    except ImportError as e:
        _state["missing"] = f"{type(e).__name__}: {e}"
        return

    if _state["init"] is None:
        original = Autotuner.__init__

        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            original(self, *args, **kwargs)
            _prune_one(self)

        Autotuner.__init__ = __init__  # type: ignore[method-assign]
        _state["init"] = original
    for tuner in _built_autotuners(Autotuner):
        _prune_one(tuner)


def restore() -> None:
    """Undo ``prune()``: the wrapped ``__init__`` and every pruned autotuner's config list."""
    _state["missing"] = None
    if _state["init"] is not None:
        from triton.runtime.autotuner import Autotuner

        Autotuner.__init__ = _state["init"]  # type: ignore[method-assign]
        _state["init"] = None
    for tuner in _state["pruned"]:
        tuner.configs = tuner.__dict__.pop("fla_all_configs")
        tuner.cache.clear()
    _state["pruned"] = []


def applied() -> dict[str, Any]:
    """What ``gpu_check.jsonl`` records: the rule, how many autotuners and candidate configs it
    pruned in this process, and the config each kernel that ran here used."""
    if _state["missing"] is not None:
        return {"rule": f"none (triton does not import: {_state['missing']})"}
    if _state["init"] is None:
        return {"rule": "none (fla-core autotunes every candidate config)"}
    pruned = _state["pruned"]
    used = {
        t.base_fn.__name__: str(t.configs[0])
        for t in pruned
        if getattr(t, "best_config", None) is not None
    }
    return {
        "rule": RULE,
        "autotuners": len(pruned),
        "candidates_before": sum(len(t.fla_all_configs) for t in pruned),
        "kernels_run": used,
    }
