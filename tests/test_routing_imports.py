"""routing/ depends on torch and the standard library only (matplotlib lazily, for --plot)."""

import ast
import sys
from pathlib import Path

import torchtitan_cp.routing

ROUTING = Path(torchtitan_cp.routing.__file__).parent


def _module_level_imports(path):
    tree = ast.parse(path.read_text())
    for node in tree.body:  # module level only: lazy imports inside functions are allowed
        if isinstance(node, ast.Import):
            yield from (alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            yield node.module.split(".")[0]


def test_module_level_imports_are_torch_or_stdlib():
    allowed = set(sys.stdlib_module_names) | {"torch", "__future__"}
    for path in sorted(ROUTING.glob("*.py")):
        bad = set(_module_level_imports(path)) - allowed
        assert not bad, f"{path.name} imports {sorted(bad)} at module level"
