#!/usr/bin/env bash
# Launch training: ./scripts/train.sh [configs/NAME.toml] [--section.key value ...]
# Environment: NPROC (processes; default: GPUs or 2 on CPU), LOG_RANK (console rank, default 0).
# CPU-only machines use gloo with 2 processes; with GPUs, one process per GPU on NCCL.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
cd "$ROOT"
CONFIG="configs/debug_cpu.toml"
# The first argument is the config file unless it is an option (a file of any name).
if [ $# -gt 0 ] && [[ "$1" != -* ]]; then CONFIG="$1"; shift; fi
# Validate the whole config for NPROC processes in one process before torchrun starts any: a bad
# value is one line and exit 2 in seconds. It prints the process count (NPROC or auto-detected).
for arg in "$@"; do
  if [ "$arg" == "--help" ] || [ "$arg" == "-h" ]; then
    exec python -m torchtitan_cp.train --config_file "$CONFIG" "$@"
  fi
done
NPROC="$(python -m torchtitan_cp.train --check --nproc "${NPROC:-auto}" --config_file "$CONFIG" "$@")" \
  || exit $?
# Console output of rank LOG_RANK only (torchtitan's convention); LOG_RANK=0,1 shows both.
# torchtitan_cp.launch is torchrun (same options) that ends a rank's one-line error with that
# line and the rank's exit status (2 for configuration and data problems), not torchrun's block.
exec python -m torchtitan_cp.launch --standalone --nproc_per_node="$NPROC" \
  --local-ranks-filter "${LOG_RANK:-0}" --role rank --tee 3 \
  -m torchtitan_cp.train --config_file "$CONFIG" "$@"
