#!/usr/bin/env bash
# The whole test suite: lint, format check, type check, then pytest (multi-process gloo tests
# included).
# Extra arguments go to pytest, e.g. ./scripts/test.sh tests/test_routing_plan.py -x
# The fast loop: ./scripts/test.sh -m "not slow" (only tests that start no process).
# fla's Triton kernels on CPU (Triton's interpreter): ./scripts/test.sh -m fla_interpreter;
# -m "not fla_interpreter" skips that tier (about 4.5 minutes).
# TORCHTITAN_CP_NAN_FILL=1 ./scripts/test.sh -m "not slow": uninitialised memory reads as NaN, so a
# test that reads memory it never wrote fails every time (tests/conftest.py).
# TEST_WORKERS (default 2): pytest-xdist workers, each taking whole files (`--dist loadfile`, so a
# module's fixtures and caches are built once). The suite's in-process tests run on one thread
# (OMP_NUM_THREADS=1) and its multi-rank tests wait on process starts and on each other, so one
# worker leaves a 2-core machine partly idle. On a 2-core machine two workers ran the suite in
# 27 min of wall time (3,040 s of CPU time, 1.86 cores busy); one worker's last CI run took 45.
# TEST_WORKERS=0 runs it in this process (needed for `-s`, pdb, or a test that prints live).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
cd "$ROOT"
export WANDB_MODE=offline WANDB_SILENT=true OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
echo "== ruff check" && ruff check .
echo "== ruff format --check" && ruff format --check .
echo "== pyrefly check" && pyrefly check torchtitan_cp
echo "== pytest"
WORKERS="${TEST_WORKERS:-2}"
if [ "$WORKERS" = 0 ]; then
  exec python -m pytest -q "$@"
fi
exec python -m pytest -q -n "$WORKERS" --dist loadfile "$@"
