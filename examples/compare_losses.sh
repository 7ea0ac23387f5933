#!/usr/bin/env bash
# CISPO against its baselines on the CPU (docs/cispo_vs_baselines.md): the same task, model, data,
# SFT warm start and seeds, trained with each loss of LOSSES for every seed of SEEDS, each loss with
# its registry (paper) parameters; then tools/plot_runs.py draws RUN_DIR/compare.png and writes the
# steps-to-accuracy table to RUN_DIR/table.md. Every RL run is one process; JOBS of them run at once.
# Environment variables (defaults in brackets):
#   LOSSES [cispo dapo grpo reinforce]   SEEDS [0 1 2]   JOBS [2] runs at once
#   STEPS [40] RL steps per run          LR [5e-5] RL learning rate (constant after warm-up)
#   PROMPTS [32] prompts per rollout batch, GROUP [8] samples per prompt, UPDATES [16] optimizer
#   steps per rollout batch (each on PROMPTS*GROUP/UPDATES samples; M1 used 16)
#   SFT_STEPS [700] steps of the shared warm start, of a 1000-step cosine   EVAL_EVERY [4] steps between evaluations
#   NUM_TRAIN [4000] NUM_TEST [200] task problems    LEVELS [0.5 0.6 0.65] accuracies for the table
#   RUN_DIR [runs/compare] (relative to the repository)   SETUP [1] (0 skips tools/setup_env.sh: the environment is already there)
#   EXTRA   more --set overrides for the SFT and every RL run, e.g. EXTRA="--set rollout.temperature=0.8"
# A run directory holding a finished run of STEPS steps is kept (delete it to rerun that run), an
# unfinished one is started over; the data, tokenizer and SFT checkpoint are made only if missing.
# Use a new RUN_DIR for new settings.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ "${SETUP:-1}" = 1 ]; then
    # The plot extra installs matplotlib, which tools/plot_runs.py needs.
    bash "$repo/tools/setup_env.sh" plot
fi
cd "$repo"
LOSSES="${LOSSES:-cispo dapo grpo reinforce}"
SEEDS="${SEEDS:-0 1 2}"
JOBS="${JOBS:-2}"
STEPS="${STEPS:-40}"
LR="${LR:-5e-5}"
PROMPTS="${PROMPTS:-32}"
GROUP="${GROUP:-8}"
UPDATES="${UPDATES:-16}"
EVAL_EVERY="${EVAL_EVERY:-4}"
NUM_TRAIN="${NUM_TRAIN:-4000}"
NUM_TEST="${NUM_TEST:-200}"
LEVELS="${LEVELS:-0.5 0.6 0.65}"
RUN_DIR="${RUN_DIR:-runs/compare}"
CONFIG=examples/configs/compare_losses_cpu.yaml
if (( PROMPTS * GROUP % UPDATES )); then
    echo "UPDATES=$UPDATES does not divide the rollout batch PROMPTS*GROUP = $(( PROMPTS * GROUP )): choose a divisor" >&2
    exit 2
fi
py=.venv/bin/python
export PYTHONWARNINGS="ignore"
# One thread per process: JOBS runs share the cores instead of oversubscribing them.
export OMP_NUM_THREADS=1

# Every stage sees the same paths and data; each RL run adds the RL knobs, its loss, seed and run directory.
paths=(
    --set "data.train_prompts=$RUN_DIR/data/train.jsonl" --set "data.test_prompts=$RUN_DIR/data/test.jsonl"
    --set "data.sft_pairs=$RUN_DIR/data/sft.jsonl" --set "data.tokenizer=$RUN_DIR/tokenizer/tokenizer.model"
    --set "sft.out=$RUN_DIR/sft" --set "train.load=$RUN_DIR/sft/checkpoints"
)
# shellcheck disable=SC2206  # EXTRA is a list of words on purpose
paths+=(${EXTRA:-})
common=(
    "${paths[@]}"
    --set "rollout.prompts_per_step=$PROMPTS" --set "rollout.group_size=$GROUP"
    --set "rl.updates_per_rollout=$UPDATES" --set "train.micro_batch_size=$(( PROMPTS * GROUP / UPDATES ))"
    --set "optimizer.lr=$LR" --set "optimizer.min_lr=$LR"
    --set "train.steps=$STEPS" --set "train.eval_every=$EVAL_EVERY"
)

# Fail now, not after the runs, if the plot cannot be drawn.
if ! $py -c "import matplotlib" 2>/dev/null; then
    echo "tools/plot_runs.py needs matplotlib: bash tools/setup_env.sh plot (or .venv/bin/pip install matplotlib)" >&2
    exit 1
fi
mkdir -p "$RUN_DIR/logs"
if [ ! -f "$RUN_DIR/data/test.jsonl" ] || [ ! -f "$RUN_DIR/tokenizer/tokenizer.model" ]; then
    echo "== task data and tokenizer"
    $py tools/make_task_data.py --out "$RUN_DIR/data" --task addition --digits 2 --num-train "$NUM_TRAIN" \
        --num-test "$NUM_TEST" --seed 0
    $py tools/train_tokenizer.py --input "$RUN_DIR/data/corpus.txt" --vocab-size 512 --out "$RUN_DIR/tokenizer"
fi
if [ ! -d "$RUN_DIR/sft/checkpoints" ]; then
    echo "== shared SFT warm start (2 processes, EP=2; log: $RUN_DIR/logs/sft.log)"
    # The quick start's config and layout on exact answers, stopped part-way down the schedule: a
    # partly trained model (held-out accuracy about 0.4 at 700 steps) whose checkpoint reshards to
    # one process. SFT is chaotic around its jump in accuracy: the stop step sets the start.
    .venv/bin/torchrun --standalone --nproc-per-node 2 -m megacispo.sft --config examples/configs/quickstart_cpu.yaml \
        "${paths[@]}" --set "sft.steps=${SFT_STEPS:-700}" --set sft.decay_steps=1000 \
        >"$RUN_DIR/logs/sft.log" 2>&1 || { tail -n 30 "$RUN_DIR/logs/sft.log"; exit 1; }
fi

# One RL run; its output goes to its log file, and a failure prints the log's tail.
rl_run() {
    local loss="$1" seed="$2"
    local name="${loss}_seed${seed}"
    local log="$RUN_DIR/logs/$name.log"
    if $py -m megacispo.train --config "$CONFIG" "${common[@]}" --set "rl.loss.name=$loss" \
        --set "train.seed=$seed" --set "train.run_dir=$RUN_DIR/$name" >"$log" 2>&1; then
        echo "   done $name: $(grep 'held-out accuracy' "$log" || echo 'see its log')"
    else
        echo "   FAILED $name (log: $log):"
        tail -n 20 "$log"
        return 1
    fi
}

echo "== RL runs: losses [$LOSSES] x seeds [$SEEDS], $JOBS at once, $STEPS steps each (logs: $RUN_DIR/logs)"
run_dirs=()
pids=()
failed=0
start=$SECONDS
for loss in $LOSSES; do
    for seed in $SEEDS; do
        name="${loss}_seed${seed}"
        run_dirs+=("$RUN_DIR/$name")
        if [ -d "$RUN_DIR/$name/checkpoints/step_$(printf '%08d' "$STEPS")" ]; then
            echo "   kept $name (finished earlier)"
            continue
        fi
        # Events of an interrupted attempt would mix with the new run's.
        rm -rf "${RUN_DIR:?}/$name"
        # Wait for a free slot: reap the oldest running job before starting another.
        while [ "${#pids[@]}" -ge "$JOBS" ]; do
            wait "${pids[0]}" || failed=1
            pids=("${pids[@]:1}")
        done
        echo "   start $name"
        rl_run "$loss" "$seed" &
        pids+=("$!")
    done
done
for pid in "${pids[@]}"; do
    wait "$pid" || failed=1
done
echo "   RL runs took $(( SECONDS - start )) s"
if [ "$failed" != 0 ]; then
    echo "some RL runs failed (logs above); no plot" >&2
    exit 1
fi

echo "== plot and table"
# shellcheck disable=SC2086  # LEVELS is a list of numbers
$py tools/plot_runs.py "${run_dirs[@]}" --out "$RUN_DIR/compare.png" --table "$RUN_DIR/table.md" \
    --levels $LEVELS --reference cispo
echo "total: $SECONDS s"
