#!/usr/bin/env bash
# The path a real checkpoint takes, end to end on the CPU with tiny stand-ins made here (nothing is
# downloaded): a random MiniMaxForCausalLM and a byte-level BPE tokenizer with a chat template in
# Hugging Face format, a math set in verl's Parquet layout; then a few CISPO steps at EP=2 starting
# from the Hugging Face directory, pass@k of the result, an export to Hugging Face, and generation from
# the export with transformers. With a real model, pass its directory with --load (and its tokenizer as
# data.tokenizer) to megacispo.train the same way. Environment variables (defaults in brackets):
#   NPROC [2]  processes;  RUN_DIR [runs/hf_round_trip]  removed and made anew on every run;
#   EXTRA      more --set overrides for training and evaluation, e.g. EXTRA="--set train.steps=5"
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$repo/tools/setup_env.sh"
cd "$repo"
NPROC="${NPROC:-2}"
RUN_DIR="${RUN_DIR:-runs/hf_round_trip}"
CONFIG=examples/configs/hf_round_trip.yaml
py=.venv/bin/python
export PYTHONWARNINGS="ignore"
export OMP_NUM_THREADS=1
paths=(
    --set "train.run_dir=$RUN_DIR" --set "train.export_hf=$RUN_DIR/export" --set "data.tokenizer=$RUN_DIR/tokenizer"
    --set "data.train_prompts=$RUN_DIR/data/train.parquet" --set "data.test_prompts=$RUN_DIR/data/test.parquet"
)
# shellcheck disable=SC2206  # EXTRA is a list of words on purpose
paths+=(${EXTRA:-})

echo "== a tiny Hugging Face model, tokenizer and Parquet math set in $RUN_DIR"
rm -rf "$RUN_DIR"
$py tools/make_tiny_hf.py tokenizer --out "$RUN_DIR/tokenizer"
$py tools/make_tiny_hf.py model --out "$RUN_DIR/hf_model" --vocab-size 512
$py tools/make_tiny_hf.py data --out "$RUN_DIR/data"

echo "== CISPO from the Hugging Face directory (torchrun, $NPROC processes, EP=2), exported to $RUN_DIR/export"
.venv/bin/torchrun --standalone --nproc-per-node "$NPROC" -m megacispo.train --config "$CONFIG" \
    --load "$RUN_DIR/hf_model" "${paths[@]}"

echo "== pass@k of the export"
.venv/bin/torchrun --standalone --nproc-per-node "$NPROC" -m megacispo.eval --config "$CONFIG" \
    --load "$RUN_DIR/export" "${paths[@]}"

echo "== transformers generates from the export"
$py - "$RUN_DIR/export" <<'PY'
import sys

import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

# The lightning layers' decay rates are computed from config.json, not stored: the load report would
# list them as missing.
transformers.logging.set_verbosity_error()
export = sys.argv[1]
tokenizer = AutoTokenizer.from_pretrained(export)
model = AutoModelForCausalLM.from_pretrained(export).eval()
messages = [{"role": "user", "content": "What is 12 + 7? Put the answer in \\boxed{}."}]
inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True, return_tensors="pt")
output = model.generate(**inputs, max_new_tokens=12, do_sample=False)
print("response:", repr(tokenizer.decode(output[0, inputs["input_ids"].shape[1]:])))
PY
