# Sourced by the launch scripts: the environment every rank needs, and the megacispo arguments
# built from the environment variables (each unset variable leaves the config's value), grouped by
# concern. Expects CONFIG to be set.
# Megatron-Core's tensor/sequence-parallel communication relies on kernels running in issue order.
export CUDA_DEVICE_MAX_CONNECTIONS=1
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-8}"
# Preemption: torchrun forwards a SIGTERM to the ranks and SIGKILLs them this many seconds later (its
# own default is 30). The ranks save within one decode step, or within the rest of the step's
# updates when they have begun, plus one save: the grace must cover that (docs/guides/long_runs.md).
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT="${SHUTDOWN_TIMEOUT:-300}"

# Model: the size and its fields come from the config.
ENTRY_ARGS=(--config "$CONFIG")
# Parallel layout.
ENTRY_ARGS+=(
    ${TP:+--set "parallel.tensor_model_parallel_size=$TP"}
    ${PP:+--set "parallel.pipeline_model_parallel_size=$PP"}
    ${EP:+--set "parallel.expert_model_parallel_size=$EP"}
    ${ETP:+--set "parallel.expert_tensor_parallel_size=$ETP"}
    ${SP:+--set "parallel.sequence_parallel=$SP"}
    ${CP:+--set "parallel.context_parallel_size=$CP"}
)
# RL recipe.
ENTRY_ARGS+=(
    ${STEPS:+--set "train.steps=$STEPS"}
    ${LOSS:+--set "rl.loss.name=$LOSS"}
    ${UPDATES_PER_ROLLOUT:+--set "rl.updates_per_rollout=$UPDATES_PER_ROLLOUT"}
    ${MICRO_BATCH:+--set "train.micro_batch_size=$MICRO_BATCH"}
)
# Logging and checkpoints.
ENTRY_ARGS+=(
    ${RUN_DIR:+--set "train.run_dir=$RUN_DIR"}
    ${CHECKPOINT_EVERY:+--set "train.checkpoint_every=$CHECKPOINT_EVERY"}
)
