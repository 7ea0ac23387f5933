#!/usr/bin/env bash
# The GPU check (benchmarks/gpu_check.py) on one CUDA GPU, within a time limit: the Triton lightning
# kernel against the torch implementation (and fla when installed), a training step of the small
# model in bf16 and FP8, the vocab-parallel loss. Prints one table; exit status 1 if a check failed,
# 2 without a CUDA GPU, 124 past the time limit.
#
#   bash benchmarks/gpu_check.sh [gpu_check.py options, e.g. --fp8-recipe delayed --skip train]
#
# Environment (defaults): PYTHON (.venv/bin/python if present, else python), GPU (0), TIME_LIMIT_S (600).
set -euo pipefail

cd "$(dirname "$0")/.."
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python; fi
fi
export CUDA_VISIBLE_DEVICES="${GPU:-0}"
exec timeout "${TIME_LIMIT_S:-600}" "$PYTHON" benchmarks/gpu_check.py "$@"
