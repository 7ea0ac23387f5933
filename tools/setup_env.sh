#!/usr/bin/env bash
# Creates (once) the project's virtual environment in .venv and installs megacispo into it, editable,
# with the test extra. Sourced by examples/quickstart.sh and tests/run.sh; safe to run again.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-python3}"
if [ ! -x "$repo/.venv/bin/python" ]; then
    "$python" -m venv "$repo/.venv"
fi
# torch is pinned to 2.13.0 in setup.py: that CPU build is what CI machines hold locally.
"$repo/.venv/bin/python" -m pip install --quiet --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
"$repo/.venv/bin/python" -m pip install --quiet -e "$repo[test]" 2>&1 | grep -v "^WARNING: Location" || true
"$repo/.venv/bin/python" -c "import megacispo, megatron.core, torch; print(f'megacispo environment ready: torch {torch.__version__}')"
