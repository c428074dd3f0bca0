"""Run fla-core's Triton kernels on CPU tensors through Triton's interpreter (the test tier
``fla_interpreter``). Test support only: production code never imports this module.

``install()`` must run before fla's kernel modules are imported (``@triton.jit`` picks the
interpreter when it decorates), so ``tests/conftest.py`` calls it at ``pytest_configure`` and
``tests/fla_interpreter_train.py`` at the start of each trainer rank. It returns None when the
interpreter is on, else the one line saying what is missing (the tier's skip reason).

Written for triton 3.8.0 and fla-core 0.6.0 (the pins); each patch says why it is needed.
"""

from __future__ import annotations

import ast
import collections
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import os
import sys
import warnings
from typing import Any

TRITON_VERSION = "3.8.0"  # the version the patches below are written against (pyproject pins it)
# cudaDevAttrMaxSharedMemoryPerBlockOptin of an H100/H200 (sm90), what triton's driver reports
# as 'max_shared_mem' there; equals fla's Backend.HOPPER threshold.
H200_MAX_SHARED_MEM = 232448

_state: dict[str, Any] = {"reason": "fla_interpreter.install() was not called"}


def reason() -> str | None:
    """None when the interpreter is installed in this process, else why not (one line)."""
    return _state["reason"]


def install() -> str | None:
    """Turn the Triton interpreter on for this process and patch what fla needs; idempotent.
    Returns None on success, else the one-line reason the tier cannot run here."""
    if _state.get("installed"):
        return None
    why = _unavailable()
    _state["reason"] = why
    if why is not None:
        return why
    # The switch itself: @triton.jit returns an InterpretedFunction (numpy on the host) instead
    # of compiling for a GPU. Read when fla's modules are decorated, hence before they load.
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton.runtime.interpreter as interp
        from triton.runtime.autotuner import Autotuner
    except Exception as e:  # a broken triton install: skip, naming it
        _state["reason"] = f"the Triton interpreter does not load: {type(e).__name__}: {e}"
        os.environ.pop("TRITON_INTERPRET", None)
        return _state["reason"]
    _patch_autotuner(Autotuner)
    _patch_loop_variables(interp)
    _patch_fla_shared_memory()
    # fla's modules import triton.experimental.gluon, which wraps Triton's standard functions
    # once, asserting that they are JIT functions unless the interpreter is on at that moment:
    # import it now, so a test that turns the interpreter off (``interpreter_off``) before this
    # process first imports fla.modules still imports it (test_validate's Qwen3.5 rows failed
    # with a bare AssertionError when run alone, and passed after any test that imported it).
    import triton.experimental.gluon  # noqa: F401

    # fla warns once per device query that Triton has no GPU here; expected in this tier.
    warnings.filterwarnings("ignore", message="Triton is not supported on current platform")
    _state.update(installed=True, reason=None)
    return None


def _unavailable() -> str | None:
    try:
        version = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return f"triton is not installed (the fla interpreter tier needs triton=={TRITON_VERSION})"
    if version != TRITON_VERSION:
        return f"triton {version} is installed; the fla interpreter tier is written for {TRITON_VERSION}"
    if importlib.util.find_spec("fla") is None:
        return "fla-core is not installed"
    try:
        import numpy  # noqa: F401  (the interpreter computes in numpy)
    except ImportError:
        return "numpy is not installed (the Triton interpreter needs it)"
    import torch

    if torch.cuda.is_available():
        return "CUDA is available: fla runs its compiled kernels here, not the interpreter"
    if any(m == "fla.ops" or m.startswith("fla.ops.") for m in sys.modules) and (
        os.environ.get("TRITON_INTERPRET") != "1"
    ):
        return "fla's kernels were imported before the interpreter was installed"
    return None


def _patch_autotuner(autotuner_cls: Any) -> None:
    # Autotuning benchmarks every config on a GPU driver ("0 active drivers" here): keep one
    # config per kernel, the one with the largest tiles (fewest programs: fastest interpreted).
    original = autotuner_cls.prune_configs
    if getattr(original, "fla_interpreter_patch", False):
        return

    def tile_size(config: Any) -> int:
        size = 1
        for value in config.kwargs.values():
            if isinstance(value, int) and not isinstance(value, bool):
                size *= value
        return size

    def prune_configs(self: Any, kwargs: dict) -> list:
        configs = original(self, kwargs)
        return [max(configs, key=tile_size)]  # max keeps the first of equals: stable

    prune_configs.fla_interpreter_patch = True  # type: ignore[attr-defined]
    autotuner_cls.prune_configs = prune_configs
    # Single-config kernels never reach prune_configs; nothing to do for them.


class _LoopVariablesAsTensors:
    """fla calls ``i_t.to(tl.int64)`` on ``for`` loop variables, which compiled Triton makes
    scalar tensors and the interpreter leaves as Python ints: rebind each loop variable at the
    top of the loop body (``i = i``), which triton's own rewriter then turns into an interpreter
    tensor like every assignment. ``tl.static_range`` loops keep their constant ints."""

    fla_interpreter_patch = True

    def __init__(self, base: ast.NodeTransformer) -> None:
        self.base = base  # triton's rewriter: the value of every assignment -> a tensor

    def visit(self, tree: ast.AST) -> ast.AST:
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.For)
                and isinstance(node.target, ast.Name)
                and not _is_static_range(node.iter)
            ):
                name = node.target.id
                rebind = ast.Assign(
                    targets=[ast.Name(id=name, ctx=ast.Store())],
                    value=ast.Name(id=name, ctx=ast.Load()),
                )
                node.body.insert(0, ast.copy_location(rebind, node))
        return self.base.visit(tree)


def _is_static_range(call: ast.expr) -> bool:
    if not isinstance(call, ast.Call):
        return False
    f = call.func
    name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
    return name == "static_range"


def _patch_loop_variables(interp: Any) -> None:
    # Flags, not isinstance: this module may be loaded twice (as fla_interpreter and as
    # tests.fla_interpreter), each copy with its own classes.
    rewriter = interp.FunctionRewriter
    if getattr(rewriter.ast_transformer, "fla_interpreter_patch", False):
        return
    rewriter.ast_transformer = _LoopVariablesAsTensors(rewriter.ast_transformer)


class _SharedMemoryAsH200(importlib.abc.MetaPathFinder):
    """fla sizes its tiles when its modules load (``check_shared_mem()`` in module bodies) from
    triton's driver, which the interpreter lacks (fla then answers False: the smallest tiles).
    Answer as an H200 would, for any device index (CPU tensors have index None), by patching
    ``fla.utils.hardware`` right after it executes, before any kernel module asks."""

    fla_interpreter_patch = True

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != "fla.utils.hardware":
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        loader: Any = spec.loader
        exec_module = loader.exec_module

        def exec_and_patch(module: Any) -> None:
            exec_module(module)
            every_device = collections.defaultdict(lambda: H200_MAX_SHARED_MEM)
            module.get_all_max_shared_mem = lambda: every_device

        loader.exec_module = exec_and_patch  # this spec's own loader instance
        return spec


def _patch_fla_shared_memory() -> None:
    if not any(getattr(f, "fla_interpreter_patch", False) for f in sys.meta_path):
        sys.meta_path.insert(0, _SharedMemoryAsH200())
