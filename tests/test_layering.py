"""The package's arrows (docs/architecture.md, "Packages and their layering"), read from the
source: lower packages never import upper ones, families of a layer do not import each other,
no import cycles, and ``routing/`` and ``ops/`` work without torchtitan."""

from __future__ import annotations

import ast
import functools
import sys
from pathlib import Path

import pytest

import torchtitan_cp

PACKAGE = Path(torchtitan_cp.__file__).parent
ROOT = "torchtitan_cp"

# Which top-level parts of the package each part may import (its own part is always allowed).
ARROWS: dict[str, set[str]] = {
    "routing": set(),
    "ops": {"routing"},
    "compat": set(),
    "models": {"ops", "routing", "compat", "run"},  # run: the checkpoint files' own check
    "data": {"routing"},
    "run": set(),
    "trainer": {"models", "ops", "routing", "compat", "data", "run"},
    "train": {"trainer", "compat", "data", "run"},  # the entry points
    "checkpoint": {"run"},
    "export_hf": {"train", "trainer", "models", "run", "compat"},
    "launch": {"run"},
    "__init__": set(),
}

# ops/: the shared infrastructure has fixed layers; every other folder is an op family (its
# math: delta_rule, ssd, conv, attention, ...), found from the folder, not listed here, so a new
# family needs no edit of this file. Families sit on layer 2 and do not import each other.
OPS_INFRASTRUCTURE = {"common": 0, "fla_compat": 1, "cp": 1, "__init__": 3}
OP_FAMILY_LAYER = 2


def op_families(ops_dir: Path = PACKAGE / "ops") -> list[str]:
    """The op families: the packages under ``ops_dir`` other than the shared ones."""
    return sorted(
        p.name
        for p in ops_dir.iterdir()
        if (p / "__init__.py").is_file() and p.name not in OPS_INFRASTRUCTURE
    )


def ops_layers(ops_dir: Path = PACKAGE / "ops") -> dict[str, int]:
    """The layer of every sub-part of ``ops_dir``: the shared ones', then each family's."""
    return {**OPS_INFRASTRUCTURE, **dict.fromkeys(op_families(ops_dir), OP_FAMILY_LAYER)}


# Inside a package: the layer of each sub-part (a part imports its own layer's modules of the
# same sub-part and any lower layer; sub-parts of one layer do not import each other).
LAYERS: dict[str, dict[str, int]] = {
    "ops": ops_layers(),
    "models": {
        "context": 0, "hf_folder": 0, "sequence": 1, "blocks": 2, "mixers": 3, "hybrid": 4,
        "qwen35": 4, "kimi_linear": 4,
        "recipe": 5,
        "__init__": 6,
    },
}  # fmt: skip # a table, laid out by hand to read across
# Lower-layer sub-parts a sub-part may not import even so (Qwen3.5 is torchtitan's own model).
FORBIDDEN = {("models", "qwen35", "mixers")}


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


MODULES = _modules()


def _type_checking_nodes(tree: ast.Module) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            ids |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return ids


@functools.cache
def imports(name: str) -> list[tuple[str, bool]]:
    """``(imported module, only under TYPE_CHECKING)`` for every import anywhere in ``name``'s
    source (module level and inside functions), relative imports resolved; ``from m import x``
    counts as importing ``m.x`` when that is a module of the package."""
    path = MODULES[name]
    tree = ast.parse(path.read_text())
    typing_only = _type_checking_nodes(tree)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, id(node) in typing_only) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            for a in node.names:
                sub = f"{module}.{a.name}"
                out.append((sub if sub in MODULES else module, id(node) in typing_only))
    return out


def _part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _sub_part(module: str) -> str:
    parts = module.split(".")
    return parts[2] if len(parts) > 2 else "__init__"


def _layer(pkg: str, sub_part: str, layers: dict[str, dict[str, int]] = LAYERS) -> int:
    layer = layers[pkg].get(sub_part)
    assert layer is not None, (
        f"torchtitan_cp/{pkg}/{sub_part} has no layer: give it one in tests/test_layering.py "
        f"LAYERS[{pkg!r}]"
        + (" (or make it a folder: a folder under ops/ is an op family)" if pkg == "ops" else "")
    )
    return layer


def test_packages_import_only_what_is_below_them():
    bad = []
    for name in MODULES:
        for target, _ in imports(name):
            if target.split(".")[0] != ROOT:
                continue
            src, dst = _part(name), _part(target)
            if dst != src and dst not in ARROWS[src]:
                bad.append(f"{name} imports {target} ({src} -> {dst})")
    assert not bad, "\n".join(bad)


def test_layers_inside_ops_and_models():
    bad = []
    for name in MODULES:
        pkg = _part(name)
        if pkg not in LAYERS:
            continue
        for target, _ in imports(name):
            if _part(target) != pkg or target.split(".")[0] != ROOT:
                continue
            src, dst = _sub_part(name), _sub_part(target)
            if src == dst:
                continue
            low, high = _layer(pkg, dst), _layer(pkg, src)
            if low >= high or (pkg, src, dst) in FORBIDDEN:
                bad.append(f"{name} imports {target} ({pkg}: {src} -> {dst})")
    assert not bad, "\n".join(bad)


def test_no_import_cycles():
    # Every import counts, inside functions too (a late import hiding a cycle is a cycle);
    # TYPE_CHECKING imports do not run.
    graph = {
        name: sorted({t for t, typing_only in imports(name) if t in MODULES and not typing_only})
        for name in MODULES
    }
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in graph[node]:
            if state.get(nxt) == 1:
                cycles.append(" -> ".join(stack[stack.index(nxt) :] + [nxt]))
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for name in graph:
        if name not in state:
            visit(name)
    assert not cycles, "\n".join(cycles)


def test_routing_and_ops_work_without_torchtitan():
    bad = [
        f"{name} imports {target}"
        for name in MODULES
        if _part(name) in ("routing", "ops")
        for target, _ in imports(name)
        if target.split(".")[0] == "torchtitan"
    ]
    assert not bad, "\n".join(bad)


def _module_level_imports(path):
    tree = ast.parse(path.read_text())
    for node in tree.body:  # module level only: lazy imports inside functions are allowed
        if isinstance(node, ast.Import):
            yield from (alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            yield node.module.split(".")[0]


def test_routing_module_level_imports_are_torch_or_stdlib():
    # routing/ depends on torch and the standard library only (matplotlib lazily, for --plot).
    allowed = set(sys.stdlib_module_names) | {"torch", "__future__"}
    for path in sorted((PACKAGE / "routing").glob("*.py")):
        bad = set(_module_level_imports(path)) - allowed
        assert not bad, f"{path.name} imports {sorted(bad)} at module level"


def test_no_import_tricks():
    # No module __getattr__ (lazy attributes that dodge a cycle) and no E402 blocks (code that
    # must run between imports belongs in the entry point or a package __init__).
    bad = []
    for name, path in MODULES.items():
        source = path.read_text()
        tree = ast.parse(source)
        if any(isinstance(n, ast.FunctionDef) and n.name == "__getattr__" for n in tree.body):
            bad.append(f"{name}: module __getattr__")
        if "noqa: E402" in source:
            bad.append(f"{name}: noqa: E402")
    assert not bad, "\n".join(bad)


def test_op_families_come_from_the_folders():
    # The shipped families are found; every module of ops/ has a layer (a new folder gets the
    # op-family rule, a new top-level module is named in a one-line failure, not a KeyError).
    assert {"delta_rule", "conv", "attention"} <= set(op_families())
    assert not set(op_families()) & set(OPS_INFRASTRUCTURE)
    for name in MODULES:
        if _part(name) == "ops":
            _layer("ops", _sub_part(name))


def test_a_new_op_family_gets_the_family_rule(tmp_path):
    """A folder added under ops/ is an op family on layer 2 without an edit here (above
    ops/common and ops/cp, beside the other families); a stray top-level module is one
    assertion line naming it, not a KeyError (checked on a scratch ops/ layout)."""
    ops = tmp_path / "ops"
    for part in ("common", "cp", "delta_rule", "gla"):
        (ops / part).mkdir(parents=True)
        (ops / part / "__init__.py").write_text("")
    (ops / "notes").mkdir()  # a folder without __init__.py is no package
    (ops / "stray.py").write_text("")
    layers = {"ops": ops_layers(ops)}
    assert op_families(ops) == ["delta_rule", "gla"]
    assert _layer("ops", "gla", layers) == _layer("ops", "delta_rule", layers) == OP_FAMILY_LAYER
    assert OP_FAMILY_LAYER > _layer("ops", "cp", layers) > _layer("ops", "common", layers)
    with pytest.raises(AssertionError, match=r"torchtitan_cp/ops/stray has no layer"):
        _layer("ops", "stray", layers)


def test_the_scan_resolves_relative_and_submodule_imports():
    # The checks above are only as good as the import resolution: spot-check it.
    assert ("torchtitan_cp.ops.common.checks", False) in imports("torchtitan_cp.ops.conv.local")
    assert ("torchtitan_cp.ops.conv.custom_ops", False) in imports("torchtitan_cp.ops.conv.local")
    assert ("torchtitan_cp.routing", True) in imports("torchtitan_cp.ops.cp.driver")
    lazy = imports("torchtitan_cp.models.hybrid.flavors")
    assert ("torchtitan_cp.models.hybrid.parallelize", False) in lazy  # inside a function


def test_registries_name_modules_below_them():
    """The registries that name their entries' modules as strings (imported when the name is
    used): ``MODELS`` names a module of a model package below ``recipe``, ``RECURRENCES`` one
    of an op family (the arrows the import scan cannot see)."""
    from torchtitan_cp.models.recipe import MODELS
    from torchtitan_cp.ops.cp.recurrence import RECURRENCES

    targets = [("torchtitan_cp.models.recipe", path) for path in MODELS.values()]
    targets += [("torchtitan_cp.ops.cp.recurrence", path) for path, _ in RECURRENCES.values()]
    for registry, path in targets:
        module = path.split(":")[0]
        assert module in MODULES, path
        pkg = _part(registry)
        assert _part(module) == pkg, path
        if pkg == "models":
            assert _layer(pkg, _sub_part(module)) < _layer(pkg, _sub_part(registry)), path
        else:
            assert _sub_part(module) in op_families(), path


def test_the_positions_reach_a_kda_kernel_without_the_trainer():
    """The path of a batch's positions, traced: the loader's collate (``HostMetadata``), the
    preprocessor's one call (layout, plan, the context's device tensors) and a KDA layer's
    forward down to its kernel enter no module of ``trainer/``: the context is built below it
    and nothing on the way climbs back up."""
    import torch

    from torchtitan_cp.data.loader import collate_with_host_metadata
    from torchtitan_cp.models import model_config
    from torchtitan_cp.models.sequence import SequencePreprocessor

    with torch.device("cpu"):
        model = model_config("debug", layer_pattern="KA", vocab_size=64, dim=32).build()
    model.init_states()
    positions = torch.cat([torch.arange(5), torch.arange(11)])
    samples = [({"input": torch.arange(16) % 64, "positions": positions}, torch.ones(16).long())]
    preprocessor = SequencePreprocessor(device="cpu", cp_group=None, load_balancer="headtail")
    entered: set[str] = set()

    def record(frame, event, arg):
        if event == "call":
            entered.add(frame.f_globals.get("__name__", ""))

    sys.setprofile(record)
    try:
        input_dict, labels = collate_with_host_metadata(samples)
        inputs, labels, kwargs = preprocessor.preprocess(input_dict, labels)
        with torch.no_grad():
            model(inputs, **kwargs)
    finally:
        sys.setprofile(None)
    ours = {m for m in entered if m.split(".")[0] == ROOT}
    on_the_way = {
        "torchtitan_cp.data.loader",
        "torchtitan_cp.routing.host_metadata",
        "torchtitan_cp.models.sequence",
        "torchtitan_cp.routing.plan",
        "torchtitan_cp.models.context",
        "torchtitan_cp.models.mixers.delta_net",
        "torchtitan_cp.ops.delta_rule.torch_kernel",
    }
    assert on_the_way <= ours, sorted(on_the_way - ours)  # the trace saw the whole path
    assert not [m for m in ours if _part(m) == "trainer"], sorted(ours)
