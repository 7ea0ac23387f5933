#!/usr/bin/env bash
# Sets up the environment and runs the test suite (the tier CI runs, under 20 minutes on 2 cores).
#   bash tests/run.sh            the CI tier: tests/unit and tests/multiprocess (every test not marked slow)
#   bash tests/run.sh --slow     the slow tier: tests/slow (marked slow by tests/conftest.py; minutes each; not in CI)
# Extra arguments go to pytest (a path among them narrows the run, e.g. tests/unit).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$repo/tools/setup_env.sh" test
cd "$repo"
if [ "${1:-}" = "--slow" ]; then
    shift
    exec .venv/bin/python -m pytest -m slow "$@"
fi
exec .venv/bin/python -m pytest -m "not slow" "$@"
