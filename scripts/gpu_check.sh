#!/usr/bin/env bash
# GPU evidence for the host routing path, on one GPU whose Python already has torch and Triton
# but not torchtitan or FLA. Installs the project's other dependencies from wheel files in
# WHEEL_DIR (default: .whl beside the repo root; fill it with scripts/gpu_wheels.sh on a machine
# with network), with no network, then runs scripts/gpu_check.py (well under 8 minutes on an
# H200). Extra arguments go to gpu_check.py, e.g. --seq-len 32768 --json out.json
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WHEEL_DIR="${WHEEL_DIR:-$ROOT/.whl}"
SITE="${SITE:-$ROOT/.gpu_site}"  # git-ignored
PY="${PYTHON:-python3}"
if ! "$PY" -c "import torchtitan, fla" >/dev/null 2>&1; then
  ls "$WHEEL_DIR"/*.whl >/dev/null 2>&1 || { echo "gpu_check: no wheels in $WHEEL_DIR" >&2; exit 2; }
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" "$WHEEL_DIR"/*.whl
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
exec "$PY" "$ROOT/scripts/gpu_check.py" "$@"
