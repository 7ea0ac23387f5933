#!/usr/bin/env bash
# Creates (once) the project's virtual environment in .venv and installs megacispo into it, editable.
#   bash tools/setup_env.sh          the package (what the quick start needs)
#   bash tools/setup_env.sh test     the package with the test extra (pytest, transformers, triton)
# Sourced by examples/quickstart.sh and tests/run.sh; safe to run again (pip skips what is there).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-python3}"
target="$repo"
if [ -n "${1:-}" ]; then
    target="$repo[$1]"
fi
if [ ! -x "$repo/.venv/bin/python" ]; then
    "$python" -m venv "$repo/.venv"
fi
log="$(mktemp)"
# torch is pinned to 2.13.0 in setup.py: that CPU build is what CI machines hold locally.
if ! { "$repo/.venv/bin/python" -m pip install --quiet --upgrade pip \
       && "$repo/.venv/bin/python" -m pip install --quiet -e "$target"; } >"$log" 2>&1; then
    cat "$log"
    echo "setup failed: pip could not install $target (log above)" >&2
    exit 1
fi
rm -f "$log"
# Builds the CPU kernels now (parallel/cpu/kernels.py; cached), not at the first run.
PYTHONWARNINGS=ignore "$repo/.venv/bin/python" -c "
import megacispo, megatron.core, torch
from megacispo.parallel.cpu import kernels_available
kernels = 'built' if kernels_available() else 'NOT built (needs g++ and AVX2): torch runs its own CPU kernels, slower'
print(f'megacispo environment ready: torch {torch.__version__}, CPU kernels {kernels}')"
