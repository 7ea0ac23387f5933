#!/usr/bin/env bash
# CISPO's IS-weight cap, fixed or adapted (rl.adaptive_clip), on both comparison tasks
# (docs/reports/cispo_vs_baselines.md, "Adaptive clipping"): examples/compare_losses.sh with these arms
# at 4 and 16 updates per rollout, 3 seeds each. The plots and table go to the report's folder,
# docs/reports/cispo_vs_baselines/adaptive_<task>, or with RUN_DIR set to <run dir>/adaptive_clip. The fork
# task runs first, then addition. Each task's SFT start, data and plain `cispo` runs (the cap of 5)
# are those of its loss comparison: finished runs are kept, so after `TASK=fork bash
# examples/compare_losses.sh` and `bash examples/compare_losses.sh` only the new arms train.
# The variables of examples/compare_losses.sh apply (SEEDS, JOBS, STEPS, ...), but for ARMS,
# UPDATES [4 16] and REPORT; TASKS [fork addition] picks the tasks (RUN_DIR, when set, serves
# every task of TASKS: set it with one task only).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cap() {  # a fixed cap 1 + eps_high on the IS weight
    echo "cispo_cap$1:rl.loss.name=cispo,rl.loss.params.eps_high=$2"
}
target() {  # eps_high adapted after every optimizer step so that this fraction of tokens is capped
    echo "cispo_target$1:rl.loss.name=cispo,rl.adaptive_clip.target_capped_frac=$1"
}
ARMS="$(cap 1.2 0.2) $(cap 2 1.0) cispo $(cap 8 7.0) $(target 0.001) $(target 0.01)"
export ARMS UPDATES="${UPDATES:-4 16}"
for task in ${TASKS:-fork addition}; do
    case "$task" in
        fork) run_dir="${RUN_DIR:-runs/compare_fork}" ;;
        addition) run_dir="${RUN_DIR:-runs/compare}" ;;
        *) echo "TASKS holds $task: use fork and/or addition" >&2; exit 2 ;;
    esac
    report="$run_dir/adaptive_clip"
    [ -n "${RUN_DIR:-}" ] || report="docs/reports/cispo_vs_baselines/adaptive_$task"  # the report's runs
    echo "=== $task"
    TASK="$task" RUN_DIR="$run_dir" REPORT="$report" bash "$repo/examples/compare_losses.sh"
done
