"""rl.adaptive_clip in a 3-step RL run (DP = 2): the bound moves, is saved and resumes exactly."""

from __future__ import annotations

import json
import shutil

from megacispo.testing.harness import run_distributed
from megacispo.testing.rl_runs import run_overrides, run_train


def test_three_step_run_moves_saves_and_resumes_the_bound(task_files, tmp_path):
    """A 3-step run (DP = 2) logs a changing loss/eps_high_current and saves the bounds in every
    checkpoint; resumed from step 2 (checkpoint 3 removed), step 3 saves the very same bounds. Slow: two
    2-process RL runs, about a minute on 2 cores."""
    from megacispo.metrics.logger import read_scalars

    adaptive = ["--set", "rl.adaptive_clip.target_capped_frac=0.01"]
    run_distributed(run_train, 2, run_overrides(task_files, tmp_path, steps=3) + adaptive, timeout_s=600)
    logged = [value for _, value in read_scalars(str(tmp_path))["loss/eps_high_current"]]
    assert len(logged) == 3 and len(set(logged)) == 3, logged
    checkpoints = tmp_path / "checkpoints"

    def saved(step: int) -> dict[str, float]:
        return json.loads((checkpoints / f"step_{step:08d}" / "meta.json").read_text())["extra_state"]["adaptive_clip"]

    final = saved(3)
    assert saved(2) != final
    shutil.rmtree(checkpoints / "step_00000003")
    run_distributed(run_train, 2, run_overrides(task_files, tmp_path, steps=3) + adaptive + ["--resume"], timeout_s=600)
    assert saved(3) == final
