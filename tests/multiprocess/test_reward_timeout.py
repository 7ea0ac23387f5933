"""Rewards that never return, or return what float32 cannot hold (issue #35).

- A reward call over rl.reward_timeout_s is stopped (its worker process killed) and counts as a
  failure naming the reward and the limit; the next calls go to a fresh worker.
- A reward in flight gives way to SIGTERM: a 1-process run stuck in a reward that never returns (and
  blocks every signal) abandons its step, saves and exits 0 within seconds, with its SIGTERM lines.
- A reward of 1e39 (finite in float64, infinite in float32, the advantages' dtype) is a failure at
  scoring, naming the value, not a non-finite loss later.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from megacispo.data.prompts import PromptRecord
from megacispo.data.rewards import (
    RewardFailureError,
    ScoringInterrupted,
    exact_match,
    reward_pool,
    score_responses,
)
from megacispo.testing.fault_rewards import REWARD_STARTED, beyond_float32, never_returns

REPO = Path(__file__).resolve().parents[2]
RECORDS = [PromptRecord("1+1=", "2")] * 3


def test_a_late_call_is_a_failure_naming_the_reward_and_the_limit(caplog):
    with caplog.at_level(logging.WARNING, logger="megacispo.data.rewards"):
        started = time.monotonic()
        scores = score_responses(never_returns, ["2"] * 2, RECORDS[:2], -1.0, timeout_s=0.5)
    assert scores.rewards == [-1.0, -1.0] and scores.num_failures == 2
    assert time.monotonic() - started < 30
    warning = caplog.records[0].getMessage()
    assert "reward never_returns took over rl.reward_timeout_s = 0.5 s and was stopped" in warning
    # The same batch in-process and in the worker: the worker's verdicts are the reward's.
    assert score_responses(exact_match, ["2", "3", " 2 "], RECORDS, 0.0, timeout_s=5).rewards == [1.0, 0.0, 1.0]


def test_sigterm_stops_the_wait_for_a_reward_in_flight():
    told = threading.Event()
    threading.Timer(0.5, told.set).start()
    started = time.monotonic()
    with pytest.raises(ScoringInterrupted, match="never_returns"):
        score_responses(never_returns, ["2"], RECORDS[:1], 0.0, timeout_s=600, interrupted=told.is_set)
    assert time.monotonic() - started < 30
    assert all(slot.process is None for slot in reward_pool(never_returns)._workers), "the stuck worker is killed"


def test_a_reward_beyond_float32_is_a_failure_naming_the_value():
    scores = score_responses(beyond_float32, ["2"], RECORDS[:1], 0.0, timeout_s=5)
    assert scores.num_failures == 1
    assert scores.first_failure.startswith("returned 1e+39, beyond float32, the dtype of the advantages")
    error = RewardFailureError("megacispo.testing.fault_rewards:beyond_float32", 1.0, 0.5, scores.first_failure)
    assert "'megacispo.testing.fault_rewards:beyond_float32' failed on 100%" in str(error)
    assert "returned 1e+39, beyond float32" in str(error)


def test_sigterm_ends_a_run_stuck_in_a_reward_within_seconds(task_files, tmp_path):
    started_file = tmp_path / "reward_started"
    pairs = {
        "parallel.expert_model_parallel_size": 1, "data.train_prompts": task_files / "train.jsonl",
        "data.test_prompts": "''", "data.tokenizer": task_files / "tok" / "tokenizer.model",
        "rollout.prompts_per_step": 2, "rollout.group_size": 2, "rollout.max_new_tokens": 2,
        "rl.reward": "megacispo.testing.fault_rewards:never_returns", "rl.reward_timeout_s": 600,
        "train.run_dir": tmp_path / "run", "train.steps": 2, "train.micro_batch_size": 1,
    }
    command = [sys.executable, "-m", "megacispo.train"] + [a for k, v in pairs.items() for a in ("--set", f"{k}={v}")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", REWARD_STARTED: str(started_file)}
    run = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 300
        while not started_file.exists():
            assert run.poll() is None and time.monotonic() < deadline, run.stdout.read()[-3000:]
            time.sleep(0.2)
        workers = psutil.Process(run.pid).children(recursive=True)
        run.send_signal(signal.SIGTERM)
        output, _ = run.communicate(timeout=60)
    finally:
        run.kill()
    assert run.returncode == 0, output[-3000:]
    assert "SIGTERM: step 1 abandoned before its updates; nothing was trained, so nothing was saved" in output, output[-3000:]
    assert "SIGTERM: stopped before step 1 completed; nothing was trained, so nothing was saved" in output
    assert not [worker for worker in workers if worker.is_running() and worker.status() != psutil.STATUS_ZOMBIE]
