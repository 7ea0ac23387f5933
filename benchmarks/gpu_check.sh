#!/usr/bin/env bash
# The GPU check (benchmarks/gpu_check.py) on one CUDA GPU, within a time limit: the Triton lightning
# kernel against the torch implementation (and fla when installed), a training step of the small
# model in bf16 and FP8, the vocab-parallel loss, then the driver itself (torchrun, NCCL, world size
# 1, tiny model, fp32 and bf16): SFT, CISPO RL with rollouts in packed rows, the same RL step in
# padded rows, the same step at context parallelism 2 on 2 GPUs (when two are visible), checkpoint
# save, --resume, score.
# Prints a table per part, one row per driver stage; exit status 1 if a check failed, 2 without a
# CUDA GPU, 124 past the time limit.
#
#   bash benchmarks/gpu_check.sh [gpu_check.py options, e.g. --fp8-recipe delayed --skip train]
#   bash benchmarks/gpu_check.sh --cpu [--driver-dtype float32]
#       the CPU twin: the driver stages alone, on the CPU with gloo (CI runs its fp32 half)
#
# Environment (defaults): PYTHON (.venv/bin/python if present, else python), TIME_LIMIT_S (780),
# GPU (unset: the GPUs the environment shows): the GPUs the check may use, as CUDA_VISIBLE_DEVICES;
# the one-GPU checks run on the first, the CP stage on the first two (GPU=3: GPU 3 alone, no CP stage).
set -euo pipefail

cd "$(dirname "$0")/.."
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python; fi
fi
if [[ -n "${GPU:-}" ]]; then export CUDA_VISIBLE_DEVICES="$GPU"; fi
exec timeout "${TIME_LIMIT_S:-780}" "$PYTHON" benchmarks/gpu_check.py "$@"
