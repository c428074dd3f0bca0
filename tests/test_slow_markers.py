"""Every test that starts a process carries the ``slow`` marker, so ``pytest -m "not slow"`` is
the fast in-process loop.

A static scan of tests/*.py: a function starts a process when it calls ``subprocess.*``,
``os.system``/``os.fork``, ``mp.spawn`` or ``<ctx>.Process``, or (transitively, through local
definitions, imports from other test modules and fixture arguments) a function that does, such as
``run_distributed``, ``torchrun_train`` and ``python_train``. A test counts as marked when the
function, its class or its module (``pytestmark``) carries ``pytest.mark.slow``.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent

# Attribute calls that start a process: ``module.attr(...)`` with the module named as imported.
_SPAWN_ATTRS = {("os", "system"), ("os", "fork"), ("os", "posix_spawn"), ("mp", "spawn")}


class _Module:
    """One parsed test file: its top-level functions and the names it imports from tests/."""

    def __init__(self, name: str, tree: ast.Module) -> None:
        self.name = name
        self.tree = tree
        self.defs: dict[str, ast.FunctionDef] = {}
        self.imports: dict[str, tuple[str, str]] = {}  # local name -> (module, name)
        self.aliases: dict[str, str] = {}  # ``import tests.launch as launch``: launch -> launch
        for node in tree.body:
            if isinstance(node, ast.FunctionDef):
                self.defs[node.name] = node
            elif isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, ast.FunctionDef):
                        self.defs[f"{node.name}.{item.name}"] = item
        for node in ast.walk(tree):  # also function-local imports
            if isinstance(node, ast.ImportFrom) and node.module == "tests":
                for alias in node.names:
                    self.aliases[alias.asname or alias.name] = alias.name
            elif isinstance(node, ast.ImportFrom) and node.module:
                module = node.module.removeprefix("tests.")
                for alias in node.names:
                    self.imports[alias.asname or alias.name] = (module, alias.name)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    self.aliases[alias.asname or alias.name] = alias.name.removeprefix("tests.")


def _called_names(fn: ast.AST) -> tuple[set[str], bool]:
    """Names this function calls (``f`` and ``module.f``), and whether it starts a process
    itself."""
    names: set[str] = set()
    direct = False
    for node in ast.walk(fn):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Name):
            names.add(f.id)
        elif isinstance(f, ast.Attribute):
            base = f.value.id if isinstance(f.value, ast.Name) else None
            if base == "subprocess" or (base, f.attr) in _SPAWN_ATTRS or f.attr == "Process":
                direct = True
            names.add(f.attr)
            if base is not None:
                names.add(f"{base}.{f.attr}")
    return names, direct


class Scanner:
    """Which functions of a set of test modules start a process (memoised, cycle-safe)."""

    def __init__(self, sources: dict[str, str]) -> None:
        self.modules = {name: _Module(name, ast.parse(src)) for name, src in sources.items()}
        self._memo: dict[tuple[str, str], bool] = {}

    def spawns(self, module: str, name: str) -> bool:
        key = (module, name)
        if key in self._memo:
            return self._memo[key]
        self._memo[key] = False  # a recursion cycle adds nothing
        mod = self.modules.get(module)
        result = False
        if mod is not None and name in mod.defs:
            fn = mod.defs[name]
            called, result = _called_names(fn)
            if name.startswith("test") or "." in name:  # fixtures reach tests as arguments
                called |= {a.arg for a in fn.args.args}
            result = result or any(self._resolve(mod, c) for c in called)
        elif mod is not None and name in mod.imports:
            result = self.spawns(*mod.imports[name])
        self._memo[key] = result
        return result

    def _resolve(self, mod: _Module, name: str) -> bool:
        if name in mod.defs:
            return self.spawns(mod.name, name)
        if name in mod.imports:
            return self.spawns(*mod.imports[name])
        base, _, attr = name.partition(".")
        if attr and base in mod.aliases:
            return self.spawns(mod.aliases[base], attr)
        return False

    def unmarked(self) -> list[str]:
        """``file::test`` for every test that starts a process without the slow marker."""
        bad = []
        for mod in self.modules.values():
            if not mod.name.startswith("test_") or _module_is_slow(mod.tree):
                continue
            for node in mod.tree.body:
                if isinstance(node, ast.FunctionDef):
                    owner, tests = None, [node]
                elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
                    owner, tests = node, [n for n in node.body if isinstance(n, ast.FunctionDef)]
                else:
                    continue
                if owner is not None and _is_slow(owner.decorator_list):
                    continue
                for fn in tests:
                    if not fn.name.startswith("test") or _is_slow(fn.decorator_list):
                        continue
                    name = fn.name if owner is None else f"{owner.name}.{fn.name}"
                    if self.spawns(mod.name, name):
                        bad.append(f"{mod.name}.py::{name}")
        return sorted(bad)


def _is_slow_mark(node: ast.AST) -> bool:
    """``pytest.mark.slow`` (possibly called)."""
    if isinstance(node, ast.Call):
        node = node.func
    return isinstance(node, ast.Attribute) and node.attr == "slow"


def _is_slow(decorators: list[ast.expr]) -> bool:
    return any(_is_slow_mark(d) for d in decorators)


def _module_is_slow(tree: ast.Module) -> bool:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets
        ):
            marks = (
                node.value.elts if isinstance(node.value, ast.List | ast.Tuple) else [node.value]
            )
            return any(_is_slow_mark(m) for m in marks)
    return False


def _suite() -> dict[str, str]:
    return {p.stem: p.read_text() for p in sorted(TESTS.glob("*.py"))}


def test_every_process_starting_test_is_marked_slow() -> None:
    bad = Scanner(_suite()).unmarked()
    assert not bad, "start processes but lack @pytest.mark.slow: " + ", ".join(bad)


def test_the_scan_sees_the_suites_launchers() -> None:
    scanner = Scanner(_suite())
    for module, name in [
        ("dist_utils", "run_distributed"),
        ("launch", "torchrun_train"),
        ("launch", "python_train"),
    ]:
        assert scanner.spawns(module, name), (module, name)
    assert not scanner.spawns("dist_utils", "max_abs")


HELPER = """
import subprocess
def run_cli(*a):
    return subprocess.run(a)
"""

CASES = """
import pytest
from helper import run_cli
from dist_utils import run_distributed
import helper as h

@pytest.fixture
def started():
    return run_cli("x")

def _worker(rank, world):
    return rank

def test_direct():
    run_distributed(_worker, 2)

def test_through_helper():
    run_cli("y")

def test_through_fixture(started):
    pass

@pytest.mark.slow
def test_marked():
    run_cli("z")

def test_through_module():
    h.run_cli("v")

def test_in_process():
    _worker(0, 1)

class TestGroup:
    def test_method(self):
        run_cli("w")
"""


def test_the_scan_flags_unmarked_launches_and_spares_marked_ones() -> None:
    suite = _suite()
    sources = {"dist_utils": suite["dist_utils"], "helper": HELPER, "test_cases": CASES}
    assert Scanner(sources).unmarked() == [
        "test_cases.py::TestGroup.test_method",
        "test_cases.py::test_direct",
        "test_cases.py::test_through_fixture",
        "test_cases.py::test_through_helper",
        "test_cases.py::test_through_module",
    ]
    sources["test_cases"] = "import pytest\npytestmark = [pytest.mark.slow]\n" + CASES
    assert Scanner(sources).unmarked() == []
