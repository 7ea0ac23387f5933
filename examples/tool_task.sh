#!/usr/bin/env bash
# Multi-turn RL on the CPU (docs/reports/tool_use.md). TASK=multiply: 2-digit multiplication, which
# the tiny model cannot do in its head but can with a sandboxed Python tool; the tokenizer keeps the
# tool tags whole, and the SFT demonstrations call the tool in SFT_TOOL_FRAC of them (the others
# answer directly). TASK=guess: guess the number, a game of several turns without tools, with
# binary-search demonstrations. Makes the task data and tokenizer, warm-starts the model with SFT,
# trains it with multi-turn CISPO RL for every seed of SEEDS, and draws the held-out accuracy and
# the environment's counts over the steps.
# Environment variables (defaults in brackets):
#   TASK [multiply] or guess   SEEDS [0 1 2]   STEPS [30; guess 20] RL steps   SFT_TOOL_FRAC [0.5]
#   NPROC [2] processes per run
#   RUN_DIR [runs/tool_task; guess runs/guess_number] (must match the config's paths for the SFT stage)
#   REPORT [docs/reports/tool_use; guess docs/reports/guess_number] where the plot and the table go
#   EXTRA   more --set overrides for both stages
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$repo/tools/setup_env.sh" plot
cd "$repo"
TASK="${TASK:-multiply}"
SEEDS="${SEEDS:-0 1 2}"
NPROC="${NPROC:-2}"
case "$TASK" in
    multiply)
        STEPS="${STEPS:-30}" RUN_DIR="${RUN_DIR:-runs/tool_task}" REPORT="${REPORT:-docs/reports/tool_use}"
        CONFIG=examples/configs/tool_task_cpu.yaml
        data_args=(--task multiply --digits 2 --num-train 4000 --num-test 200 --sft-tool-frac "${SFT_TOOL_FRAC:-0.5}")
        symbols=(--symbols "<python>" "</python>")
        levels=(0.9 0.95 0.99) title="multi-turn CISPO with a Python tool: 2-digit multiplication" ;;
    guess)
        STEPS="${STEPS:-20}" RUN_DIR="${RUN_DIR:-runs/guess_number}" REPORT="${REPORT:-docs/reports/guess_number}"
        CONFIG=examples/configs/guess_number_cpu.yaml
        data_args=(--task guess --num-train 400 --num-test 100)
        symbols=()
        levels=(0.5 0.7 0.9) title="multi-turn CISPO: guess the number (higher / lower)" ;;
    *) echo "TASK=$TASK: give multiply or guess" >&2; exit 2 ;;
esac
py=.venv/bin/python
export PYTHONWARNINGS="ignore"
export OMP_NUM_THREADS=1

echo "== task data and tokenizer"
$py tools/make_tool_task.py --out "$RUN_DIR/data" "${data_args[@]}" --seed 0
$py tools/train_tokenizer.py --input "$RUN_DIR/data/corpus.txt" --vocab-size 512 --out "$RUN_DIR/tokenizer" \
    "${symbols[@]}"

echo "== SFT warm start (torchrun, $NPROC processes)"
rm -rf "$RUN_DIR/sft"
.venv/bin/torchrun --standalone --nproc-per-node "$NPROC" -m megacispo.sft --config "$CONFIG" ${EXTRA:-}

runs=()
for seed in $SEEDS; do
    run="$RUN_DIR/rl_seed$seed"
    rm -rf "$run"
    echo "== multi-turn CISPO RL ($TASK), seed $seed (torchrun, $NPROC processes) -> $run"
    .venv/bin/torchrun --standalone --nproc-per-node "$NPROC" -m megacispo.train --config "$CONFIG" \
        --set train.run_dir="$run" --set train.seed="$seed" --set train.steps="$STEPS" ${EXTRA:-}
    runs+=("$run")
done

mkdir -p "$REPORT"
$py tools/plot_runs.py "${runs[@]}" --out "$REPORT/accuracy.png" --table "$REPORT/table.md" \
    --levels "${levels[@]}" --title "$title"
echo "plot: $REPORT/accuracy.png, table: $REPORT/table.md"
