#!/usr/bin/env bash
# GPU evidence for the recipe in one device call, on one GPU whose Python (PYTHON, default
# python3) already has torch (>= 2.11), Triton and numpy but maybe not torchtitan or FLA:
#   WHEEL_DIR=.whl ./scripts/gpu_check.sh --all        (the one call: docs/gpu.md gives its
#                                                       timeout; --device cpu: the dry run)
#   ./scripts/gpu_check.sh --part NAME [...]           (one part again, e.g. timing)
# 1. Installs, with no network, the wheels listed in WHEEL_DIR/gpu_wheels.txt (fill WHEEL_DIR,
#    default .whl beside the repo root, with scripts/gpu_wheels.sh on a machine with network)
#    into SITE (default .gpu_site, git-ignored), when WHEEL_DIR is set or the imports of the CUDA
#    path fail (a later call on the same machine finds them installed); a missing import after
#    that is one line naming it (exit 2).
# 2. Keeps Triton's and inductor's caches in GPU_CACHE (default .gpu_cache, git-ignored), so a
#    later call on the same machine reuses compiled kernels.
# 3. Runs scripts/gpu_check.py: every part appends JSON lines to GPU_CACHE/gpu_check.jsonl and,
#    when OUT is set (the device tool's output folder), to OUT/gpu_check.jsonl, as it finishes.
#    With --all the parts share one deadline: GPU_CHECK_BUDGET seconds (default 480) from this
#    script's start, wheels included, so the call ends within BUDGET + about 20 s.
# Exit status: 0 when every part passed, 1 when one failed, 2 when the setup failed.
set -euo pipefail
STARTED_AT="$(date +%s.%N)"
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
"$PY" "$ROOT/scripts/gpu_check.py" "${results[@]}" --started-at "$STARTED_AT" \
  --budget "${GPU_CHECK_BUDGET:-480}" "$@" || rc=$?
du -sh "$CACHE" 2>/dev/null | sed 's/^/gpu_check: cache /' || true
exit "$rc"
