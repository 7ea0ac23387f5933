"""A reward that never returns stops a run in bounded time, whatever the number of samples (issue #56).

- rl.reward_workers worker processes score a batch, one call in flight in each; once more than
  rl.max_reward_failure_frac of the decided calls (as many as there are workers, at least) have
  failed, the rest are not made: a reward that hangs on every call costs one rl.reward_timeout_s a
  batch, at 8 samples as at 512, and leaves no process behind.
- A reward late on one call in ten still scores the other nine, its late calls failures.
- A run whose reward hangs ends with one error line naming the reward, the limit and the late calls,
  exit code 2, within 2 x rl.reward_timeout_s of the reward's first call, its reward workers gone.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from megacispo.data.prompts import PromptRecord
from megacispo.data.rewards import LATE, RewardFailureError, reward_pool, score_responses
from megacispo.testing.fault_rewards import REWARD_STARTED, late_when_asked, never_returns

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 1.0
WORKERS = 2


def _live_children(before: set[int]) -> list[psutil.Process]:
    """This process's children started since ``before``, zombies aside."""
    return [child for child in psutil.Process().children(recursive=True)
            if child.pid not in before and child.is_running() and child.status() != psutil.STATUS_ZOMBIE]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("samples", [8, 512])
def test_a_reward_that_hangs_on_every_call_costs_one_time_limit_at_any_batch_size(samples, tmp_path, monkeypatch):
    started_file = tmp_path / "reward_started"
    monkeypatch.setenv(REWARD_STARTED, str(started_file))
    before = {child.pid for child in psutil.Process().children(recursive=True)}
    scores = score_responses(never_returns, ["2"] * samples, [PromptRecord("1+1=", "2")] * samples, -1.0,
                             timeout_s=TIMEOUT_S, workers=WORKERS, max_failure_frac=0.5)
    took = time.time() - started_file.stat().st_mtime  # from the first call: the workers' start-up aside
    assert took < 2 * TIMEOUT_S, f"{samples} samples took {took:.1f} s after the first call"
    assert scores.rewards == [-1.0] * samples
    assert (scores.num_late, scores.num_not_called) == (WORKERS, samples - WORKERS)
    assert scores.causes[:WORKERS] == (LATE,) * WORKERS
    assert scores.failures[0].startswith("took over rl.reward_timeout_s = 1 s and was stopped")
    assert scores.failures[-1].startswith(f"was not called: {WORKERS} of the first {WORKERS} calls failed ("
                                          f"{WORKERS} of them late), more than rl.max_reward_failure_frac = 0.5")
    assert not _live_children(before), "a stuck worker outlived the scoring"
    assert all(slot.process is None for slot in reward_pool(never_returns)._workers)


@pytest.mark.timeout(120)
def test_a_reward_late_on_one_call_in_ten_still_scores_the_rest():
    record = PromptRecord("1+1=", "2", extra={"sleep_s": 10 * TIMEOUT_S})
    responses = ["slow" if sample % 10 == 9 else ("2" if sample % 2 else "3") for sample in range(40)]
    before = {child.pid for child in psutil.Process().children(recursive=True)}
    scores = score_responses(late_when_asked, responses, [record] * 40, -1.0, timeout_s=TIMEOUT_S, workers=WORKERS,
                             max_failure_frac=0.5)
    expected = [-1.0 if response == "slow" else float(response == "2") for response in responses]
    assert scores.rewards == expected
    assert (scores.num_failures, scores.num_late, scores.num_not_called) == (4, 4, 0)
    reward_pool(late_when_asked).close()
    assert not _live_children(before)


def test_the_run_error_names_the_reward_the_limit_and_the_late_calls():
    error = RewardFailureError("my_rewards:score", 1.0, 0.5, "took over rl.reward_timeout_s = 30 s and was stopped",
                               late=4, not_called=508, time_limits="rl.reward_timeout_s = 30 s")
    assert str(error) == (
        "rl.reward = 'my_rewards:score' failed on 100% of a step's samples (4 calls late, over rl.reward_timeout_s = "
        "30 s; 508 not called once too many had failed, each counted as a failure), more than "
        "rl.max_reward_failure_frac = 0.5; the first: took over rl.reward_timeout_s = 30 s and was stopped. Fix the "
        "reward function (a reward is a number, returned within rl.reward_timeout_s = 30 s), or raise "
        "rl.max_reward_failure_frac"
    )


def test_a_run_whose_reward_hangs_ends_with_one_error_within_two_time_limits(task_files, tmp_path):
    timeout_s = 3
    started_file = tmp_path / "reward_started"
    pairs = {
        "parallel.expert_model_parallel_size": 1, "data.train_prompts": task_files / "train.jsonl",
        "data.test_prompts": "''", "data.tokenizer": task_files / "tok" / "tokenizer.model",
        "rollout.prompts_per_step": 4, "rollout.group_size": 2, "rollout.max_new_tokens": 2,
        "rl.reward": "megacispo.testing.fault_rewards:never_returns", "rl.reward_timeout_s": timeout_s,
        "rl.reward_workers": 2, "train.run_dir": tmp_path / "run", "train.steps": 2, "train.micro_batch_size": 1,
    }
    command = [sys.executable, "-m", "megacispo.train"] + [a for k, v in pairs.items() for a in ("--set", f"{k}={v}")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", REWARD_STARTED: str(started_file)}
    run = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        output, errors = run.communicate(timeout=300)
    finally:
        run.kill()
    took = time.time() - started_file.stat().st_mtime
    assert run.returncode == 2, output[-3000:] + errors[-3000:]
    assert took < 2 * timeout_s, f"the run ended {took:.1f} s after the reward's first call"
    lines = [line for line in errors.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in errors, errors[-3000:]
    assert lines[0].startswith(
        "error: rl.reward = 'megacispo.testing.fault_rewards:never_returns' failed on 100% of a step's samples "
        f"(2 calls late, over rl.reward_timeout_s = {timeout_s} s; 6 not called once too many had failed"), lines[0]
    # A reward worker's last argument is the pid of the process it serves.
    workers = [process for process in psutil.process_iter(["cmdline"])
               if (process.info["cmdline"] or [""])[-1] == str(run.pid)]
    assert not workers, "a reward worker outlived its run"
