#!/usr/bin/env bash
# GPU evidence for the host routing path, on one GPU whose Python (PYTHON, default python3)
# already has torch (>= 2.11), Triton and numpy but maybe not torchtitan or FLA.
# 1. Installs, with no network, the wheels listed in WHEEL_DIR/gpu_wheels.txt (fill WHEEL_DIR,
#    default .whl beside the repo root, with scripts/gpu_wheels.sh on a machine with network)
#    into SITE (default .gpu_site, git-ignored). Skipped when WHEEL_DIR is unset and step 2
#    already passes.
# 2. Checks torch >= 2.11 and imports everything the CUDA path loads (scripts/gpu_imports.py);
#    an old torch or a missing module stops here with one line naming it.
# 3. Runs the CUDA-only tests (fla kernels, the CP delta rule on fla, flex vs sdpa forward and
#    backward; GPU_TESTS=0 skips them). A failure is reported, the measurements still run, and
#    the exit status is 1.
# 4. Runs scripts/gpu_check.py (well under 8 minutes on an H200 together with step 3). Extra
#    arguments go to it, e.g. --seq-len 32768 --json out.json, or --device cpu for a dry run.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SITE="${SITE:-$ROOT/.gpu_site}"
PY="${PYTHON:-python3}"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

install_wheels() {
  local dir="$1" manifest="$1/gpu_wheels.txt" want have line pin file files=()
  [[ -f "$manifest" ]] || { echo "gpu_check: no gpu_wheels.txt in $dir; fill it with scripts/gpu_wheels.sh $dir" >&2; return 2; }
  want="$(sed -n 's/^python //p' "$manifest")"
  have="$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
  if [[ "$want" != "$have" ]]; then
    echo "gpu_check: the wheels in $dir are for Python $want but $PY is Python $have; run scripts/gpu_wheels.sh $dir --python-version $have" >&2
    return 2
  fi
  while read -r pin file; do
    [[ -f "$dir/$file" ]] || { echo "gpu_check: $dir lacks the wheel of $pin ($file); run scripts/gpu_wheels.sh $dir --python-version $want" >&2; return 2; }
    files+=("$dir/$file")
  done < <(grep -v -E '^(#|python |\s*$)' "$manifest")
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" "${files[@]}"
}

if [[ -n "${WHEEL_DIR:-}" ]] || ! "$PY" "$ROOT/scripts/gpu_imports.py" >/dev/null 2>&1; then
  install_wheels "${WHEEL_DIR:-$ROOT/.whl}" || exit 2
  export PYTHONPATH="$SITE:$PYTHONPATH"
fi
"$PY" "$ROOT/scripts/gpu_imports.py" || exit 2
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
tests_failed=0
if [[ "${GPU_TESTS:-1}" != 0 ]]; then
  (cd "$ROOT" && "$PY" -m pytest -q -p no:cacheprovider tests/test_kernels_fla.py \
    tests/test_cp_delta_rule.py::test_fla_backend_out_of_order_span \
    tests/test_cp_flex_attention.py::test_flex_matches_sdpa_on_cuda_forward_and_backward \
    tests/test_compile.py::test_fla_ops_opcheck_cuda \
    tests/test_qwen35_cuda.py) \
    || { tests_failed=$?; echo "gpu_check: CUDA tests failed (exit $tests_failed)" >&2; }
fi
"$PY" "$ROOT/scripts/gpu_check.py" "$@"
exit $((tests_failed ? 1 : 0))
