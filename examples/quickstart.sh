#!/usr/bin/env bash
# The CPU quick start, end to end on a fresh machine: set-up, task data, tokenizer, SFT warm start,
# then CISPO RL of the tiny hybrid MoE model with torchrun on 2 processes (EP=2), with TensorBoard
# logs and checkpoints under runs/quickstart. Environment variables (defaults in brackets):
#   NPROC [2]  processes;  RUN_DIR [runs/quickstart]  must match the config's paths;
#   EXTRA      more --set overrides for both stages, e.g. EXTRA="--set train.seed=1";
#   FAMILY [minimax-m1]  minimax-m2: the tiny MiniMax-M2, made by transformers, in runs/quickstart_m2 (the
#                        tiny-m2 shape with 32-wide heads: vLLM's CPU attention has no kernel for its 16)
#   ENGINE [megacispo]   vllm (FAMILY=minimax-m2): RL's rollouts and evaluations on vLLM's CPU build, in
#                        .venv-vllm (rollout.engine=vllm)
#   LORA [0]   a rank: RL trains LoRA adapters of that rank on the frozen SFT model (lora.rank), its
#              checkpoints the adapters alone, at optimizer.lr 1e-3 (full RL's 2e-4 is too low for them:
#              docs/reports/benchmarks.md#lora-on-the-cpu-quick-start)
# Every run starts over: the last run's checkpoints and TensorBoard logs under RUN_DIR go first, so RL
# never loads another run's (newer-stepped) SFT checkpoint and TensorBoard shows this run alone.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
NPROC="${NPROC:-2}"
FAMILY="${FAMILY:-minimax-m1}"
ENGINE="${ENGINE:-megacispo}"
LORA="${LORA:-0}"
case "$FAMILY" in
    minimax-m1) RUN_DIR="${RUN_DIR:-runs/quickstart}"; CONFIG=examples/configs/quickstart_cpu.yaml; RL_MODEL=""
                HF_HEADS="" ;;
    # SFT takes the model from the HF directory's config.json; RL loads SFT's checkpoint of that shape.
    minimax-m2) RUN_DIR="${RUN_DIR:-runs/quickstart_m2}"; CONFIG=examples/configs/quickstart_m2_cpu.yaml
                HF_HEADS="--head-dim 32"
                RL_MODEL="--set model.size=tiny-m2 --set model.head_dim=32 --set model.rotary_dim=16" ;;
    *) echo "error: FAMILY=$FAMILY: use minimax-m1 or minimax-m2" >&2; exit 2 ;;
esac
venv=.venv
case "$ENGINE" in
    megacispo) bash tools/setup_env.sh ;;
    vllm) if [ "$FAMILY" != minimax-m2 ]; then
              echo "error: ENGINE=vllm with FAMILY=$FAMILY: vLLM serves MiniMax-M2 only; set FAMILY=minimax-m2" >&2
              exit 2
          fi
          bash tools/setup_env.sh --vllm
          venv=.venv-vllm
          RL_MODEL="$RL_MODEL --set rollout.engine=vllm" ;;
    *) echo "error: ENGINE=$ENGINE: use megacispo or vllm" >&2; exit 2 ;;
esac
if [ "$LORA" != 0 ]; then
    RL_MODEL="$RL_MODEL --set lora.rank=$LORA --set optimizer.lr=1e-3"
fi
py=$venv/bin/python
export PYTHONWARNINGS="ignore"
export OMP_NUM_THREADS=1

rm -rf "$RUN_DIR/sft" "$RUN_DIR/checkpoints" "$RUN_DIR/tensorboard"
echo "== task data and tokenizer"
$py tools/make_task_data.py --out "$RUN_DIR/data" --task addition --digits 2 --num-train 4000 --num-test 200 --seed 0 \
    --sft-restate 0.6
$py tools/train_tokenizer.py --input "$RUN_DIR/data/corpus.txt" --vocab-size 512 --out "$RUN_DIR/tokenizer"
if [ "$FAMILY" = minimax-m2 ]; then
    rm -rf "$RUN_DIR/hf"
    echo "== a random tiny MiniMax-M2 made by transformers"
    $py tools/make_tiny_hf.py model --family minimax-m2 --vocab-size 512 --out "$RUN_DIR/hf" $HF_HEADS
fi

echo "== SFT warm start (torchrun, $NPROC processes)"
$venv/bin/torchrun --standalone --nproc-per-node "$NPROC" -m megacispo.sft --config "$CONFIG" ${EXTRA:-}

echo "== CISPO RL (torchrun, $NPROC processes)"
$venv/bin/torchrun --standalone --nproc-per-node "$NPROC" -m megacispo.train --config "$CONFIG" $RL_MODEL ${EXTRA:-}

echo
echo "TensorBoard logs: $RUN_DIR/tensorboard (SFT: $RUN_DIR/sft/tensorboard); checkpoints: $RUN_DIR/checkpoints"
echo "Open them with:  $venv/bin/tensorboard --logdir $RUN_DIR"
