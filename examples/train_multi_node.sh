#!/usr/bin/env bash
# CISPO RL across nodes with plain torchrun: run this script once on EVERY node, with the same
# MASTER_ADDR / MASTER_PORT / RUN_ID and its own NODE_RANK. The c10d rendezvous on MASTER_ADDR
# waits for all NNODES nodes, then assigns the ranks.
#
#   MASTER_ADDR=node001 NODE_RANK=0 bash examples/train_multi_node.sh    # on node001
#   MASTER_ADDR=node001 NODE_RANK=1 bash examples/train_multi_node.sh    # on node002, ...
#
# Environment variables (defaults in brackets); an empty override keeps the config's value:
#   NNODES [64]  NODE_RANK [0]  GPUS_PER_NODE [8]    world size = NNODES x GPUS_PER_NODE
#   MASTER_ADDR [localhost]  MASTER_PORT [29500]     the rendezvous endpoint (any one of the nodes)
#   RUN_ID [megacispo]                                rendezvous id, the same on every node
#   CONFIG [examples/configs/minimax_m1_512gpu.yaml]
#   MODULE [megacispo.train]      or megacispo.sft for the supervised warm start
#   TORCHRUN [torchrun]           e.g. .venv/bin/torchrun
#   TP, PP, EP, ETP, SP, CP       parallel layout overrides (SP = true | false; CP: context parallelism)
#   STEPS, LOSS, UPDATES_PER_ROLLOUT, MICRO_BATCH   RL overrides
#   RUN_DIR, CHECKPOINT_EVERY     where TensorBoard logs and checkpoints go, and how often
#   SHUTDOWN_TIMEOUT [300]        seconds torchrun lets the ranks save after SIGTERM before SIGKILL
#   LOG_DIR [runs/minimax_m1/torchrun_logs]   per-rank logs in LOG_DIR/node<NODE_RANK>/<run>/attempt_0/<local rank>/
#   CONSOLE_RANKS [0]             local ranks also shown on this node's console
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

: "${NNODES:=64}"
: "${NODE_RANK:=0}"
: "${GPUS_PER_NODE:=8}"
: "${MASTER_ADDR:=localhost}"
: "${MASTER_PORT:=29500}"
: "${RUN_ID:=megacispo}"
: "${CONFIG:=examples/configs/minimax_m1_512gpu.yaml}"
: "${MODULE:=megacispo.train}"
: "${TORCHRUN:=torchrun}"
: "${LOG_DIR:=runs/minimax_m1/torchrun_logs}"
: "${CONSOLE_RANKS:=0}"
source "$(dirname "${BASH_SOURCE[0]}")/entry_args.sh"
# One log directory per node: the nodes may share a file system.
node_log_dir="$LOG_DIR/node$NODE_RANK"
LAUNCH_ARGS=(
    --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "$GPUS_PER_NODE"
    --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "$RUN_ID"
    --log-dir "$node_log_dir" --redirects 3 --tee 3 --local-ranks-filter "$CONSOLE_RANKS"
)

mkdir -p "$node_log_dir"
exec "$TORCHRUN" "${LAUNCH_ARGS[@]}" -m "$MODULE" "${ENTRY_ARGS[@]}" "$@"
