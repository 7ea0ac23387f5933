#!/usr/bin/env bash
# Sets up the environment and runs the test suite (the tier CI runs, under 20 minutes on 2 cores).
#   bash tests/run.sh            the CI tier: tests/unit and tests/multiprocess (every test not marked slow)
#   bash tests/run.sh --slow     the slow tier: tests/slow (marked slow by tests/conftest.py; minutes each; not in CI)
#   bash tests/run.sh --vllm     the vLLM tier: tests/vllm in .venv-vllm, vLLM's CPU build (in CI after the CI tier)
#   bash tests/run.sh --vllm --slow   the vLLM tier's slow tests (not in CI)
# Extra arguments go to pytest (a path among them narrows the run, e.g. tests/unit).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
if [ "${1:-}" = "--vllm" ]; then
    shift
    bash tools/setup_env.sh --vllm test
    if [ "${1:-}" = "--slow" ]; then
        shift
        exec .venv-vllm/bin/python -m pytest -m "vllm and slow" tests/vllm "$@"
    fi
    exec .venv-vllm/bin/python -m pytest -m "vllm and not slow" tests/vllm "$@"
fi
bash tools/setup_env.sh test
if [ "${1:-}" = "--slow" ]; then
    shift
    exec .venv/bin/python -m pytest -m "slow and not vllm" "$@"
fi
exec .venv/bin/python -m pytest -m "not slow and not vllm" "$@"
