"""The small RL runs the end-to-end tests share: the overrides of a 2-process (EP = 2) run of the
addition task (the ``task_files`` fixture of tests/conftest.py makes its data and tokenizer),
megacispo.train's main in a harness worker, and a torchrun of it stopped by SIGTERM."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[2]
LR = 3e-3
# Rollouts on a process of their own: 1 training and 1 rollout process (megacispo.rollout.remote).
PLACED = ["--set", "parallel.expert_model_parallel_size=1", "--set", "placement.rollout_ranks=1"]


def run_overrides(data: Path, run_dir: Path, steps: int) -> list[str]:
    pairs = {
        "parallel.expert_model_parallel_size": 2,
        "data.train_prompts": data / "train.jsonl", "data.test_prompts": data / "test.jsonl",
        "data.tokenizer": data / "tok" / "tokenizer.model",
        "rollout.prompts_per_step": 4, "rollout.group_size": 4, "rollout.max_new_tokens": 4,
        "rl.updates_per_rollout": 4, "rl.reward": "megacispo.testing.reward_fixtures:odd_length",
        "rl.loss.params.eps_high": 0.02, "rl.loss.params.eps_low": 0.02,
        "optimizer.lr": LR, "optimizer.use_distributed_optimizer": False, "optimizer.decay_steps": 12,
        "train.run_dir": run_dir, "train.steps": steps, "train.micro_batch_size": 2, "train.checkpoint_every": 1,
        "train.keep_last": 5,
    }
    return [arg for key, value in pairs.items() for arg in ("--set", f"{key}={value}")]


def run_train(argv: list[str]) -> None:
    """megacispo.train's main with ``argv`` in this process (a harness worker); it must return 0."""
    from megacispo.train import main

    assert main(argv) == 0


def train_until_sigterm(overrides: list[str], log: Path) -> int:
    """``megacispo.train`` under torchrun on 2 processes; once step 1's console line is out, SIGTERM to
    every worker (as a cluster's preemption sends it). The run must exit 0 and say where it stopped:
    that step is returned."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "-m", "megacispo.train", *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    with open(log, "w") as out:
        launcher = subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 300
            while not re.search(r"^step 1 \| ", log.read_text(), re.MULTILINE):
                assert launcher.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(0.5)
            for worker in psutil.Process(launcher.pid).children():
                worker.send_signal(signal.SIGTERM)
            assert launcher.wait(timeout=300) == 0, log.read_text()[-3000:]
        finally:
            launcher.kill()
    stopped = re.search(r"SIGTERM: stopped after step (\d+)", log.read_text())
    assert stopped, log.read_text()[-3000:]
    return int(stopped.group(1))
