#!/usr/bin/env bash
# GPU evidence for the host routing path, on one GPU whose Python already has torch and Triton
# but not torchtitan or FLA. Installs the project's other dependencies from wheel files in
# WHEEL_DIR (default: .whl beside the repo root; fill it with scripts/gpu_wheels.sh on a machine
# with network), with no network, then runs the CUDA-only tests (fla kernels, the CP delta rule on
# fla, flex vs sdpa forward and backward; GPU_TESTS=0 skips them) and scripts/gpu_check.py (well
# under 8 minutes on an H200 together). Extra arguments go to gpu_check.py, e.g.
# --seq-len 32768 --json out.json
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
if [[ "${GPU_TESTS:-1}" != 0 ]]; then
  # A failing test is reported but does not stop the measurements below.
  (cd "$ROOT" && "$PY" -m pytest -q -p no:cacheprovider tests/test_kernels_fla.py \
    tests/test_cp_delta_rule.py::test_fla_backend_out_of_order_span \
    tests/test_cp_flex_attention.py::test_flex_matches_sdpa_on_cuda_forward_and_backward) \
    || echo "gpu_check: CUDA tests failed (exit $?)" >&2
fi
exec "$PY" "$ROOT/scripts/gpu_check.py" "$@"
