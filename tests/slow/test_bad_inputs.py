"""The bad-input catalog's slow rows (tests/multiprocess/test_bad_inputs.py has the others): a reward
that fails on every sample stops a 2-process run at its first step with one error line."""

from __future__ import annotations

import re

import pytest

from megacispo.testing.bad_inputs import quick, run_argv, torchrun


@pytest.mark.parametrize("reward, failure", [
    ("health_rewards:always_raises", "the first: raised KeyError: "),
    ("health_rewards:returns_text", "the first: returned str '1.0', not a number"),
])
def test_a_reward_that_always_fails_stops_the_run_at_the_first_step(reward, failure, catalog_workspace, tmp_path):
    argv = quick(f"rl.reward={reward}", "train.load=''", "data.test_prompts=''", "train.steps=3",
                 "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=4",
                 "rl.updates_per_rollout=1", "train.micro_batch_size=2")
    result = torchrun(run_argv(argv, catalog_workspace, tmp_path / "run"), catalog_workspace, timeout=600)
    output = result.stdout + result.stderr
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, output[-3000:]
    assert errors[0].startswith(f"error: rl.reward = '{reward}' failed on 100% of a step's samples, more than "
                                "rl.max_reward_failure_frac = 0.5; ")
    assert failure in errors[0] and "Fix the reward function" in errors[0]
    # The first rank to exit does so with 2; torchrun then stops the others, which may still be tearing down.
    assert result.returncode != 0 and re.search(r"exitcode\s*: 2 \(pid", output), output[-3000:]
    assert not list((tmp_path / "run").glob("checkpoints/step_*")), "no step was trained"
