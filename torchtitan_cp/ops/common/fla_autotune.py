"""fla-core's Triton autotune results kept across processes: autotune once per machine.

Triton's ``Autotuner`` benchmarks every candidate config of a kernel the first time a process
launches it with a new tuning key (the key arguments and the tensors' dtypes): on an H200 about
25 s for fla's causal conv and minutes for KDA's set, in **every** process (each rank, each run,
the GPU check's every worker). ``persist(directory)`` makes every fla autotuner (a kernel
defined in an ``fla.`` module, built now or later) start from the results saved in
``directory`` and save there what it tunes, so a second process on the same GPU launches at
once. The files are fla's own config-cache format (``fla/ops/utils/cache.py``: one
``{kernel}.json`` per kernel, ``autotune_entries`` keyed by the md5 of the tuning key, each with
its ``autotune_key`` and ``config``); a folder a user fills on one GPU can be committed and reused
on machines with the same GPU, triton and fla (``[linear_attention] fla_autotune_dir``). A saved
config is used only if it is one of the kernel's current candidates (same block sizes, warps,
stages, CTAs) and was saved for a kernel of the same module: a file from another fla version is
ignored, never trusted. Writes are atomic (a rename) and merge with what other processes saved;
two ranks tuning the same key at once both write, the last one stays.

``on_fla_autotuners(hook)`` is the one hook into Triton both this and the GPU check's config
pruning (``scripts/gpu_autotune.py``) use. Imports triton only when called (CPU runs without
triton import nothing).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["default_dir", "fla_autotuners", "on_fla_autotuners", "persist", "resolve_dir", "stats"]

_hooks: list[Callable[[Any], None]] = []
_init: dict[str, Any] = {"original": None}
_state: dict[str, Any] = {"dir": None, "loaded": 0, "tuned": 0, "kernels_tuned": []}


def is_fla(tuner: Any) -> bool:
    """Whether an autotuner's kernel is defined in an fla module."""
    return getattr(getattr(tuner, "base_fn", None), "__module__", "").startswith("fla.")


def fla_autotuners(autotuner_cls: type) -> list[Any]:
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


def on_fla_autotuners(hook: Callable[[Any], None]) -> bool:
    """Call ``hook(tuner)`` for every fla autotuner built so far and every one built later (its
    ``__init__`` is wrapped once); False without triton. Hooks run in the order added."""
    try:
        from triton.runtime.autotuner import Autotuner
    except ImportError:
        return False
    if _init["original"] is None:
        original = Autotuner.__init__

        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            original(self, *args, **kwargs)
            if is_fla(self):
                for h in list(_hooks):
                    h(self)

        Autotuner.__init__ = __init__  # type: ignore[method-assign]
        _init["original"] = original
    if hook not in _hooks:
        _hooks.append(hook)
    for tuner in fla_autotuners(Autotuner):
        hook(tuner)
    return True


def remove_hook(hook: Callable[[Any], None]) -> None:
    """Stop calling ``hook`` for autotuners built from now on."""
    if hook in _hooks:
        _hooks.remove(hook)


# ----------------------------------------------------------------------------- the folder


def _sanitize(text: str) -> str:
    return re.sub(r"[^0-9A-Za-z.]+", "_", text).strip("_") or "unknown"


def default_dir() -> Path:
    """``$XDG_CACHE_HOME`` (or ``~/.cache``) ``/torchtitan_cp/fla_autotune/<GPU>_triton<v>_fla<v>``:
    configs depend on all three."""
    import importlib.metadata

    import torch

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    try:
        fla_version = importlib.metadata.version("fla-core")
    except importlib.metadata.PackageNotFoundError:
        fla_version = "none"
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    name = _sanitize(f"{gpu}_triton{triton_version}_fla{fla_version}")
    return root / "torchtitan_cp" / "fla_autotune" / name


def resolve_dir(setting: str) -> Path | None:
    """``[linear_attention] fla_autotune_dir``: ``"auto"`` is ``default_dir()``, ``""`` is off
    (None), anything else that folder."""
    if setting == "":
        return None
    return default_dir() if setting == "auto" else Path(setting).expanduser()


# ----------------------------------------------------------------------------- the entries


def _key_hash(key: Any) -> str:
    """fla's ``AutotuneKey.key_hash`` (fla/ops/utils/cache.py): md5 of the compact JSON."""
    text = json.dumps(_plain(key), separators=(",", ":"), sort_keys=True)
    return hashlib.md5(text.encode()).hexdigest()


def _plain(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _tupled(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_tupled(v) for v in value)
    return value


def _config_dict(cfg: Any) -> dict[str, Any]:
    return {
        "kwargs": dict(cfg.kwargs),
        "num_warps": cfg.num_warps,
        "num_stages": cfg.num_stages,
        "num_ctas": getattr(cfg, "num_ctas", 1),
        "maxnreg": getattr(cfg, "maxnreg", None),
    }


def _candidate(tuner: Any, saved: dict[str, Any]) -> Any | None:
    """The tuner's own candidate config equal to ``saved``, or None."""
    for cfg in tuner.configs:
        if _config_dict(cfg) == saved:
            return cfg
    return None


def _path(tuner: Any) -> Path:
    return Path(_state["dir"]) / f"{tuner.base_fn.__name__}.json"


def _read(path: Path) -> dict[str, Any]:
    try:
        with open(path) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _load(tuner: Any) -> None:
    entries = _read(_path(tuner)).get("autotune_entries") or {}
    module = tuner.base_fn.__module__
    for entry in entries.values():
        if not isinstance(entry, dict) or entry.get("module", module) != module:
            continue
        cfg = _candidate(tuner, entry.get("config") or {})
        if cfg is None:
            continue
        key = _tupled(entry.get("autotune_key"))
        if key not in tuner.cache:
            tuner.cache[key] = cfg
            _state["loaded"] += 1


def _save(tuner: Any, keys: list[Any]) -> None:
    import triton

    path = _path(tuner)
    data = _read(path)
    entries = data.get("autotune_entries")
    if not isinstance(entries, dict):
        entries = {}
    for key in keys:
        entries[_key_hash(key)] = {
            "autotune_key": _plain(key),
            "config": _config_dict(tuner.cache[key]),
            "module": tuner.base_fn.__module__,
        }
    data.update(
        kernel_name=tuner.base_fn.__name__,
        triton_version=triton.__version__,
        autotune_entries=entries,
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    os.replace(tmp, path)


def _attach(tuner: Any) -> None:
    """Wrap this autotuner's ``run``: load the folder's entries before its first launch, save
    the keys it tuned after each launch that tuned."""
    if getattr(tuner, "_torchtitan_cp_persist", False):
        return
    tuner._torchtitan_cp_persist = True
    run = tuner.run
    loaded = [False]

    def persisted_run(*args: Any, **kwargs: Any) -> Any:
        if len(tuner.configs) <= 1:  # nothing to tune (one candidate, or pruned to one)
            return run(*args, **kwargs)
        if not loaded[0]:
            loaded[0] = True
            _load(tuner)
        before = set(tuner.cache)
        out = run(*args, **kwargs)
        new = [k for k in tuner.cache if k not in before]
        if new:
            _state["tuned"] += len(new)
            _state["kernels_tuned"].append(tuner.base_fn.__name__)
            _save(tuner, new)
        return out

    tuner.run = persisted_run


def persist(directory: str | Path) -> bool:
    """Keep every fla autotuner's results in ``directory`` (module docstring); idempotent.
    False (nothing done) without triton."""
    _state["dir"] = Path(directory)
    return on_fla_autotuners(_attach)


def stats() -> dict[str, Any]:
    """This process: the folder, the entries loaded into autotuners, the keys tuned (each a
    cache miss that benchmarked the candidates, or picked one where they were pruned) and the
    kernels that tuned."""
    return {
        "dir": None if _state["dir"] is None else str(_state["dir"]),
        "loaded": _state["loaded"],
        "tuned": _state["tuned"],
        "kernels_tuned": sorted(set(_state["kernels_tuned"])),
    }
