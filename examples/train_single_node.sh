#!/usr/bin/env bash
# CISPO RL on one node: torchrun starts one process per GPU (8 x H100 / H200 by default).
#
#   bash examples/train_single_node.sh [extra arguments for the entry point, e.g. --resume]
#
# Environment variables (defaults in brackets); an empty override keeps the config's value:
#   GPUS_PER_NODE [8]             processes (one per GPU); the world size the config's layout must divide
#   CONFIG [examples/configs/single_node_8gpu.yaml]
#   MODULE [megacispo.train]      or megacispo.sft for the supervised warm start
#   TORCHRUN [torchrun]           e.g. .venv/bin/torchrun
#   TP, PP, EP, ETP, SP, CP       parallel layout overrides (SP = true | false; CP: context parallelism)
#   STEPS, LOSS, UPDATES_PER_ROLLOUT, MICRO_BATCH   RL overrides
#   RUN_DIR, CHECKPOINT_EVERY     where TensorBoard logs and checkpoints go, and how often
#   SHUTDOWN_TIMEOUT [300]        seconds torchrun lets the ranks save after SIGTERM before SIGKILL
#   LOG_DIR [runs/single_node/torchrun_logs]   per-rank stdout / stderr (LOG_DIR/<run>/attempt_0/<rank>/)
#   CONSOLE_RANKS [0]             local ranks also shown on the console
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

: "${GPUS_PER_NODE:=8}"
: "${CONFIG:=examples/configs/single_node_8gpu.yaml}"
: "${MODULE:=megacispo.train}"
: "${TORCHRUN:=torchrun}"
: "${LOG_DIR:=runs/single_node/torchrun_logs}"
: "${CONSOLE_RANKS:=0}"
source "$(dirname "${BASH_SOURCE[0]}")/entry_args.sh"
LAUNCH_ARGS=(
    --standalone --nproc-per-node "$GPUS_PER_NODE"
    --log-dir "$LOG_DIR" --redirects 3 --tee 3 --local-ranks-filter "$CONSOLE_RANKS"
)

mkdir -p "$LOG_DIR"
exec "$TORCHRUN" "${LAUNCH_ARGS[@]}" -m "$MODULE" "${ENTRY_ARGS[@]}" "$@"
