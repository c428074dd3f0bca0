#!/usr/bin/env bash
# Download the wheels scripts/gpu_check.sh installs on a GPU machine without network (torch and
# Triton are expected there already). Run where pip reaches PyPI: ./scripts/gpu_wheels.sh [DIR]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DIR="${1:-$ROOT/.whl}"
PY="${PYTHON:-python3}"
"$PY" -m pip download -q --no-deps --only-binary=:all: -d "$DIR" \
  torchtitan==0.3.0 fla-core==0.6.0 spmd_types==0.2.3 tyro docstring-parser typeguard \
  pytest iniconfig pluggy pygments hypothesis sortedcontainers attrs
ls -1 "$DIR"
