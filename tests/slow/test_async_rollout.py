"""Rollouts on processes of their own (megacispo.rollout.remote) across a restart: a resumed run sends
the checkpoint's weights first, and SIGTERM stops both sides after the step in flight."""

from __future__ import annotations

from megacispo.testing.harness import run_distributed
from megacispo.testing.rl_runs import PLACED, run_overrides, run_train, train_until_sigterm


# 15-40 s (two placed runs, on a quiet or a loaded machine)
def test_resume_sends_the_checkpoints_weights_first(task_files, tmp_path):
    """Resumed after step 2, the rollout process generates step 3's round with the weights of step 2
    (staleness 0: the round in flight at the checkpoint is asked for again), not with its fresh weights."""
    from megacispo.metrics.logger import read_scalars

    off_policy = PLACED + ["--set", "rollout.max_staleness=1"]
    run_distributed(run_train, 2, run_overrides(task_files, tmp_path, steps=2) + off_policy, timeout_s=600)
    run_distributed(run_train, 2, run_overrides(task_files, tmp_path, steps=3) + off_policy + ["--resume"],
                    timeout_s=600)
    staleness = dict(read_scalars(str(tmp_path))["rollout/staleness_max"])
    assert staleness[2] == 1.0 and staleness[3] == 0.0
    assert (tmp_path / "checkpoints" / "step_00000003").is_dir()


# 12-35 s under torchrun
def test_sigterm_stops_both_sides_after_the_step_in_flight(task_files, tmp_path):
    step = train_until_sigterm([*run_overrides(task_files, tmp_path, steps=1000), *PLACED, "--set",
                                "rollout.max_staleness=1", "--set", "train.checkpoint_every=0"], tmp_path / "train.log")
    assert (tmp_path / "checkpoints" / f"step_{step:08d}").is_dir()
