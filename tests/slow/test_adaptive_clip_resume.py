"""rl.adaptive_clip across a change of loss (DP = 2): an adapted cispo run resumed as grpo starts grpo's
eps from its configured 0.2, not from cispo's saved eps_high (the rules: tests/multiprocess/test_adaptive_clip.py)."""

from __future__ import annotations

import json

import pytest

from megacispo.testing.harness import run_distributed
from megacispo.testing.rl_runs import run_overrides, run_train

ADAPTIVE = ["--set", "rl.adaptive_clip.target_capped_frac=0.01", "--set", "rl.adaptive_clip.rate=0.05"]


def test_bounds_of_another_loss_are_not_restored(task_files, tmp_path):
    run_distributed(run_train, 2, run_overrides(task_files, tmp_path, steps=1) + ADAPTIVE, timeout_s=600)
    as_grpo = ["--set", "rl.loss.name=grpo", "--set", "rl.loss.params={}", "--resume"]
    run_distributed(run_train, 2, run_overrides(task_files, tmp_path, steps=2) + ADAPTIVE + as_grpo, timeout_s=600)

    def saved(step: int) -> dict:
        meta = tmp_path / "checkpoints" / f"step_{step:08d}" / "meta.json"
        return json.loads(meta.read_text())["extra_state"]["adaptive_clip"]

    assert saved(1)["loss"] == "cispo" and set(saved(1)["bounds"]) == {"eps_high"}
    # rl.updates_per_rollout = 4 controller steps from the configured 0.2 (cispo's started from 0.02).
    assert saved(2)["loss"] == "grpo"
    assert saved(2)["bounds"]["eps"] in [pytest.approx(0.2 * 1.05**k) for k in range(-4, 5)]
