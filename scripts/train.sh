#!/usr/bin/env bash
# Launch training: ./scripts/train.sh [CONFIG.toml] [--section.key value ...]
# Environment: NPROC or NPROC_PER_NODE (processes per node; default: GPUs, or 2 on CPU),
# LOG_RANK (console rank, default 0). CPU-only machines use gloo; with GPUs, one process per GPU
# on NCCL.
# Multi-node (docs/multinode.md): run the same command on every node with NNODES (machines),
# NODE_RANK (this one, 0..NNODES-1) and the rendezvous endpoint of node 0, RDZV_ENDPOINT=host:port
# (or MASTER_ADDR and MASTER_PORT, default port 29500). Node NODE_RANK runs global ranks
# NODE_RANK*NPROC .. NODE_RANK*NPROC+NPROC-1. RDZV_TIMEOUT (seconds, default 300) bounds the wait
# for the other nodes; a waiting node prints a line every 10 s.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
cd "$ROOT"
CONFIG="configs/debug_cpu.toml"
# The first argument is the config file unless it is an option (a file of any name).
if [ $# -gt 0 ] && [[ "$1" != -* ]]; then CONFIG="$1"; shift; fi
for arg in "$@"; do
  if [ "$arg" == "--help" ] || [ "$arg" == "-h" ]; then
    exec python -m torchtitan_cp.train --config_file "$CONFIG" "$@"
  fi
done
die() { echo "train.sh: error: $*" >&2; exit 2; }
# The launch geometry, checked before any Python starts: one line and exit 2 when it is wrong.
NNODES="${NNODES:-1}"
[[ "$NNODES" =~ ^[1-9][0-9]*$ ]] \
  || die "NNODES must be a whole number >= 1 (machines in the run), got '$NNODES'"
if [ -n "${NPROC_PER_NODE:-}" ]; then
  [ -z "${NPROC:-}" ] || [ "$NPROC" == "$NPROC_PER_NODE" ] \
    || die "NPROC=$NPROC and NPROC_PER_NODE=$NPROC_PER_NODE disagree; set one of them"
  NPROC="$NPROC_PER_NODE"
fi
if [ "$NNODES" -gt 1 ]; then
  [ -n "${NODE_RANK:-}" ] \
    || die "NNODES=$NNODES needs NODE_RANK, this machine's number (0..$((NNODES - 1)))"
  [[ "$NODE_RANK" =~ ^[0-9]+$ ]] && [ "$NODE_RANK" -lt "$NNODES" ] \
    || die "NODE_RANK=$NODE_RANK is not a node of NNODES=$NNODES (use 0..$((NNODES - 1)))"
  ENDPOINT="${RDZV_ENDPOINT:-}"
  if [ -z "$ENDPOINT" ] && [ -n "${MASTER_ADDR:-}" ]; then
    ENDPOINT="$MASTER_ADDR:${MASTER_PORT:-29500}"
  fi
  [ -n "$ENDPOINT" ] || die "NNODES=$NNODES needs the rendezvous endpoint of node 0:" \
    "RDZV_ENDPOINT=host:port (or MASTER_ADDR and MASTER_PORT), the same on every node"
  # As torchrun reads it: a host name or IPv4 address, or an IPv6 address in brackets; a port.
  PORT="${ENDPOINT##*:}"
  { [[ "$ENDPOINT" =~ ^[A-Za-z0-9._-]+:[0-9]{1,5}$ ]] \
      || [[ "$ENDPOINT" =~ ^\[[0-9A-Fa-f:.]+\]:[0-9]{1,5}$ ]]; } \
    && [ "$((10#$PORT))" -ge 1 ] && [ "$((10#$PORT))" -le 65535 ] \
    || die "RDZV_ENDPOINT=$ENDPOINT must be host:port (an IPv6 address in brackets," \
      "[::1]:29500), port 1..65535"
  # How long the nodes wait for each other at the rendezvous (torchtitan_cp.launch reads it).
  [[ "${RDZV_TIMEOUT:-300}" =~ ^[1-9][0-9]*$ ]] \
    || die "RDZV_TIMEOUT must be a whole number of seconds >= 1, got '${RDZV_TIMEOUT}'"
  # Static rendezvous: node NODE_RANK gets group rank NODE_RANK (torchrun's c10d backend would
  # number the nodes in arrival order and ignore NODE_RANK); node 0 hosts the store.
  LAUNCH=(--nnodes="$NNODES" --node-rank="$NODE_RANK" --rdzv-backend=static
          --rdzv-endpoint="$ENDPOINT")
else
  [ -z "${NODE_RANK:-}" ] || [ "$NODE_RANK" == "0" ] \
    || die "NODE_RANK=$NODE_RANK but NNODES=1; set NNODES to the number of machines"
  LAUNCH=(--standalone)
fi
# Validate the whole config for NNODES x NPROC processes in one process before torchrun starts
# any: a bad value is one line and exit 2 in seconds. It prints the per-node process count.
NPROC="$(python -m torchtitan_cp.train --check --nproc "${NPROC:-auto}" --nnodes "$NNODES" \
  --config_file "$CONFIG" "$@")" || exit $?
# Console output of local rank LOG_RANK only (torchtitan's convention); LOG_RANK=0,1 shows both.
# Lines start with the global rank ([rank5]:), so each node's console says which ranks it runs.
# torchtitan_cp.launch is torchrun (same options) that ends a rank's one-line error with that
# line and the rank's exit status (2 for configuration and data problems), not torchrun's block.
exec python -m torchtitan_cp.launch "${LAUNCH[@]}" --nproc_per_node="$NPROC" \
  --local-ranks-filter "${LOG_RANK:-0}" --log-line-prefix-template '[rank${rank}]:' \
  --role rank --tee 3 \
  -m torchtitan_cp.train --config_file "$CONFIG" "$@"
