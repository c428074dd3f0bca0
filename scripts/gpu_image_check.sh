#!/usr/bin/env bash
# Emulate the GPU machine's image on a CPU machine, in one command: ./scripts/gpu_image_check.sh
# 1. A Python 3.12 venv with torch==2.11.0 (the CUDA build, ~4.7 GB; it imports without a GPU),
#    numpy and the few packages the GPU image is known to have that the check uses (tokenizers,
#    huggingface_hub, safetensors, pytest, ...; scripts/gpu_wheels.sh drops the same list), built
#    once in GPU_IMAGE_DIR (default .gpu_image/, git-ignored) and reused while that list and its
#    package set are unchanged. Python 3.12: PYTHON312, python3.12 on PATH, or pyenv.
# 2. scripts/gpu_wheels.sh into a fresh folder (needs PyPI).
# 3. scripts/gpu_check.sh --all --device cpu, with those wheels only (--no-index, a fresh
#    site): the import gate (scripts/gpu_imports.py --trainer), the trainer's whole-step sync
#    check (dry run), the CUDA-only tests (collected, skipped on CPU), the timing and compile
#    dry runs.
# 4. Two steps of configs/debug_cpu.toml through the trainer (torch 2.11 through compat.py's
#    shims); the trainer refuses two processes on torch 2.11 in one line (exit 2); the import
#    gate rejects a site without einops (fla swallows that in `import fla`); `pip install
#    --no-deps` of the project accepts the image's Python.
# Exits non-zero on any failure. Needs network for steps 1-2; about 6 GB of disk.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${GPU_IMAGE_DIR:-$ROOT/.gpu_image}"
VENV="$CACHE/venv"
# What the GPU image has (docs/gpu.md, "The GPU image"), as far as the check uses it.
IMAGE_PACKAGES=(torch==2.11.0 numpy tokenizers huggingface_hub safetensors pytest pytest-xdist
                pytest-timeout hypothesis attrs rich typing-extensions pandas pyarrow)
unset PYTHONPATH  # nothing from the calling environment leaks into the image
step() { echo; echo "== gpu_image_check: $*"; }

find_python312() {
  local candidate
  for candidate in "${PYTHON312:-}" python3.12 \
      "$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python3.12; do
    # A pyenv shim is on PATH even where it cannot run 3.12: try the interpreter itself.
    if [[ -n "$candidate" ]] && "$candidate" -c \
        'import sys, venv; sys.exit(sys.version_info[:2] != (3, 12))' >/dev/null 2>&1; then
      command -v "$candidate"; return 0
    fi
  done
  echo "gpu_image_check: no Python 3.12 found (set PYTHON312, put python3.12 on PATH, or pyenv install 3.12)" >&2
  return 1
}

step "1. image venv (Python 3.12, ${IMAGE_PACKAGES[*]}) in $VENV"
STAMP="$VENV/.image_packages.txt"
stamp() { echo "${IMAGE_PACKAGES[*]}"; "$VENV/bin/python" -m pip freeze 2>/dev/null; }
if [[ -f "$STAMP" ]] && [[ "$(stamp)" == "$(cat "$STAMP")" ]]; then
  echo "reusing it"
else
  if ! "$VENV/bin/python" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then
    PY312="$(find_python312)"
    rm -rf "$VENV"
    mkdir -p "$CACHE"
    "$PY312" -m venv "$VENV"
  fi
  echo "installing ${IMAGE_PACKAGES[*]} with $("$VENV/bin/python" --version) (a ~4.7 GB download the first time)"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check "${IMAGE_PACKAGES[@]}"
  stamp > "$STAMP"
fi
PY="$VENV/bin/python"
"$PY" -c "import sys, torch, numpy; print('python', sys.version.split()[0], 'torch', torch.__version__, 'numpy', numpy.__version__)"
if "$PY" -c "import einops" 2>/dev/null; then
  echo "gpu_image_check: $VENV has einops; step 4c needs an image without it (rm -r $VENV)" >&2
  exit 1
fi

step "2. scripts/gpu_wheels.sh for Python 3.12"
WHEELS="$CACHE/wheels" SITE="$CACHE/site"
rm -rf "$WHEELS" "$SITE"
"$ROOT/scripts/gpu_wheels.sh" "$WHEELS" --python-version 3.12

step "3. scripts/gpu_check.sh --all --device cpu (the one call's dry run), with only those wheels, offline"
rm -rf "$CACHE/gpu_cache"
log="$CACHE/gpu-check-all.log"
if ! PYTHON="$PY" WHEEL_DIR="$WHEELS" SITE="$SITE" GPU_CACHE="$CACHE/gpu_cache" \
    GPU_CHECK_BUDGET=3000 OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" "$ROOT/scripts/gpu_check.sh" \
    --all --device cpu --box-scale 20 --flavor debug --pattern KGKA --seq-len 256 --mean-doc 40 \
    --steps 2 --warmup 1 --compile-backend aot_eager > "$log" 2>&1; then
  tail -30 "$log"; echo "gpu_image_check: the dry run of gpu_check.sh --all failed (log: $log)" >&2; exit 1
fi
grep -a -E '^(gpu_check: |gpu_imports: |\| |[0-9]+ (passed|skipped))' "$log" || true

step "4. two steps of configs/debug_cpu.toml through the trainer, torch $("$PY" -c 'import torch; print(torch.__version__)')"
RUN="$CACHE/run"
rm -rf "$RUN"
out="$(cd "$ROOT" && PYTHONPATH="$SITE:$ROOT" OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" "$PY" -m \
  torchtitan_cp.train --config_file configs/debug_cpu.toml --training.steps 2 \
  --metrics.no-enable_wandb --dump_folder "$RUN" 2>&1)" || { echo "$out" | tail -20; exit 1; }
echo "$out" | grep -a -E 'step: +[0-9]+ ' | sed 's/\x1b\[[0-9;]*m//g'
[[ "$(grep -c '"loss"' "$RUN/metrics.jsonl")" == 2 ]] || { echo "gpu_image_check: no two trainer steps in $RUN/metrics.jsonl" >&2; exit 1; }
rm -rf "$RUN"

step "4b. the trainer refuses two processes on torch 2.11, in one line"
rc=0
out="$(cd "$ROOT" && PYTHONPATH="$SITE:$ROOT" "$PY" -m torchtitan_cp.train --check --nproc 2 2>&1)" || rc=$?
echo "$out" | tail -1
if [[ $rc != 2 || "$(echo "$out" | tail -1)" != *"which needs torch >= 2.14, found torch 2.11"* ]]; then
  echo "gpu_image_check: expected the one-line refusal and exit 2, got exit $rc" >&2; exit 1
fi

step "4c. the import gate names a missing einops"
NO_EINOPS="$CACHE/site-no-einops"
rm -rf "$NO_EINOPS"
mapfile -t files < <(grep -v -E '^(#|python |einops==|\s*$)' "$WHEELS/gpu_wheels.txt" | cut -d' ' -f2)
"$PY" -m pip install -q --no-index --no-deps --no-compile --target "$NO_EINOPS" "${files[@]/#/$WHEELS/}"
if out="$(PYTHONPATH="$NO_EINOPS:$ROOT" "$PY" "$ROOT/scripts/gpu_imports.py" 2>&1)"; then
  echo "gpu_image_check: the import gate passed without einops" >&2; exit 1
fi
echo "$out" | tail -1
[[ "$(echo "$out" | tail -1)" == *"'einops'"* ]] || { echo "gpu_image_check: the error does not name einops" >&2; exit 1; }
rm -rf "$NO_EINOPS"

step "4d. pip install --no-deps of the project into the image's Python"
PROJECT="$CACHE/project"
rm -rf "$PROJECT"
mkdir -p "$PROJECT/src"  # a copy: the build leaves build/ and *.egg-info beside its sources
cp -r "$ROOT/pyproject.toml" "$ROOT/README.md" "$ROOT/LICENSE" "$ROOT/torchtitan_cp" "$PROJECT/src"
"$PY" -m pip install -q --no-deps --no-index --no-build-isolation --target "$PROJECT/site" \
  "$PROJECT/src"
ls "$PROJECT/site" | grep -E '^torchtitan_cp' | tr '\n' ' '; echo
rm -rf "$PROJECT"

echo
echo "gpu_image_check: passed (Python 3.12, torch $("$PY" -c 'import torch; print(torch.__version__)'), carried wheels only)"
