"""TOML configuration on top of torchtitan's dataclass configs.

Precedence: command line (``--section.key value``) > TOML file > recipe defaults. The TOML's
tables mirror the trainer config's sections (``[training]``, ``[parallelism]``, ``[metrics]``,
``[checkpoint]``, ``[validator]``, ``[linear_attention]``, ``[debug]``, ...); ``[model]`` names the
flavor and layer pattern and may override any size of the flavor. Unknown keys, wrong value
types and unknown flavors or layer letters are errors that name the key and the file.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import tomllib
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal


class ConfigError(ValueError):
    """A configuration problem; the message names the key, file or value."""


@dataclass(kw_only=True, slots=True)
class LinearAttentionConfig:
    """``[linear_attention]``: kernels and routing for the KDA/GDN layers."""

    backend: Literal["auto", "torch", "fla"] = "auto"
    """Local delta-rule kernels: auto = fla on CUDA, torch (pure PyTorch) elsewhere."""
    routing_source: Literal["host", "device_readback"] = "host"
    """host: build routing from the data loader's CPU positions (no device->host copy);
    device_readback: read document offsets and load-balancer layouts back from the device."""
    plan_cache_size: int = 16
    """Routing plans kept in the LRU cache (>= 1)."""
    ptrr_block_size: int = 128
    """Tokens per block the ptrr load balancer schedules (blocks of the causal document mask)."""
    fla_autotune_dir: str = "auto"
    """Where fla-core's Triton autotune results are kept across processes (CUDA only): "auto" =
    ~/.cache/torchtitan_cp/fla_autotune/<GPU>_triton<v>_fla<v>; a folder (commit it to reuse one
    GPU's results on machines like it); "" = off (fla autotunes in every process)."""
    max_subsequences: int = 256
    """With compile.enable: most document pieces one CP rank may hold in a microbatch (capped
    at its token count). Fixes the routing shapes so a compiled model never recompiles per
    layout; under CP it sizes per-layer state buffers [N, heads, K, V]. A larger microbatch is
    an error naming this key."""

    def __post_init__(self) -> None:
        if self.max_subsequences < 1:
            raise ConfigError(
                f"linear_attention.max_subsequences must be >= 1, got {self.max_subsequences}"
            )
        if self.ptrr_block_size < 1:
            raise ConfigError(
                f"linear_attention.ptrr_block_size must be >= 1, got {self.ptrr_block_size}"
            )
        if self.plan_cache_size < 1:
            raise ConfigError(
                f"linear_attention.plan_cache_size must be >= 1, got {self.plan_cache_size}"
            )


# ----------------------------------------------------------------------------- TOML layer


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is not None:  # Optional[int], list[str]: the whole annotation
        return str(tp).replace("typing.", "")
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _matches(value: Any, tp: Any) -> bool:
    """Whether a TOML value fits the annotation ``tp`` (int is accepted for float)."""
    if tp is Any:
        return True
    origin = typing.get_origin(tp)
    if origin is typing.Annotated:
        return _matches(value, typing.get_args(tp)[0])
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, a) for a in typing.get_args(tp))
    if origin is Literal:
        return value in typing.get_args(tp)
    if origin in (list, tuple, collections.abc.Sequence):
        args = typing.get_args(tp)
        if not isinstance(value, list):
            return False
        return not args or all(_matches(v, args[0]) for v in value)
    if origin is dict:
        return isinstance(value, dict)
    if tp is type(None):
        return value is None
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is str:
        return isinstance(value, str)
    if isinstance(tp, type):
        return isinstance(value, tp) or dataclasses.is_dataclass(tp)
    return True  # an annotation this layer does not model: let the dataclass decide


def literal_values(tp: Any) -> tuple[tuple[Any, ...], bool] | None:
    """The values a ``Literal`` annotation allows, in declared order (a stable order for
    messages), and whether ``None`` is allowed too (``Literal[...] | None``); None when ``tp``
    is not an enum-like annotation."""
    origin = typing.get_origin(tp)
    if origin is typing.Annotated:
        return literal_values(typing.get_args(tp)[0])
    if origin is Literal:
        return typing.get_args(tp), False
    if origin in (typing.Union, types.UnionType):
        values: list[Any] = []
        none = False
        for arg in typing.get_args(tp):
            if arg is type(None):
                none = True
                continue
            sub = literal_values(arg)
            if sub is None:
                return None
            values.extend(v for v in sub[0] if v not in values)
        return (tuple(values), none) if values else None
    return None


def field_annotation(cls: type, dotted: str) -> Any:
    """The annotation of the config key ``dotted`` (``model.attention_cp``) in the dataclass
    ``cls``, or None when there is no such key."""
    tp: Any = cls
    for part in dotted.split("."):
        hints = _hints(tp) if isinstance(tp, type) and dataclasses.is_dataclass(tp) else {}
        if part not in hints:
            return None
        tp = hints[part]
        while typing.get_origin(tp) is typing.Annotated:
            tp = typing.get_args(tp)[0]
    return tp


def allowed_text(values: tuple[Any, ...], none: bool = False) -> str:
    """``'a', 'b'`` (declared order), ``(or None to leave it unset)`` when None is allowed."""
    listed = ", ".join(repr(v) for v in values)
    return listed + (" (or None to leave it unset)" if none else "")


def _hints(cls: type) -> dict[str, Any]:
    try:
        return typing.get_type_hints(cls, include_extras=True)
    except Exception:  # forward references we cannot resolve: fall back to no checking
        return {}


def apply_table(obj: Any, table: dict[str, Any], *, where: str, prefix: str = "") -> None:
    """Set ``table``'s keys on the dataclass ``obj`` recursively, rejecting unknown keys and
    values of the wrong type. ``where`` names the source (the TOML file) in errors."""
    fields = {f.name: f for f in dataclasses.fields(obj) if not f.name.startswith("_")}
    hints = _hints(type(obj))
    for key, value in table.items():
        dotted = f"{prefix}{key}"
        if key not in fields:
            known = ", ".join(sorted(fields))
            raise ConfigError(f"{where}: unknown key '{dotted}' (known keys here: {known})")
        current = getattr(obj, key)
        if isinstance(value, dict) and dataclasses.is_dataclass(current):
            apply_table(current, value, where=where, prefix=f"{dotted}.")
            continue
        tp = hints.get(key)
        ok = _matches(value, tp) if tp is not None else _same_kind(value, current)
        if not ok:
            enum = literal_values(tp) if tp is not None else None
            if enum is not None:  # TOML has no null: the listed values are the choices
                raise ConfigError(
                    f"{where}: key '{dotted}' must be one of {allowed_text(enum[0])}, got {value!r}"
                )
            want = _type_name(tp) if tp is not None else type(current).__name__
            raise ConfigError(
                f"{where}: key '{dotted}' expects {want}, got {type(value).__name__} {value!r}"
            )
        if isinstance(current, float) and isinstance(value, int):
            value = float(value)
        setattr(obj, key, value)
    post_init = getattr(obj, "__post_init__", None)
    if prefix and post_init is not None:
        # Re-run the section's own validation on the values the file set.
        try:
            post_init()
        except ValueError as e:
            raise ConfigError(f"{where}: [{prefix.rstrip('.')}] {e}") from None


def _same_kind(value: Any, current: Any) -> bool:
    if current is None:
        return True
    if isinstance(current, bool) or isinstance(value, bool):
        return isinstance(current, bool) and isinstance(value, bool)
    if isinstance(current, float):
        return isinstance(value, (int, float))
    return isinstance(value, type(current))


def read_toml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"config file {path} is a folder; pass a TOML file in it")
    if not p.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        with p.open("rb") as f:
            return tomllib.load(f)
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: invalid TOML: {e}") from None
    except OSError as e:
        raise ConfigError(f"config file {path}: cannot be read ({e.strerror or e})") from None


def split_config_file(argv: list[str], default: str | None) -> tuple[str | None, list[str]]:
    """Pull ``--config_file PATH`` (or ``--config_file=PATH``) out of ``argv``."""
    rest: list[str] = []
    path = default
    i = 0
    while i < len(argv):
        a = argv[i]
        if a in ("--config_file", "--config-file"):
            if i + 1 >= len(argv):
                raise ConfigError("--config_file needs a path")
            path = argv[i + 1]
            i += 2
            continue
        if a.startswith(("--config_file=", "--config-file=")):
            path = a.split("=", 1)[1]
        else:
            rest.append(a)
        i += 1
    return path, rest
