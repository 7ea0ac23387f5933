#!/usr/bin/env bash
# The GPU check (benchmarks/gpu_check.py) on one CUDA GPU, within a time limit: the Triton lightning
# kernel against the torch implementation (and fla when installed) and its register and spill
# counts, a training step of the small model in bf16 and FP8, the vocab-parallel loss, decode speed
# (tokens/s, kernels and host syncs per step, compiled and eager), then the driver itself (torchrun,
# NCCL, tiny model, fp32 and bf16): SFT, CISPO RL with rollouts in packed rows, the same RL step in
# padded rows and at context parallelism 2, a step with bf16 rollouts through the compiled decode
# step, the RL steps in FP8 (with transformer-engine), the multi-GPU block (TP 2 + EP 2, a rollout
# process with weight sync; with two or more GPUs visible), checkpoint save, --resume, score.
# One table, a row per check (check | case | value | bound | status | note): a row fails on a value
# over its bound, or on an error. Exit status 1 if a row failed, 2 without a CUDA GPU, 124 past the
# time limit (the check stops starting parts 20 s before it, so its table still prints).
#
#   bash benchmarks/gpu_check.sh [gpu_check.py options, e.g. --fp8-recipe delayed --skip train]
#   bash benchmarks/gpu_check.sh --device --part 1|2
#       on a lent GPU machine's image (docs/guides/launch.md): installs the wheels of .whl/
#       (bash benchmarks/gpu_bundle.sh, carried) over the image's python3 with pip --no-deps --target,
#       runs one part of the check on the image's torch and Triton, and writes under $OUT its rows as
#       they finish (rows.md), the table (table.md) and the log (log.txt)
#   bash benchmarks/gpu_check.sh --cpu [--driver-dtype float32]
#       the CPU twin: the driver stages alone, on the CPU with gloo (CI runs its fp32 half)
#
# Environment (defaults): PYTHON (.venv/bin/python if present, else python; --device: python3),
# WHEELS (.whl: --device's wheels), TIME_LIMIT_S (540: a lent GPU gives 10 minutes per call;
# --device: 400, two parts and their machine's start in a 15-minute loan), GPU (unset: the GPUs the environment shows): the GPUs the
# check may use, as CUDA_VISIBLE_DEVICES; the one-GPU checks run on the first, the multi-GPU stages
# on the first two or four (GPU=3: GPU 3 alone, those stages skipped).
set -euo pipefail

cd "$(dirname "$0")/.."
if [[ -n "${GPU:-}" ]]; then export CUDA_VISIBLE_DEVICES="$GPU"; fi
if [[ "${1:-}" == "--device" ]]; then
    shift
    wheels="${WHEELS:-.whl}"
    if ! compgen -G "$wheels/*.whl" >/dev/null; then
        echo "gpu_check --device: no wheels in $wheels/: run 'bash benchmarks/gpu_bundle.sh' on your machine" \
             "and name .whl in the device call's carry" >&2
        exit 2
    fi
    site="${TMPDIR:-/tmp}/megacispo-site"
    python3 -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
        "$wheels"/*.whl
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
    out="${OUT:-runs/gpu_check}"
    mkdir -p "$out"
    TIME_LIMIT_S="${TIME_LIMIT_S:-400}"
    timeout "$TIME_LIMIT_S" python3 benchmarks/gpu_check.py --budget-s "$((TIME_LIMIT_S - 20))" \
        --rows-file "$out/rows.md" "$@" 2> >(tee "$out/log.txt" >&2) | tee "$out/table.md"
    exit
fi
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python; fi
fi
TIME_LIMIT_S="${TIME_LIMIT_S:-540}"
exec timeout "$TIME_LIMIT_S" "$PYTHON" benchmarks/gpu_check.py --budget-s "$((TIME_LIMIT_S - 20))" "$@"
