#!/usr/bin/env bash
# GPU evidence for the host routing path, one stage per call, on one GPU whose Python (PYTHON,
# default python3) already has torch (>= 2.11), Triton and numpy but maybe not torchtitan or FLA:
#   ./scripts/gpu_check.sh --stage path|tests|timing|compile [more scripts/gpu_check.py args]
# (docs/gpu.md gives the sequence of device calls and their timeouts; --device cpu: dry run).
# 1. Installs, with no network, the wheels listed in WHEEL_DIR/gpu_wheels.txt (fill WHEEL_DIR,
#    default .whl beside the repo root, with scripts/gpu_wheels.sh on a machine with network)
#    into SITE (default .gpu_site, git-ignored), when WHEEL_DIR is set or the imports of the CUDA
#    path fail (a later call on the same machine finds them installed); a missing import after
#    that is one line naming it (exit 2). The path stage checks the trainer's imports itself.
# 2. Keeps Triton's and inductor's caches in GPU_CACHE (default .gpu_cache, git-ignored):
#    compiled kernels and fla's autotuning results, so a second call (or stage) reuses them.
# 3. Runs the stage; every finished part appends a JSON line to GPU_CACHE/gpu_check.jsonl and,
#    when OUT is set (the device tool's output folder), to OUT/gpu_check.jsonl too.
# Exit status: 0 when every part passed, 1 when one failed, 2 when the setup failed.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SITE="${SITE:-$ROOT/.gpu_site}"
CACHE="${GPU_CACHE:-$ROOT/.gpu_cache}"
PY="${PYTHON:-python3}"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# Binaries only (no intermediate IR): the cache holds every autotuning candidate.
export TRITON_CACHE_DIR="$CACHE/triton" TORCHINDUCTOR_CACHE_DIR="$CACHE/inductor"
export TRITON_STORE_BINARY_ONLY=1
# The GPU machine has no network: datasets and the hub must not try it (a hang, not an error).
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 HF_DATASETS_CACHE="$CACHE/datasets"

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

[[ -d "$SITE" ]] && export PYTHONPATH="$SITE:$PYTHONPATH"
if [[ -n "${WHEEL_DIR:-}" ]] || ! imports="$("$PY" "$ROOT/scripts/gpu_imports.py" 2>&1)"; then
  install_wheels "${WHEEL_DIR:-$ROOT/.whl}" || exit 2
  [[ ":$PYTHONPATH:" == *":$SITE:"* ]] || export PYTHONPATH="$SITE:$PYTHONPATH"
  imports="$("$PY" "$ROOT/scripts/gpu_imports.py" 2>&1)" || { echo "$imports" >&2; exit 2; }
fi
echo "$imports"
results=(--results "$CACHE/gpu_check.jsonl")
[[ -n "${OUT:-}" ]] && results+=(--results "$OUT/gpu_check.jsonl")
rc=0
"$PY" "$ROOT/scripts/gpu_check.py" "${results[@]}" "$@" || rc=$?
du -sh "$CACHE" 2>/dev/null | sed 's/^/gpu_check: cache /' || true
exit "$rc"
