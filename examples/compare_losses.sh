#!/usr/bin/env bash
# CISPO against its baselines on the CPU (docs/reports/cispo_vs_baselines.md): the same task, model, data,
# SFT warm start and seeds, trained with each arm of ARMS for every seed of SEEDS and every number of
# updates per rollout of UPDATES; then tools/plot_runs.py draws the curves and the sweep over UPDATES
# and writes the steps-to-accuracy table. Every RL run is one process; JOBS of them run at once.
#
# TASK picks the task and its defaults:
#   addition  2-digit addition (the quick start's task), exact-match reward
#   fork      3-digit addition with a fork: the model answers far better when it first writes the
#             marker "~" and works the sum out column by column, which its SFT teacher did in 3% of
#             its answers (tools/arithmetic_tasks.py); numeric reward, the marker's start probability and
#             clip fractions logged (logging.metric_hooks.probe_token), and its branch accuracies measured on the
#             SFT checkpoint into RUN_DIR/branches.txt (tools/fork_branches.py)
# An arm is a loss name of the registry, run with its paper parameters (rl.loss.name=NAME), or
# NAME:KEY=VALUE,KEY=VALUE,... for any config overrides, e.g. "cispo_cap2:rl.loss.name=cispo,rl.loss.params.eps_high=1.0".
# Environment variables (defaults: addition / fork):
#   TASK [addition]   ARMS [cispo dapo grpo gspo reinforce]   SEEDS [0 1 2]   JOBS [2] runs at once
#   UPDATES [16 / 1 4 16] optimizer steps per rollout batch, each on PROMPTS*GROUP/UPDATES samples
#   STEPS [40 / 40] RL steps per run   LR [5e-5] RL learning rate (constant after warm-up)
#   PROMPTS [32 / 16] prompts per rollout batch   GROUP [8] samples per prompt
#   SFT_STEPS [800 / 1000] steps of the shared warm start, of a 1000-step cosine
#   EVAL_EVERY [4 / 4] steps between evaluations   NUM_TRAIN [4000] NUM_TEST [200] task problems
#   LEVELS [0.35 0.4 0.45 / 0.2 0.4 0.6] accuracies for the table
#   RUN_DIR [runs/compare / runs/compare_fork] (relative to the repository)
#   REPORT where the plots and the table go [with RUN_DIR unset: the report's own runs, so the report's
#   folder, docs/reports/cispo_vs_baselines/<TASK>; with RUN_DIR set: RUN_DIR]. Another directory
#   compares other arms on the same start, reusing the finished runs the two share
#   (docs/reports/cispo_vs_baselines.md, adaptive clipping)
#   SETUP [1] (0 skips tools/setup_env.sh: the environment is already there)
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
TASK="${TASK:-addition}"
# Runs in the default RUN_DIR are the report's: their figures go where the report shows them.
[ -n "${RUN_DIR:-}" ] || : "${REPORT:=docs/reports/cispo_vs_baselines/$TASK}"
case "$TASK" in
    addition)
        CONFIG=examples/configs/compare_losses_cpu.yaml
        task_args=(--digits 2)
        : "${UPDATES:=16}" "${PROMPTS:=32}" "${SFT_STEPS:=800}" "${LEVELS:=0.35 0.4 0.45}" "${RUN_DIR:=runs/compare}"
        ;;
    fork)
        CONFIG=examples/configs/compare_fork_cpu.yaml
        # 60% of the other SFT answers demonstrate the worked branch after a given marker: the model
        # learns to carry it out without learning to take it (tools/arithmetic_tasks.py).
        task_args=(--digits 3 --sft-worked 0.03 --sft-worked-demos 0.6)
        : "${UPDATES:=1 4 16}" "${PROMPTS:=16}" "${SFT_STEPS:=1000}" "${LEVELS:=0.2 0.4 0.6}" "${RUN_DIR:=runs/compare_fork}"
        ;;
    *)
        echo "TASK=$TASK is not a task: use addition or fork" >&2
        exit 2
        ;;
esac
REPORT="${REPORT:-$RUN_DIR}"
ARMS="${ARMS:-cispo dapo grpo gspo reinforce}"
SEEDS="${SEEDS:-0 1 2}"
JOBS="${JOBS:-2}"
STEPS="${STEPS:-40}"
LR="${LR:-5e-5}"
GROUP="${GROUP:-8}"
EVAL_EVERY="${EVAL_EVERY:-4}"
NUM_TRAIN="${NUM_TRAIN:-4000}"
NUM_TEST="${NUM_TEST:-200}"
for updates in $UPDATES; do
    if (( PROMPTS * GROUP % updates )); then
        echo "UPDATES=$updates does not divide the rollout batch PROMPTS*GROUP = $(( PROMPTS * GROUP )): choose divisors" >&2
        exit 2
    fi
done
py=.venv/bin/python
export PYTHONWARNINGS="ignore"
# One thread per process: JOBS runs share the cores instead of oversubscribing them.
export OMP_NUM_THREADS=1

# Every stage sees the same paths and data; each RL run adds the RL knobs, its arm, seed and run directory.
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
    echo "== task data and tokenizer ($TASK)"
    $py tools/make_task_data.py --out "$RUN_DIR/data" --task addition "${task_args[@]}" --num-train "$NUM_TRAIN" \
        --num-test "$NUM_TEST" --seed 0
    $py tools/train_tokenizer.py --input "$RUN_DIR/data/corpus.txt" --vocab-size 512 --out "$RUN_DIR/tokenizer"
fi
if [ ! -d "$RUN_DIR/sft/checkpoints" ]; then
    echo "== shared SFT warm start (2 processes, EP=2; log: $RUN_DIR/logs/sft.log)"
    # The quick start's config and layout at lr 3e-3, stopped at SFT_STEPS of a 1000-step cosine. For
    # addition (exact answers) 800 steps leave a partly trained model with room to climb; SFT is chaotic
    # around its jump in accuracy, so the stop step sets the start (docs/reports/cispo_vs_baselines.md). The
    # checkpoint reshards to the RL runs' one process.
    .venv/bin/torchrun --standalone --nproc-per-node 2 -m megacispo.sft --config examples/configs/quickstart_cpu.yaml \
        "${paths[@]}" --set "sft.steps=$SFT_STEPS" --set sft.decay_steps=1000 --set sft.lr=3e-3 \
        >"$RUN_DIR/logs/sft.log" 2>&1 || { tail -n 30 "$RUN_DIR/logs/sft.log"; exit 1; }
fi
if [ "$TASK" = fork ] && [ ! -f "$RUN_DIR/branches.txt" ]; then
    echo "== the fork on the SFT checkpoint (greedy, held-out prompts)"
    $py tools/fork_branches.py --config "$CONFIG" "${paths[@]}" >"$RUN_DIR/branches.tmp" 2>"$RUN_DIR/logs/branches.log" \
        || { tail -n 30 "$RUN_DIR/logs/branches.log"; exit 1; }
    mv "$RUN_DIR/branches.tmp" "$RUN_DIR/branches.txt"
fi
[ "$TASK" = fork ] && sed 's/^/   /' "$RUN_DIR/branches.txt"

# The --set overrides of an arm: NAME (a registry loss) or NAME:KEY=VALUE,KEY=VALUE,...
arm_overrides() {
    local arm="$1" item
    if [[ "$arm" != *:* ]]; then
        echo "--set rl.loss.name=$arm"
        return
    fi
    local IFS=,
    for item in ${arm#*:}; do
        echo "--set $item"
    done
}

# One RL run; its output goes to its log file, and a failure prints the log's tail.
rl_run() {
    local arm="$1" updates="$2" seed="$3" name="$4"
    local log="$RUN_DIR/logs/$name.log"
    local overrides
    mapfile -t overrides < <(arm_overrides "$arm")
    # shellcheck disable=SC2068  # each line is "--set KEY=VALUE": two words
    if $py -m megacispo.train --config "$CONFIG" "${common[@]}" ${overrides[@]} \
        --set "rl.updates_per_rollout=$updates" --set "train.micro_batch_size=$(( PROMPTS * GROUP / updates ))" \
        --set "train.seed=$seed" --set "train.run_dir=$RUN_DIR/$name" >"$log" 2>&1; then
        echo "   done $name: $(grep 'held-out accuracy' "$log" || echo 'see its log')"
    else
        echo "   FAILED $name (log: $log):"
        tail -n 20 "$log"
        return 1
    fi
}

echo "== RL runs: arms [$ARMS] x updates per rollout [$UPDATES] x seeds [$SEEDS], $JOBS at once, $STEPS steps each (logs: $RUN_DIR/logs)"
source "$repo/examples/rl_queue.sh"
run_dirs=()
for updates in $UPDATES; do
    for arm in $ARMS; do
        for seed in $SEEDS; do
            name="${arm%%:*}_u${updates}_seed${seed}"
            run_dirs+=("$RUN_DIR/$name")
            queue_run "$name" rl_run "$arm" "$updates" "$seed" "$name"
        done
    done
done
wait_runs || exit 1

echo "== plots and table (in $REPORT)"
mkdir -p "$REPORT"
for updates in $UPDATES; do
    # shellcheck disable=SC2207  # run directory names have no spaces
    runs=($(printf '%s\n' "${run_dirs[@]}" | grep "_u${updates}_seed"))
    $py tools/plot_runs.py "${runs[@]}" --out "$REPORT/compare_u${updates}.png" \
        --title "$TASK, $updates update(s) per rollout: mean over seeds, band: min to max" >/dev/null
done
sweep=()
[ "$(wc -w <<<"$UPDATES")" -gt 1 ] && sweep=(--sweep "$REPORT/sweep.png")
# shellcheck disable=SC2086  # LEVELS is a list of numbers
$py tools/plot_runs.py "${run_dirs[@]}" --table "$REPORT/table.md" "${sweep[@]}" --levels $LEVELS --reference cispo
echo "total: $SECONDS s"
