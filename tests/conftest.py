"""The suite's shared pytest configuration.

* Markers: ``slow`` marks every test that starts a process (gloo ranks, torchrun, a subprocess)
  and the interpreted-kernel tests; ``pytest -m "not slow"`` is the fast in-process loop. The
  plugin ``tests.process_starts`` registers the marker and fails an unmarked test that starts a
  process. ``fla_interpreter`` marks the tier that runs fla-core's Triton kernels on CPU under
  Triton's interpreter (tests/fla_interpreter.py); every test of the tier carries both marks.
* The tier's set-up: fla's kernels must be imported after Triton's interpreter is on, and test
  modules import fla at collection, so the interpreter is installed here, before collection,
  whenever the ``-m`` expression can select the tier. ``-m "not slow"`` (the fast loop) and
  ``-m "not fla_interpreter"`` leave this process untouched. Tests of a normal run's behaviour
  take the ``interpreter_off`` fixture.
* ``gpu_check`` marks what the GPU check's one call runs on CUDA (tests/test_gpu_parity.py).
* ``TORCHTITAN_CP_NAN_FILL=1``: uninitialised memory (``torch.empty`` and its kin) is filled
  with NaN (integers: their maximum) in this process (torch's deterministic mode, warnings
  only), so a test that reads memory it never wrote fails every time, not at random after
  whatever an earlier test left in the allocator. The fast loop passes under it (issue 38:
  ``test_delta_net_decay_rate_is_float32_under_bf16_params`` read an unset ``dt_bias``).
* Shared helpers are imported one way, as ``tests.<module>`` (``tests`` is a package):
  ``tests.dist_utils`` (gloo ranks, layout cases), ``tests.launch`` (the real entry points),
  ``tests.helpers`` (batches, files), ``tests.reference`` (float64 oracles),
  ``tests.fla_interpreter`` (the tier's interpreter set-up).
"""

from __future__ import annotations

import os

import pytest

from tests import fla_interpreter

pytest_plugins = ["tests.process_starts"]

FLA_INTERPRETER = "fla_interpreter"
TIER_MARKS = {FLA_INTERPRETER, "slow"}  # every test of the tier carries both


def _tier_selected(config: pytest.Config) -> bool:
    expr = config.getoption("markexpr", "") or ""
    if not expr:
        return True
    try:  # pytest's own -m evaluator (private, stable since pytest 6); unsure: select
        from _pytest.mark.expression import Expression

        return Expression.compile(expr).evaluate(lambda name, **_: name in TIER_MARKS)
    except Exception:
        return True


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{FLA_INTERPRETER}: fla-core's Triton kernels on CPU under Triton's interpreter "
        "(tests/fla_interpreter.py); also slow",
    )
    config.addinivalue_line(
        "markers",
        "gpu_check: run on CUDA by scripts/gpu_check.py's one call (its correctness part, "
        "pytest -m gpu_check); the same bodies run here on the torch backend or the fla tier",
    )
    if _tier_selected(config):
        fla_interpreter.install()
    if os.environ.get("TORCHTITAN_CP_NAN_FILL") == "1":
        import torch

        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.utils.deterministic.fill_uninitialized_memory = True  # pyrefly: ignore[bad-assignment]


@pytest.fixture
def interpreter_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """A normal run's view of Triton in a process where the tier turned its interpreter on."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
