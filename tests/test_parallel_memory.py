"""docs/parallelism.md's memory table is what scripts/parallel_memory.py prints (the formula and
the numbers stay together)."""

from __future__ import annotations

import contextlib
import importlib.util
import io

from tests.launch import REPO


def test_the_memory_table_in_the_docs_is_the_scripts_output():
    spec = importlib.util.spec_from_file_location(
        "parallel_memory", REPO / "scripts" / "parallel_memory.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        module.main()
    rows = out.getvalue().splitlines()
    doc = (REPO / "docs" / "parallelism.md").read_text()
    assert len(rows) == 24  # the CP x TP table, a blank line, the PP table
    missing = [row for row in rows if row not in doc]
    assert not missing, missing
    # more ranks, less state: FSDP divides the parameters, gradients and moments by all of them
    g8 = module.per_rank(module.MODELS["27B"], 131072, 8, 1, 1)
    g64 = module.per_rank(module.MODELS["27B"], 131072, 8, 8, 1)
    assert abs(g8["state"] / g64["state"] - 8) < 1e-9
