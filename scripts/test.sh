#!/usr/bin/env bash
# The whole test suite: lint, format check, type check, then pytest (multi-process gloo tests
# included).
# Extra arguments go to pytest, e.g. ./scripts/test.sh tests/test_routing_plan.py -x
# The fast loop: ./scripts/test.sh -m "not slow" (only tests that start no process).
# fla's Triton kernels on CPU (Triton's interpreter): ./scripts/test.sh -m fla_interpreter;
# -m "not fla_interpreter" skips that tier (about 4.5 minutes).
# TORCHTITAN_CP_NAN_FILL=1 ./scripts/test.sh -m "not slow": uninitialised memory reads as NaN, so a
# test that reads memory it never wrote fails every time (tests/conftest.py).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
cd "$ROOT"
export WANDB_MODE=offline WANDB_SILENT=true OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
echo "== ruff check" && ruff check .
echo "== ruff format --check" && ruff format --check .
echo "== pyrefly check" && pyrefly check torchtitan_cp
echo "== pytest"
exec python -m pytest -q "$@"
