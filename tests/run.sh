#!/usr/bin/env bash
# Sets up the environment and runs the test suite (the tier CI runs, under 20 minutes on 2 cores).
#   bash tests/run.sh            the CI tier
#   bash tests/run.sh --slow     only the tests marked slow (minutes each; not in CI)
# Extra arguments go to pytest.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$repo/tools/setup_env.sh" test
cd "$repo"
if [ "${1:-}" = "--slow" ]; then
    shift
    exec .venv/bin/python -m pytest -m slow "$@"
fi
exec .venv/bin/python -m pytest -m "not slow" "$@"
