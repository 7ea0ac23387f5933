#!/usr/bin/env bash
# The train/inference gap of MoE RL on the CPU (docs/reports/train_inference_mismatch.md): the quick start's
# tiny hybrid MoE model, from its SFT checkpoint, trained with bfloat16 rollouts (fp32 training) in
# four arms, each for every seed of SEEDS:
#   bf16_head     model.fp32_lm_head=false: the LM head in bf16 in the rollout
#   fp32_head     the LM head in fp32 on both sides (MiniMax-M1's fix)
#   fp32_head_r3  fp32 head + routing replay (rl.routing_replay=true)
#   fp32_head_tis fp32 head + truncated importance sampling (rl.rollout_correction.mode=tis)
# Per step every run logs mismatch/train_rollout_prob_corr, mismatch/k3_kl,
# mismatch/router_disagreement, the reward and (every EVAL_EVERY steps) the held-out accuracy; then
# tools/plot_runs.py's plot (with the mismatch panels) goes to REPORT/mismatch.png and a table of
# every run to REPORT/table.md. Every RL run is one process; JOBS of them run at once.
# Environment variables (defaults in brackets):
#   SEEDS [0 1 2]  JOBS [2]  STEPS [20] RL steps per run  EVAL_EVERY [5]
#   LR [1e-4], PROMPTS [64] prompts per rollout batch, GROUP [8] samples per prompt, UPDATES [4] optimizer
#   steps per batch: the quick start's RL batches (examples/configs/quickstart_cpu.yaml), on one process
#   SOURCE [runs/quickstart] the quick start's directory: its data, tokenizer and SFT checkpoint are
#     used; missing ones are made there as the quick start makes them, with SFT_STEPS [300] SFT steps
#     (the quick start runs 1000) to keep the set-up short
#   RUN_DIR [runs/mismatch]   SETUP [1] (0 skips tools/setup_env.sh)
#   REPORT where the plot and the table go [with RUN_DIR unset: the report's own runs, so the report's
#     folder, docs/reports/train_inference_mismatch; with RUN_DIR set: RUN_DIR]
# A run directory holding a finished run of STEPS steps is kept (delete it to rerun that run).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ "${SETUP:-1}" = 1 ]; then
    bash "$repo/tools/setup_env.sh" plot
fi
cd "$repo"
SEEDS="${SEEDS:-0 1 2}"
JOBS="${JOBS:-2}"
STEPS="${STEPS:-20}"
EVAL_EVERY="${EVAL_EVERY:-5}"
LR="${LR:-1e-4}"
PROMPTS="${PROMPTS:-64}"
GROUP="${GROUP:-8}"
UPDATES="${UPDATES:-4}"
SOURCE="${SOURCE:-runs/quickstart}"
# Runs in the default RUN_DIR are the report's: the plot goes where the report shows it.
[ -n "${RUN_DIR:-}" ] || : "${REPORT:=docs/reports/train_inference_mismatch}"
RUN_DIR="${RUN_DIR:-runs/mismatch}"
REPORT="${REPORT:-$RUN_DIR}"
CONFIG=examples/configs/compare_losses_cpu.yaml
py=.venv/bin/python
export PYTHONWARNINGS="ignore"
export OMP_NUM_THREADS=1
if (( PROMPTS * GROUP % UPDATES )); then
    echo "UPDATES=$UPDATES does not divide the rollout batch PROMPTS*GROUP = $(( PROMPTS * GROUP )): choose a divisor" >&2
    exit 2
fi
if ! $py -c "import matplotlib" 2>/dev/null; then
    echo "the plot needs matplotlib: bash tools/setup_env.sh plot (or .venv/bin/pip install matplotlib)" >&2
    exit 1
fi

paths=(
    --set "data.train_prompts=$SOURCE/data/train.jsonl" --set "data.test_prompts=$SOURCE/data/test.jsonl"
    --set "data.sft_pairs=$SOURCE/data/sft.jsonl" --set "data.tokenizer=$SOURCE/tokenizer/tokenizer.model"
    --set "sft.out=$SOURCE/sft" --set "train.load=$SOURCE/sft/checkpoints"
)
mkdir -p "$RUN_DIR/logs"
if [ ! -f "$SOURCE/data/test.jsonl" ] || [ ! -f "$SOURCE/tokenizer/tokenizer.model" ]; then
    echo "== the quick start's task data and tokenizer in $SOURCE"
    $py tools/make_task_data.py --out "$SOURCE/data" --task addition --digits 2 --num-train 4000 --num-test 200 \
        --seed 0 --sft-restate 0.6
    $py tools/train_tokenizer.py --input "$SOURCE/data/corpus.txt" --vocab-size 512 --out "$SOURCE/tokenizer"
fi
if [ ! -d "$SOURCE/sft/checkpoints" ]; then
    echo "== shortened SFT warm start: ${SFT_STEPS:-300} steps (2 processes, EP=2; log: $RUN_DIR/logs/sft.log)"
    .venv/bin/torchrun --standalone --nproc-per-node 2 -m megacispo.sft --config examples/configs/quickstart_cpu.yaml \
        "${paths[@]}" --set "sft.steps=${SFT_STEPS:-300}" >"$RUN_DIR/logs/sft.log" 2>&1 \
        || { tail -n 30 "$RUN_DIR/logs/sft.log"; exit 1; }
fi

common=(
    "${paths[@]}" --set rollout.dtype=bfloat16
    --set "rollout.prompts_per_step=$PROMPTS" --set "rollout.group_size=$GROUP"
    --set "rl.updates_per_rollout=$UPDATES" --set "train.micro_batch_size=$(( PROMPTS * GROUP / UPDATES ))"
    --set "optimizer.lr=$LR" --set "optimizer.min_lr=$LR"
    --set "train.steps=$STEPS" --set "train.eval_every=$EVAL_EVERY"
)
declare -A ARMS=(
    [bf16_head]="--set model.fp32_lm_head=false"
    [fp32_head]="--set model.fp32_lm_head=true"
    [fp32_head_r3]="--set model.fp32_lm_head=true --set rl.routing_replay=true"
    [fp32_head_tis]="--set model.fp32_lm_head=true --set rl.rollout_correction.mode=tis"
)
ARM_ORDER=(bf16_head fp32_head fp32_head_r3 fp32_head_tis)

rl_run() {
    local arm="$1" seed="$2"
    local name="${arm}_seed${seed}"
    local log="$RUN_DIR/logs/$name.log"
    # shellcheck disable=SC2086  # an arm's overrides are a list of words on purpose
    if $py -m megacispo.train --config "$CONFIG" "${common[@]}" ${ARMS[$arm]} --set "train.seed=$seed" \
        --set "train.run_dir=$RUN_DIR/$name" >"$log" 2>&1; then
        echo "   done $name: $(grep 'held-out accuracy' "$log" || echo 'see its log')"
    else
        echo "   FAILED $name (log: $log):"
        tail -n 20 "$log"
        return 1
    fi
}

echo "== RL runs: arms [${ARM_ORDER[*]}] x seeds [$SEEDS], $JOBS at once, $STEPS steps each (logs: $RUN_DIR/logs)"
source "$repo/examples/rl_queue.sh"
run_dirs=()
for seed in $SEEDS; do
    for arm in "${ARM_ORDER[@]}"; do
        name="${arm}_seed${seed}"
        run_dirs+=("$RUN_DIR/$name")
        queue_run "$name" rl_run "$arm" "$seed"
    done
done
wait_runs || exit 1

echo "== plot and table"
# tools/plot_runs.py's reading, grouping and drawing, with the mismatch metrics as its extra panels,
# and a table of every run: the step means of the mismatch metrics, the last reward and accuracy.
mkdir -p "$REPORT"
$py - "$REPORT" "${run_dirs[@]}" <<'EOF'
import statistics
import sys
from pathlib import Path

sys.path.insert(0, "tools")
import plot_runs

MISMATCH = (("mismatch/train_rollout_prob_corr", "train/rollout prob. correlation"),
            ("mismatch/k3_kl", "k3 KL(rollout || train)"),
            ("mismatch/router_disagreement", "router disagreement (own top-k)"))
out_dir, run_dirs = Path(sys.argv[1]), [Path(p) for p in sys.argv[2:]]
plot_runs.OPTIONAL_PANELS = MISMATCH
required = [tag for tag, _ in (*plot_runs.REQUIRED_PANELS, *MISMATCH)]
runs = {path: plot_runs.load_run(path, required) for path in run_dirs}
groups = plot_runs.group_runs(run_dirs)
plot_runs.plot_runs({group: [runs[p] for p in paths] for group, paths in groups.items()}, out_dir / "mismatch.png",
                    "bf16 rollouts, fp32 training: mean over seeds, band: min to max")
lines = ["| run | correlation (mean) | k3 KL (mean) | router disagreement (mean) | reward (last) | "
         "held-out accuracy (first -> last) |", "|---|---|---|---|---|---|"]
for path, run in runs.items():
    def mean(tag):
        return statistics.fmean(value for _, value in run[tag])
    accuracy = run["eval/accuracy"]
    lines.append(f"| {path.name} | {mean(MISMATCH[0][0]):.5f} | {mean(MISMATCH[1][0]):.2e} | "
                 f"{mean(MISMATCH[2][0]):.4f} | {run['rollout/reward_mean'][-1][1]:.3f} | "
                 f"{accuracy[0][1]:.3f} -> {accuracy[-1][1]:.3f} |")
(out_dir / "table.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
EOF
echo "plot: $REPORT/mismatch.png  table: $REPORT/table.md  total: $SECONDS s"
