# Sourced by train.sh and test.sh: create or reuse .venv in the repo root with the pinned
# dependencies from pyproject.toml. Reinstalls only when pyproject.toml changed (stamp file).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null 2>&1 || PY=python3
if [ ! -x "$VENV/bin/python" ]; then
  echo "[env] creating $VENV with $($PY --version)" >&2
  "$PY" -m venv "$VENV"
fi
STAMP="$VENV/.torchtitan_cp.stamp"
WANT="$(sha256sum "$ROOT/pyproject.toml" | cut -d' ' -f1)"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ] \
   || ! "$VENV/bin/python" -c "import importlib.util as u, sys; sys.exit(not all(u.find_spec(m) for m in ('torchtitan_cp', 'torch', 'torchtitan')))" >/dev/null 2>&1; then
  echo "[env] installing pinned dependencies (torch 2.14.1, torchtitan 0.3.0, fla-core 0.6.0)" >&2
  "$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null
  "$VENV/bin/python" -m pip install -q -e "$ROOT[dev]"
  # A new file, renamed into place: a venv copied with hard links shares the old one.
  echo "$WANT" > "$STAMP.tmp" && mv "$STAMP.tmp" "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
