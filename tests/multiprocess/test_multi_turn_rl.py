"""A short multi-turn RL run: 2 processes (EP = 2, rollouts in lockstep), the built-in guess_number
environment answering every turn, with routing replay and TIS on. Every digit ends a model turn (so
the untrained model takes several turns within its 24 tokens); the environment replies "+" (higher)
or "-" (lower) until the guess is the answer. Checked: the run trains and saves, the env/* metrics are
written and show conversations of more than one turn with replies fed, and the training engine's
log-probs match the rollout's on the sampled tokens (the replies are not trained). The same run with
its rollouts on a process of their own (placement.rollout_ranks = 1)."""

from __future__ import annotations

import math

from megacispo.testing.harness import run_distributed
from megacispo.testing.rl_runs import PLACED, run_overrides, run_train

ENV = {
    "env.name": "guess_number", "env.params": '{higher: "+", lower: "-"}', "env.max_turns": 3, "env.timeout_s": 20, "env.reward": "env",
    "env.stop_tokens": "[" + ",".join(f'"{digit}"' for digit in range(10)) + "]",
    "rollout.max_new_tokens": 24, "rl.routing_replay": True, "rl.rollout_correction.mode": "tis",
}


def test_multi_turn_rl_steps(task_files, tmp_path):
    from megacispo.metrics.logger import read_scalars

    overrides = run_overrides(task_files, tmp_path, steps=2)
    overrides += [arg for key, value in ENV.items() for arg in ("--set", f"{key}={value}")]
    run_distributed(run_train, 2, overrides, timeout_s=600)
    scalars = {name: dict(values) for name, values in read_scalars(str(tmp_path)).items()}
    assert all(math.isfinite(value) for value in scalars["loss/policy_loss"].values())
    assert min(scalars["env/turns"].values()) > 1.3, scalars["env/turns"]
    assert min(scalars["env/fed_tokens"].values()) > 0 and "env/guesses" in scalars
    assert scalars["rollout/reward_failure_frac"][1] == 0
    # fp32 rollout and training forwards of the same sequences: the gap of numerics, not of tokens.
    assert max(scalars["mismatch/abs_logp_diff_max"].values()) < 1e-3
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*"))[-1] == "step_00000002"


def test_multi_turn_rollouts_on_a_process_of_their_own(task_files, tmp_path):
    """1 training and 1 rollout process: the rollout process runs the conversations, and their env/*
    counts reach the training process's metrics."""
    from megacispo.metrics.logger import read_scalars

    placed_env = {key: value for key, value in ENV.items() if key != "rl.routing_replay"}  # not with placement
    overrides = run_overrides(task_files, tmp_path, steps=2) + PLACED
    overrides += [arg for key, value in placed_env.items() for arg in ("--set", f"{key}={value}")]
    run_distributed(run_train, 2, overrides, timeout_s=600)
    scalars = {name: dict(values) for name, values in read_scalars(str(tmp_path)).items()}
    assert all(math.isfinite(value) for value in scalars["loss/policy_loss"].values())
    assert min(scalars["env/turns"].values()) > 1.3 and min(scalars["env/fed_tokens"].values()) > 0
    assert scalars["rollout/staleness_max"] == {1: 0.0, 2: 0.0}
